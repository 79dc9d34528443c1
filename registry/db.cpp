#include "registry/db.hpp"

#include <cmath>
#include <limits>

#include "core/error.hpp"

namespace lar::registry {

Db::Db(const std::filesystem::path& path, int flags, int busy_timeout_ms) {
  int rc = sqlite3_open_v2(path.c_str(), &db_, flags, nullptr);
  if (rc != SQLITE_OK) {
    std::string msg = db_ ? sqlite3_errmsg(db_) : sqlite3_errstr(rc);
    sqlite3_close(db_);
    db_ = nullptr;
    throw RuntimeError("cannot open database " + path.string() + ": " + msg);
  }
  sqlite3_extended_result_codes(db_, 1);
  sqlite3_busy_timeout(db_, busy_timeout_ms);
}

Db::~Db() {
  if (db_) sqlite3_close_v2(db_);
}

Db& Db::operator=(Db&& o) noexcept {
  if (this != &o) {
    if (db_) sqlite3_close_v2(db_);
    db_ = o.db_;
    o.db_ = nullptr;
  }
  return *this;
}

void Db::fail(const std::string& what, int rc) const {
  std::string msg = db_ ? sqlite3_errmsg(db_) : sqlite3_errstr(rc);
  throw RuntimeError("sqlite: " + msg + " (in: " + what + ")");
}

void Db::exec(const std::string& sql) {
  char* err = nullptr;
  int rc = sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, &err);
  if (rc != SQLITE_OK) {
    std::string msg = err ? err : sqlite3_errstr(rc);
    sqlite3_free(err);
    throw RuntimeError("sqlite: " + msg + " (in: " + sql.substr(0, 120) + ")");
  }
}

long long Db::scalar_int(const std::string& sql) {
  Stmt s(*this, sql);
  return s.step() ? s.col_int(0) : 0;
}

Stmt::Stmt(Db& db, const std::string& sql) : db_(db), sql_(sql) {
  int rc = sqlite3_prepare_v2(db.get(), sql.c_str(), static_cast<int>(sql.size()), &st_, nullptr);
  if (rc != SQLITE_OK) db_.fail(sql_, rc);
}

Stmt::~Stmt() { sqlite3_finalize(st_); }

Stmt& Stmt::bind(int i, long long v) {
  int rc = sqlite3_bind_int64(st_, i, v);
  if (rc != SQLITE_OK) db_.fail(sql_, rc);
  return *this;
}

Stmt& Stmt::bind(int i, double v) {
  if (!std::isfinite(v)) return bind_null(i);
  int rc = sqlite3_bind_double(st_, i, v);
  if (rc != SQLITE_OK) db_.fail(sql_, rc);
  return *this;
}

Stmt& Stmt::bind(int i, std::string_view v) {
  int rc = sqlite3_bind_text(st_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
  if (rc != SQLITE_OK) db_.fail(sql_, rc);
  return *this;
}

Stmt& Stmt::bind_null(int i) {
  int rc = sqlite3_bind_null(st_, i);
  if (rc != SQLITE_OK) db_.fail(sql_, rc);
  return *this;
}

bool Stmt::step() {
  int rc = sqlite3_step(st_);
  if (rc == SQLITE_ROW) return true;
  if (rc == SQLITE_DONE) return false;
  db_.fail(sql_, rc);
}

void Stmt::run() {
  while (step()) {
  }
  sqlite3_reset(st_);  // ready to bind again (bindings are kept)
}

void Stmt::reset() {
  sqlite3_reset(st_);
  sqlite3_clear_bindings(st_);
}

bool Stmt::is_null(int col) const { return sqlite3_column_type(st_, col) == SQLITE_NULL; }

long long Stmt::col_int(int col) const { return sqlite3_column_int64(st_, col); }

double Stmt::col_double(int col) const {
  if (is_null(col)) return std::numeric_limits<double>::quiet_NaN();
  return sqlite3_column_double(st_, col);
}

std::string Stmt::col_text(int col) const {
  const unsigned char* p = sqlite3_column_text(st_, col);
  if (!p) return {};
  return std::string(reinterpret_cast<const char*>(p), static_cast<size_t>(sqlite3_column_bytes(st_, col)));
}

Db open_read_only(const std::filesystem::path& path, int busy_timeout_ms) {
  Db db(path, SQLITE_OPEN_READONLY | SQLITE_OPEN_NOMUTEX, busy_timeout_ms);
  db.exec("PRAGMA query_only=1");
  return db;
}

Transaction::Transaction(Db& db) : db_(db) { db_.exec("BEGIN IMMEDIATE"); }

Transaction::~Transaction() {
  if (!done_) sqlite3_exec(db_.get(), "ROLLBACK", nullptr, nullptr, nullptr);
}

void Transaction::commit() {
  db_.exec("COMMIT");
  done_ = true;
}

}  // namespace lar::registry
