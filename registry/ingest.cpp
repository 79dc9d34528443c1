// Ingest run directories into the registry (docs/protocol.md).
//
// Per run, the registry remembers how many bytes of metrics.jsonl it has ingested, the
// file's inode, and a signature (size + mtime) of config.json, status.json and
// checkpoints/. A sync then reads only what is new; an unchanged run costs a few stat()
// calls and one SELECT. Each run is ingested in one BEGIN IMMEDIATE transaction that
// re-reads the stored offset under the lock, so concurrent syncs never ingest a line
// twice and a kill -9 leaves either all of a run's new rows or none.
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <optional>

#include "core/error.hpp"
#include "registry/impl.hpp"
#include "registry/metrics_reader.hpp"
#include "registry/registry.hpp"

namespace lar::registry {

namespace {

struct FileStat {
  bool exists = false;
  long long size = 0;
  long long mtime_ns = 0;
  long long inode = 0;
};

FileStat stat_of(const fs::path& p) {
  struct stat st {};
  FileStat f;
  if (::stat(p.c_str(), &st) != 0) return f;
  f.exists = true;
  f.size = static_cast<long long>(st.st_size);
  f.mtime_ns = static_cast<long long>(st.st_mtim.tv_sec) * 1000000000LL + st.st_mtim.tv_nsec;
  f.inode = static_cast<long long>(st.st_ino);
  return f;
}

std::string signature_part(const FileStat& f) {
  return f.exists ? std::to_string(f.size) + ":" + std::to_string(f.mtime_ns) : "-";
}

struct StoredRun {
  long long id = -1;
  long long offset = 0;
  long long inode = 0;
  std::string signature;
};

// What the registry remembers of a run, looked up by run id or by run directory.
std::optional<StoredRun> load_stored(Registry::Impl& impl, const char* column, const std::string& value) {
  Stmt& s = impl.stmt(std::string("SELECT id, ingest_offset, ingest_inode, ingest_signature FROM runs WHERE ") +
                      column + " = ?");
  s.bind(1, value);
  std::optional<StoredRun> out;
  if (s.step()) out = StoredRun{s.col_int(0), s.col_int(1), s.col_int(2), s.col_text(3)};
  s.reset();  // do not keep a read snapshot open
  return out;
}

// Checkpoint files are named step_XXXXXXXX.ckpt; anything else in the folder is ignored
// (e.g. a temp file of an atomic write in progress).
std::vector<CheckpointRecord> list_checkpoints(const fs::path& dir) {
  std::vector<CheckpointRecord> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::string name = e.path().filename().string();
    if (name.size() < 11 || name.rfind("step_", 0) != 0 || e.path().extension() != ".ckpt") continue;
    std::string digits = name.substr(5, name.size() - 10);
    if (digits.empty() || !std::all_of(digits.begin(), digits.end(), ::isdigit)) continue;
    CheckpointRecord c;
    c.step = std::stol(digits);
    c.path = e.path().string();
    c.bytes = static_cast<long long>(e.file_size(ec));
    out.push_back(c);
  }
  std::sort(out.begin(), out.end(), [](auto& a, auto& b) { return a.step < b.step; });
  return out;
}

}  // namespace

// Returns nullopt when nothing changed on disk since the last sync.
static std::optional<SyncedRun> ingest_run(Registry::Impl& impl, const fs::path& dir) {
  Db& db = impl.db;
  RunDir rd(dir);
  const FileStat cfg_st = stat_of(rd.config_path());
  if (!cfg_st.exists) throw RuntimeError("no config.json");
  const FileStat status_st = stat_of(rd.status_path());
  const FileStat ckpt_st = stat_of(rd.checkpoints_dir());
  const FileStat metrics_st = stat_of(rd.metrics_path());
  const std::string signature =
      signature_part(cfg_st) + "|" + signature_part(status_st) + "|" + signature_part(ckpt_st);

  auto unchanged = [&](const std::optional<StoredRun>& s) {
    return s && s->signature == signature && s->inode == metrics_st.inode &&
           s->offset == metrics_st.size;
  };
  // Fast path for an unchanged run: found by its folder, config.json not even parsed
  // (its size and mtime are part of the signature).
  const std::string abs_dir = fs::absolute(dir).lexically_normal().string();
  if (unchanged(load_stored(impl, "run_dir", abs_dir))) return std::nullopt;

  json cfg = rd.read_config();
  const std::string experiment = cfg.value("experiment", dir.parent_path().filename().string());
  const std::string cell_id = cfg.value("cell_id", dir.filename().string());
  const std::string run_id = experiment + "/" + cell_id;

  Transaction tx(db);
  auto stored = load_stored(impl, "run_id", run_id);  // under the write lock
  if (unchanged(stored)) return std::nullopt;

  SyncedRun out;
  out.run_id = run_id;
  out.is_new = !stored || stored->signature.empty();
  // A metrics file that was rewritten (new inode: atomic rewrite on resume) or truncated
  // (shorter than what we ingested) is re-ingested from the start.
  long long offset = stored ? stored->offset : 0;
  if (stored && stored->offset > 0 &&
      (!metrics_st.exists || metrics_st.inode != stored->inode || metrics_st.size < stored->offset)) {
    out.reset = true;
    offset = 0;
  }

  std::optional<RunStatus> status = rd.read_status();
  RunStatus st = status.value_or(RunStatus{});
  const double now = unix_now();

  impl.stmt("INSERT OR IGNORE INTO experiments(name, created_at) VALUES (?, ?)")
      .bind(1, experiment).bind(2, now).run();
  std::string baseline = cfg.contains("baseline") && cfg["baseline"].is_string()
                             ? cfg["baseline"].get<std::string>() : "";
  Stmt& cell = impl.stmt("INSERT INTO cells(experiment, cell_id, hash, axes, role, baseline, config) "
            "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(experiment, cell_id) DO UPDATE SET "
            "hash = excluded.hash, axes = excluded.axes, role = excluded.role, "
            "baseline = excluded.baseline, config = excluded.config");
  cell.bind(1, experiment).bind(2, cell_id).bind(3, cfg.value("hash", std::string()));
  cell.bind(4, canonical_dump(cfg.contains("axes") && cfg["axes"].is_object() ? cfg["axes"] : json::object()));
  cell.bind(5, cfg.value("role", std::string("main"))).bind(6, baseline);
  cell.bind(7, canonical_dump(cfg.contains("config") ? cfg["config"] : json::object()));
  cell.run();

  Stmt& run = impl.stmt("INSERT INTO runs(run_id, experiment, cell_id, run_dir, status, step, total_steps, "
           "reason, attempts, host, summary, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?) "
           "ON CONFLICT(run_id) DO UPDATE SET run_dir = excluded.run_dir, status = excluded.status, "
           "step = excluded.step, total_steps = excluded.total_steps, reason = excluded.reason, "
           "attempts = excluded.attempts, host = excluded.host, summary = excluded.summary, "
           "updated_at = excluded.updated_at");
  run.bind(1, run_id).bind(2, experiment).bind(3, cell_id).bind(4, fs::absolute(dir).lexically_normal().string());
  run.bind(5, to_string(st.state)).bind(6, st.step).bind(7, st.total_steps).bind(8, st.reason);
  run.bind(9, st.attempt).bind(10, st.host).bind(11, canonical_dump(st.summary));
  run.bind(12, st.updated_at > 0 ? st.updated_at : now);
  run.run();
  const long long rowid = impl.require_rowid(run_id);

  // Status history and attempts are small: rewrite them from status.json.
  impl.stmt("DELETE FROM status_history WHERE run = ?").bind(1, rowid).run();
  impl.stmt("DELETE FROM attempts WHERE run = ?").bind(1, rowid).run();
  Stmt& hist = impl.stmt("INSERT INTO status_history(run, seq, state, at, step, reason, attempt) VALUES (?,?,?,?,?,?,?)");
  std::map<int, std::vector<const StatusEvent*>> by_attempt;
  for (size_t i = 0; i < st.history.size(); ++i) {
    const auto& e = st.history[i];
    hist.bind(1, rowid).bind(2, static_cast<long long>(i)).bind(3, to_string(e.state)).bind(4, e.at);
    hist.bind(5, e.step).bind(6, e.reason).bind(7, e.attempt);
    hist.run();
    hist.reset();
    if (e.attempt > 0) by_attempt[e.attempt].push_back(&e);
  }
  Stmt& att = impl.stmt("INSERT INTO attempts(run, attempt, started_at, ended_at, final_state, last_step) VALUES (?,?,?,?,?,?)");
  for (const auto& [n, evs] : by_attempt) {
    att.bind(1, rowid).bind(2, n).bind(3, evs.front()->at).bind(4, evs.back()->at);
    att.bind(5, to_string(evs.back()->state)).bind(6, evs.back()->step);
    att.run();
    att.reset();
  }

  impl.stmt("DELETE FROM checkpoints WHERE run = ?").bind(1, rowid).run();
  Stmt& ck = impl.stmt("INSERT OR REPLACE INTO checkpoints(run, step, path, bytes) VALUES (?,?,?,?)");
  for (const auto& c : list_checkpoints(rd.checkpoints_dir())) {
    ck.bind(1, rowid).bind(2, c.step).bind(3, c.path).bind(4, c.bytes);
    ck.run();
    ck.reset();
  }

  // Metrics: only the complete lines after the stored offset (a torn last line stays
  // for the next sync).
  if (out.reset) {
    impl.stmt("DELETE FROM metrics WHERE run = ?").bind(1, rowid).run();
    impl.stmt("DELETE FROM evals WHERE run = ?").bind(1, rowid).run();
    impl.stmt("UPDATE runs SET bad_lines = 0 WHERE id = ?").bind(1, rowid).run();
  }
  ParsedMetrics chunk = parse_metrics_file(rd.metrics_path(), static_cast<uint64_t>(offset));
  // Insert grouped by metric name (steps already ascend within a name): the rows then
  // arrive in primary-key order (run, name, step, line), so inserts append at the
  // B-tree's right edge instead of landing all over it.
  std::stable_sort(chunk.rows.begin(), chunk.rows.end(),
                   [&](const auto& a, const auto& b) { return chunk.names[a.name] < chunk.names[b.name]; });
  Stmt& ins = impl.stmt("INSERT INTO metrics(run, name, step, line, tokens, value, wall_time) VALUES (?,?,?,?,?,?,?)");
  for (const auto& r : chunk.rows) {
    ins.bind(1, rowid).bind(2, chunk.names[r.name]).bind(3, r.step).bind(4, static_cast<long long>(r.line));
    ins.bind(5, r.tokens).bind(6, r.value).bind(7, r.wall_time);
    ins.run();
    ++out.metric_rows;
  }
  Stmt& ev = impl.stmt("INSERT INTO evals(run, step, tokens, wall_time, results) VALUES (?,?,?,?,?)");
  for (const auto& e : chunk.evals) {
    ev.bind(1, rowid).bind(2, e.step).bind(3, e.tokens).bind(4, e.wall_time).bind(5, e.results);
    ev.run();
  }
  out.bad_lines = chunk.bad_lines;
  // Only a torn last line was new: nothing to record yet (it is read once complete).
  const bool nothing_new = stored && stored->signature == signature && !out.reset &&
                           chunk.next_offset == static_cast<uint64_t>(offset);

  Stmt& upd = impl.stmt("UPDATE runs SET ingest_offset = ?, ingest_inode = ?, ingest_signature = ?, "
           "bad_lines = bad_lines + ? WHERE id = ?");
  upd.bind(1, static_cast<long long>(chunk.next_offset)).bind(2, metrics_st.inode).bind(3, signature);
  upd.bind(4, chunk.bad_lines).bind(5, rowid);
  upd.run();
  tx.commit();
  if (nothing_new) return std::nullopt;

  out.status = st.state;
  out.step = st.step;
  out.total_steps = st.total_steps;
  return out;
}

SyncedRun Registry::sync_run(const fs::path& run_dir) {
  if (impl_->read_only) throw RuntimeError("registry opened read-only");
  auto r = ingest_run(*impl_, run_dir);
  if (r) return *r;
  // Unchanged: report what the registry holds.
  SyncedRun s;
  json cfg = RunDir(run_dir).read_config();
  s.run_id = cfg.value("experiment", run_dir.parent_path().filename().string()) + "/" +
             cfg.value("cell_id", run_dir.filename().string());
  if (auto rec = run(s.run_id)) {
    s.status = rec->status;
    s.step = rec->step;
    s.total_steps = rec->total_steps;
  }
  return s;
}

SyncStats Registry::sync(const fs::path& runs_root) {
  if (impl_->read_only) throw RuntimeError("registry opened read-only");
  auto t0 = std::chrono::steady_clock::now();
  SyncStats stats;
  std::error_code ec;
  if (!fs::is_directory(runs_root, ec)) {
    stats.seconds = 0;
    return stats;  // no runs yet: nothing to ingest
  }
  // runs_root/<experiment>/<cell>/ — sorted so that output and ingest order are stable.
  // Moved-aside folders (<cell>.old-<n>) are history: they carry their cell's id and would
  // overwrite the live run's record.
  std::vector<fs::path> dirs;
  for (const auto& e : fs::directory_iterator(runs_root, ec)) {
    if (!e.is_directory()) continue;
    for (const auto& c : fs::directory_iterator(e.path(), ec))
      if (c.is_directory() && !is_moved_aside(c.path().filename().string()) && fs::exists(c.path() / "config.json"))
        dirs.push_back(c.path());
  }
  std::sort(dirs.begin(), dirs.end());
  for (const auto& d : dirs) {
    ++stats.runs_seen;
    try {
      auto r = ingest_run(*impl_, d);
      if (!r) {
        ++stats.runs_unchanged;
        continue;
      }
      ++stats.runs_changed;
      stats.metric_rows += r->metric_rows;
      stats.changed.push_back(std::move(*r));
    } catch (const RuntimeError& e) {
      stats.errors.push_back(d.string() + ": " + e.what());
    } catch (const json::exception& e) {
      stats.errors.push_back(d.string() + ": " + e.what());
    }
  }
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return stats;
}

}  // namespace lar::registry
