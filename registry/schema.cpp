#include "registry/schema.hpp"

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "core/error.hpp"
#include "registry/registry.hpp"

namespace lar::registry {

namespace {

// Migration i (1-based) brings user_version from i-1 to i.
const std::vector<std::string>& migrations() {
  static const std::vector<std::string> m = {
      // 1: the base schema.
      R"sql(
CREATE TABLE experiments (
  name        TEXT PRIMARY KEY,
  created_at  REAL NOT NULL
);
CREATE TABLE cells (
  experiment  TEXT NOT NULL,
  cell_id     TEXT NOT NULL,
  hash        TEXT NOT NULL DEFAULT '',
  axes        TEXT NOT NULL DEFAULT '{}',
  role        TEXT NOT NULL DEFAULT 'main',
  baseline    TEXT NOT NULL DEFAULT '',
  config      TEXT NOT NULL DEFAULT '{}',
  PRIMARY KEY (experiment, cell_id)
);
CREATE INDEX cells_hash ON cells(hash);
-- One row per run directory. The ingest_* columns remember what was read from disk so
-- that the next sync reads only what is new.
CREATE TABLE runs (
  id              INTEGER PRIMARY KEY,
  run_id          TEXT NOT NULL UNIQUE,
  experiment      TEXT NOT NULL,
  cell_id         TEXT NOT NULL,
  run_dir         TEXT NOT NULL DEFAULT '',
  status          TEXT NOT NULL DEFAULT 'pending',
  step            INTEGER NOT NULL DEFAULT 0,
  total_steps     INTEGER NOT NULL DEFAULT 0,
  reason          TEXT NOT NULL DEFAULT '',
  attempts        INTEGER NOT NULL DEFAULT 0,
  host            TEXT NOT NULL DEFAULT '',
  summary         TEXT NOT NULL DEFAULT '{}',
  updated_at      REAL NOT NULL DEFAULT 0,
  ingest_offset   INTEGER NOT NULL DEFAULT 0,   -- bytes of metrics.jsonl ingested
  ingest_inode    INTEGER NOT NULL DEFAULT 0,   -- inode of that file (a rewrite changes it)
  ingest_signature TEXT NOT NULL DEFAULT '',    -- sizes/mtimes of config, status, checkpoints
  bad_lines       INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX runs_experiment ON runs(experiment, cell_id);
CREATE TABLE status_history (
  run      INTEGER NOT NULL REFERENCES runs(id),
  seq      INTEGER NOT NULL,
  state    TEXT NOT NULL,
  at       REAL NOT NULL,
  step     INTEGER NOT NULL,
  reason   TEXT NOT NULL,
  attempt  INTEGER NOT NULL,
  PRIMARY KEY (run, seq)
);
CREATE TABLE attempts (
  run          INTEGER NOT NULL REFERENCES runs(id),
  attempt      INTEGER NOT NULL,
  started_at   REAL NOT NULL,
  ended_at     REAL NOT NULL,
  final_state  TEXT NOT NULL,
  last_step    INTEGER NOT NULL,
  PRIMARY KEY (run, attempt)
);
CREATE TABLE metrics (
  run        INTEGER NOT NULL,
  name       TEXT NOT NULL,
  step       INTEGER NOT NULL,
  tokens     REAL,
  value      REAL,          -- NULL: the trainer logged NaN/Inf
  wall_time  REAL
);
CREATE INDEX metrics_run_name_step ON metrics(run, name, step);
CREATE TABLE checkpoints (
  run    INTEGER NOT NULL REFERENCES runs(id),
  step   INTEGER NOT NULL,
  path   TEXT NOT NULL,
  bytes  INTEGER NOT NULL,
  PRIMARY KEY (run, step)
);
CREATE TABLE evals (
  run        INTEGER NOT NULL REFERENCES runs(id),
  step       INTEGER NOT NULL,
  tokens     REAL,
  wall_time  REAL,
  results    TEXT NOT NULL
);
CREATE INDEX evals_run_step ON evals(run, step);
)sql",
      // 2: `lar runs --status` and `lar status` filter by state.
      R"sql(
CREATE INDEX runs_status ON runs(status);
)sql",
      // 3: sync finds an unchanged run by its folder without parsing its config.
      R"sql(
CREATE INDEX runs_run_dir ON runs(run_dir);
)sql",
      // 4: metrics clustered by (run, name, step): the table is its own index, so an
      // ingested row is written once instead of twice (table + index) and a series is
      // one contiguous range. `line` (the line's byte offset in metrics.jsonl) keeps
      // rows of a repeated step apart and in file order.
      R"sql(
CREATE TABLE metrics_clustered (
  run        INTEGER NOT NULL,
  name       TEXT NOT NULL,
  step       INTEGER NOT NULL,
  line       INTEGER NOT NULL,
  tokens     REAL,
  value      REAL,
  wall_time  REAL,
  PRIMARY KEY (run, name, step, line)
) WITHOUT ROWID;
INSERT INTO metrics_clustered(run, name, step, line, tokens, value, wall_time)
  SELECT run, name, step, rowid, tokens, value, wall_time FROM metrics;
DROP TABLE metrics;
ALTER TABLE metrics_clustered RENAME TO metrics;
)sql",
  };
  return m;
}

}  // namespace

// Switching to WAL needs a moment of exclusive access. When several processes open a fresh
// database at once, SQLite answers SQLITE_BUSY at once instead of waiting (it skips the busy
// handler where waiting could deadlock two lock upgrades), so retry here, up to 30 s. WAL is
// stored in the file: once one process has switched, the others find it set.
static void set_wal(Db& db) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (int attempt = 0;; ++attempt) {
    int rc = sqlite3_exec(db.get(), "PRAGMA journal_mode=WAL", nullptr, nullptr, nullptr);
    if (rc == SQLITE_OK) return;
    const int primary = rc & 0xff;
    if ((primary != SQLITE_BUSY && primary != SQLITE_LOCKED) || std::chrono::steady_clock::now() > deadline)
      db.fail("PRAGMA journal_mode=WAL", rc);
    std::this_thread::sleep_for(std::chrono::milliseconds(2 + 2 * std::min(attempt, 25)));
  }
}

int schema_version() { return static_cast<int>(migrations().size()); }

void configure_connection(Db& db, bool read_only) {
  db.exec("PRAGMA foreign_keys=OFF");
  // Memory-map the database: a listing of 10,000 runs touches tens of MB of pages, and
  // copying them through read() costs more than the query itself.
  db.exec("PRAGMA mmap_size=1073741824");
  if (read_only) return;
  // WAL: readers never block the writer and vice versa.
  set_wal(db);
  // In WAL mode NORMAL is durable against process crashes (kill -9); only an OS crash
  // can lose the last transactions, which the next sync re-reads from the run dirs.
  db.exec("PRAGMA synchronous=NORMAL");
  // A 64 MiB page cache: ingesting a large chunk keeps the metrics index in memory.
  db.exec("PRAGMA cache_size=-65536");
}

void migrate(Db& db) {
  const int target = schema_version();
  auto too_new = [&](int v) {
    return RuntimeError("the registry database has schema version " + std::to_string(v) +
                        ", newer than this lar (" + std::to_string(target) + "); upgrade lar");
  };
  int seen = static_cast<int>(db.scalar_int("PRAGMA user_version"));
  if (seen == target) return;  // fast path, no lock
  if (seen > target) throw too_new(seen);
  Transaction tx(db);
  // Re-read under the write lock: another process may have migrated meanwhile.
  int version = static_cast<int>(db.scalar_int("PRAGMA user_version"));
  if (version > target) throw too_new(version);
  for (int v = version; v < target; ++v) db.exec(migrations()[static_cast<size_t>(v)]);
  db.exec("PRAGMA user_version=" + std::to_string(target));
  tx.commit();
}

}  // namespace lar::registry
