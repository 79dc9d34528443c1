#pragma once
// Internal: what Registry's source files share. Not part of the public API.
#include <filesystem>

#include "registry/db.hpp"
#include "registry/registry.hpp"

namespace lar::registry {

struct Registry::Impl {
  std::filesystem::path path;
  bool read_only = false;
  Db db;
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
