// Migrations: a fresh database gets the newest schema; re-opening changes nothing; an
// older database is migrated forward; a newer one is refused.
#include <gtest/gtest.h>

#include "core/error.hpp"
#include "helpers.hpp"
#include "registry/db.hpp"
#include "registry/registry.hpp"

using namespace lar;
using namespace lar::registry;
using namespace regtest;

static std::vector<std::string> tables(Db& db) {
  Stmt s(db, "SELECT name FROM sqlite_master WHERE type='table' ORDER BY name");
  std::vector<std::string> out;
  while (s.step()) out.push_back(s.col_text(0));
  return out;
}

TEST(Schema, FreshDatabaseHasEveryTableAndTheNewestVersion) {
  fs::path db = temp_dir("schema_fresh") / "sub" / "lar.db";  // parent folders are created
  auto reg = Registry::open(db);
  EXPECT_EQ(reg.user_version(), schema_version());
  EXPECT_GE(schema_version(), 4);
  Db raw(db, SQLITE_OPEN_READONLY);
  EXPECT_EQ(tables(raw), (std::vector<std::string>{"attempts", "cells", "checkpoints", "evals",
                                                    "experiments", "metrics", "runs", "status_history"}));
  Stmt jm(raw, "PRAGMA journal_mode");
  ASSERT_TRUE(jm.step());
  EXPECT_EQ(jm.col_text(0), "wal");
  // Metrics are clustered by (run, name, step): a series is read straight off the key.
  Stmt plan(raw, "EXPLAIN QUERY PLAN SELECT value FROM metrics WHERE run = 1 AND name = 'loss' ORDER BY step");
  std::string detail;
  while (plan.step()) detail += plan.col_text(3) + ";";
  EXPECT_EQ(detail, "SEARCH metrics USING PRIMARY KEY (run=? AND name=?);") << detail;
}

TEST(Schema, ReopenKeepsDataAndVersion) {
  fs::path db = temp_dir("schema_reopen") / "lar.db";
  {
    auto reg = Registry::open(db);
    reg.register_cells({{"e", "c1", "h1", json::object(), "main", "", json::object(), "/x"}});
  }
  auto reg = Registry::open(db);
  EXPECT_EQ(reg.user_version(), schema_version());
  EXPECT_EQ(reg.run_ids(), std::vector<std::string>{"e/c1"});
}

TEST(Schema, OlderDatabaseIsMigratedForward) {
  fs::path db = temp_dir("schema_old") / "lar.db";
  { Registry::open(db); }
  {
    // Make it look like a version-1 database with data: undo what migrations 2-4 did.
    Db raw(db, SQLITE_OPEN_READWRITE);
    raw.exec(
        "DROP INDEX runs_status; DROP INDEX runs_run_dir; DROP TABLE metrics;"
        "CREATE TABLE metrics (run INTEGER NOT NULL, name TEXT NOT NULL, step INTEGER NOT NULL,"
        "  tokens REAL, value REAL, wall_time REAL);"
        "CREATE INDEX metrics_run_name_step ON metrics(run, name, step);"
        "INSERT INTO runs(run_id, experiment, cell_id) VALUES ('e/c', 'e', 'c');"
        "INSERT INTO metrics VALUES (1, 'loss', 2, 20, 4.5, 1.0), (1, 'loss', 1, 10, 5.5, 0.5);"
        "PRAGMA user_version=1;");
  }
  auto reg = Registry::open(db);
  EXPECT_EQ(reg.user_version(), schema_version());
  auto loss = reg.metric_series("e/c", "loss");  // the rows survived the move to the new table
  ASSERT_EQ(loss.size(), 2u);
  EXPECT_EQ(loss[0].step, 1);
  EXPECT_DOUBLE_EQ(loss[0].value, 5.5);
  EXPECT_DOUBLE_EQ(loss[1].value, 4.5);
  Db raw(db, SQLITE_OPEN_READONLY);
  EXPECT_EQ(raw.scalar_int("SELECT COUNT(*) FROM sqlite_master WHERE name='runs_status'"), 1);
  EXPECT_EQ(raw.scalar_int("SELECT COUNT(*) FROM pragma_table_info('metrics') WHERE name='line'"), 1);
}

TEST(Schema, NewerDatabaseIsRefused) {
  fs::path db = temp_dir("schema_new") / "lar.db";
  { Registry::open(db); }
  {
    Db raw(db, SQLITE_OPEN_READWRITE);
    raw.exec("PRAGMA user_version=999");
  }
  try {
    Registry::open(db);
    FAIL() << "expected RuntimeError";
  } catch (const RuntimeError& e) {
    EXPECT_NE(std::string(e.what()).find("schema version 999, newer than this lar"), std::string::npos) << e.what();
  }
}

TEST(Schema, ReadOnlyOpenOfMissingDatabaseIsAUserError) {
  fs::path db = temp_dir("schema_missing") / "nope.db";
  try {
    Registry::open(db, /*read_only=*/true);
    FAIL() << "expected UserError";
  } catch (const UserError& e) {
    EXPECT_EQ(std::string(e.what()),
              "no registry at " + db.string() + " (run `lar sync` to create it, or pass --db PATH)");
  }
  EXPECT_FALSE(fs::exists(db));  // nothing written
}

TEST(Schema, ReadOnlyConnectionRefusesWrites) {
  fs::path db = temp_dir("schema_ro") / "lar.db";
  { Registry::open(db); }
  auto reg = Registry::open(db, true);
  EXPECT_THROW(reg.register_cells({{"e", "c", "h", json::object(), "main", "", json::object(), ""}}), RuntimeError);
  EXPECT_THROW(reg.sync(db.parent_path()), RuntimeError);
}
