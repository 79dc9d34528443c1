#pragma once
// Internal: what Registry's source files share. Not part of the public API.
#include <filesystem>
#include <memory>
#include <string>
#include <unordered_map>

#include "registry/db.hpp"
#include "registry/registry.hpp"

namespace lar::registry {

struct Registry::Impl {
  std::filesystem::path path;
  bool read_only = false;
  Db db;
  // Prepared statements kept for the connection's life (ingest runs the same dozen
  // statements for every run; preparing them each time costs more than executing them).
  // Declared after db so that they are finalized before it closes.
  std::unordered_map<std::string, std::unique_ptr<Stmt>> statements;
  // The cached statement for `sql`, reset and with cleared bindings. Callers that stop
  // reading before SQLITE_DONE must reset() it (an open read would pin a snapshot).
  Stmt& stmt(const std::string& sql);
  // Internal row id of a run, or -1.
  long long run_rowid(const std::string& run_id);
  // Like run_rowid, but UserError "unknown run" when absent.
  long long require_rowid(const std::string& run_id);
};

// '$."a"."b"' for the dotted path "a.b" (each segment quoted: keys may hold any character).
std::string json_path(const std::string& dotted);
// '$."key"' for one key that may itself contain dots (axis names, summary keys).
std::string json_key_path(const std::string& key);

}  // namespace lar::registry
