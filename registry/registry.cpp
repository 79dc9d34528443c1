// Registry: opening (create + migrate), registering planned cells, health checks.
#include "registry/registry.hpp"

#include <unistd.h>

#include "core/error.hpp"
#include "registry/impl.hpp"
#include "registry/schema.hpp"

namespace lar::registry {

static std::string quote_segment(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

std::string json_path(const std::string& dotted) {
  std::string out = "$";
  size_t start = 0;
  while (true) {
    size_t dot = dotted.find('.', start);
    out += "." + quote_segment(dotted.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return out;
}

std::string json_key_path(const std::string& key) { return "$." + quote_segment(key); }

Stmt& Registry::Impl::stmt(const std::string& sql) {
  auto it = statements.find(sql);
  if (it == statements.end()) it = statements.emplace(sql, std::make_unique<Stmt>(db, sql)).first;
  it->second->reset();
  return *it->second;
}

long long Registry::Impl::run_rowid(const std::string& run_id) {
  Stmt& s = stmt("SELECT id FROM runs WHERE run_id = ?");
  s.bind(1, run_id);
  long long id = s.step() ? s.col_int(0) : -1;
  s.reset();
  return id;
}

long long Registry::Impl::require_rowid(const std::string& run_id) {
  long long id = run_rowid(run_id);
  if (id < 0) throw UserError("unknown run '" + run_id + "'");
  return id;
}

Registry::Registry(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Registry::~Registry() = default;
Registry::Registry(Registry&&) noexcept = default;
Registry& Registry::operator=(Registry&&) noexcept = default;

const fs::path& Registry::path() const { return impl_->path; }

int Registry::user_version() const { return static_cast<int>(impl_->db.scalar_int("PRAGMA user_version")); }

Registry Registry::open(const fs::path& path, bool read_only) {
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  impl->read_only = read_only;
  if (read_only) {
    if (!fs::exists(path))
      throw UserError("no registry at " + path.string() +
                      " (run `lar sync` to create it, or pass --db PATH)");
    // Open read-write when we may (a WAL database needs its -shm file, and an older
    // schema is migrated first), then forbid writes on this connection.
    bool writable = ::access(path.c_str(), W_OK) == 0 &&
                    ::access(path.parent_path().empty() ? "." : path.parent_path().c_str(), W_OK) == 0;
    impl->db = Db(path, (writable ? SQLITE_OPEN_READWRITE : SQLITE_OPEN_READONLY) | SQLITE_OPEN_NOMUTEX);
    configure_connection(impl->db, true);
    if (writable) migrate(impl->db);
    else if (impl->db.scalar_int("PRAGMA user_version") != schema_version())
      throw RuntimeError("registry " + path.string() + " needs a schema migration but is read-only");
    impl->db.exec("PRAGMA query_only=1");
  } else {
    if (path.has_parent_path()) fs::create_directories(path.parent_path());
    // NOMUTEX: a Registry is used from one thread at a time; SQLite's own per-call
    // locking would only cost time.
    impl->db = Db(path, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX);
    configure_connection(impl->db, false);
    migrate(impl->db);
  }
  return Registry(std::move(impl));
}

void Registry::register_cells(const std::vector<PlannedCell>& cells) {
  if (impl_->read_only) throw RuntimeError("registry opened read-only");
  Db& db = impl_->db;
  const double now = unix_now();
  Transaction tx(db);
  Stmt exp(db, "INSERT OR IGNORE INTO experiments(name, created_at) VALUES (?, ?)");
  Stmt cell(db,
            "INSERT INTO cells(experiment, cell_id, hash, axes, role, baseline, config) "
            "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(experiment, cell_id) DO UPDATE SET "
            "hash = excluded.hash, axes = excluded.axes, role = excluded.role, "
            "baseline = excluded.baseline, config = excluded.config");
  // A run that already exists keeps its status: registering again never resets progress.
  Stmt run(db,
           "INSERT INTO runs(run_id, experiment, cell_id, run_dir, status, updated_at) "
           "VALUES (?, ?, ?, ?, 'pending', ?) ON CONFLICT(run_id) DO UPDATE SET "
           "run_dir = CASE WHEN excluded.run_dir <> '' THEN excluded.run_dir ELSE runs.run_dir END");
  for (const auto& c : cells) {
    if (c.experiment.empty() || c.cell_id.empty())
      throw UserError("register_cells: a cell needs an experiment and a cell id (got '" +
                      c.experiment + "/" + c.cell_id + "')");
    exp.bind(1, c.experiment).bind(2, now);
    exp.run();
    exp.reset();
    cell.bind(1, c.experiment).bind(2, c.cell_id).bind(3, c.hash).bind(4, canonical_dump(c.axes));
    cell.bind(5, c.role).bind(6, c.baseline).bind(7, canonical_dump(c.config));
    cell.run();
    cell.reset();
    run.bind(1, c.experiment + "/" + c.cell_id).bind(2, c.experiment).bind(3, c.cell_id);
    // Stored absolute and normalised, as sync stores it (sync finds runs by folder).
    run.bind(4, c.run_dir.empty() ? std::string() : fs::absolute(c.run_dir).lexically_normal().string());
    run.bind(5, now);
    run.run();
    run.reset();
  }
  tx.commit();
}

std::string Registry::integrity_check() {
  Stmt s(impl_->db, "PRAGMA integrity_check");
  std::string out;
  while (s.step()) out += (out.empty() ? "" : "\n") + s.col_text(0);
  return out;
}

}  // namespace lar::registry
