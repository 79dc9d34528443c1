#pragma once
// A small RAII layer over libsqlite3: Db (one connection), Stmt (prepared statement
// with bind/step/column), Transaction (BEGIN IMMEDIATE … COMMIT, rolled back unless
// committed). Every SQLite failure becomes a lar::RuntimeError naming the statement.
#include <sqlite3.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

namespace lar::registry {

class Db {
 public:
  Db() = default;
  // flags: SQLITE_OPEN_* ; busy_timeout_ms: how long a writer waits for the lock.
  Db(const std::filesystem::path& path, int flags, int busy_timeout_ms = 30000);
  ~Db();
  Db(Db&& o) noexcept : db_(o.db_) { o.db_ = nullptr; }
  Db& operator=(Db&& o) noexcept;
  Db(const Db&) = delete;
  Db& operator=(const Db&) = delete;

  sqlite3* get() const { return db_; }
  void exec(const std::string& sql);            // one or more statements, no results
  long long scalar_int(const std::string& sql);  // first column of the first row (0 if none)
  long long last_insert_rowid() const { return sqlite3_last_insert_rowid(db_); }
  int changes() const { return sqlite3_changes(db_); }
  [[noreturn]] void fail(const std::string& what, int rc) const;

 private:
  sqlite3* db_ = nullptr;
};

class Stmt {
 public:
  Stmt(Db& db, const std::string& sql);
  ~Stmt();
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;

  // Bind by 1-based index. Returns *this for chaining.
  Stmt& bind(int i, long long v);
  Stmt& bind(int i, int v) { return bind(i, static_cast<long long>(v)); }
  Stmt& bind(int i, long v) { return bind(i, static_cast<long long>(v)); }
  Stmt& bind(int i, double v);   // NaN/Inf bind as NULL (SQLite has no NaN)
  Stmt& bind(int i, std::string_view v);
  Stmt& bind(int i, const std::string& v) { return bind(i, std::string_view(v)); }
  Stmt& bind(int i, const char* v) { return bind(i, std::string_view(v)); }
  Stmt& bind_null(int i);

  bool step();   // true: a row is available; false: done
  void run();    // step until done, then reset keeping bindings (for writes)
  void reset();  // ready to bind and step again (bindings are cleared)

  bool is_null(int col) const;
  long long col_int(int col) const;
  double col_double(int col) const;   // NaN when NULL
  std::string col_text(int col) const;

 private:
  Db& db_;
  sqlite3_stmt* st_ = nullptr;
  std::string sql_;
};

// A connection that cannot write: SQLITE_OPEN_READONLY plus PRAGMA query_only, so not
// even a stray PRAGMA changes the file (used by `lar serve`). The file must exist.
Db open_read_only(const std::filesystem::path& path, int busy_timeout_ms = 30000);

// BEGIN IMMEDIATE: takes the write lock up front (waiting up to busy_timeout), so a
// writer never fails half-way with SQLITE_BUSY on lock upgrade.
class Transaction {
 public:
  explicit Transaction(Db& db);
  ~Transaction();  // rolls back unless commit() was called
  Transaction(const Transaction&) = delete;
  Transaction& operator=(const Transaction&) = delete;
  void commit();

 private:
  Db& db_;
  bool done_ = false;
};

}  // namespace lar::registry
