#include "serve/data.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "registry/views.hpp"
#include "serve/artifacts.hpp"
#include "serve/http_error.hpp"
#include "serve/svg_chart.hpp"
#include "serve/text.hpp"

namespace lar::serve {

using registry::Stmt;

Connection::Connection(const fs::path& db)
    : reg(registry::Registry::open(db, /*read_only=*/true)), raw(registry::open_read_only(db)) {}

ConnectionPool::ConnectionPool(fs::path db, size_t max) : db_(std::move(db)), max_(std::max<size_t>(max, 1)) {}

ConnectionPool::Lease::~Lease() {
  if (!c_) return;
  std::lock_guard lk(pool_->mu_);
  pool_->idle_.push_back(std::move(c_));
  pool_->cv_.notify_one();
}

ConnectionPool::Lease ConnectionPool::acquire() {
  std::unique_lock lk(mu_);
  cv_.wait(lk, [&] { return !idle_.empty() || created_ < max_; });
  if (!idle_.empty()) {
    auto c = std::move(idle_.back());
    idle_.pop_back();
    return Lease(this, std::move(c));
  }
  ++created_;
  lk.unlock();
  try {
    return Lease(this, std::make_unique<Connection>(db_));
  } catch (...) {
    std::lock_guard relock(mu_);
    --created_;
    cv_.notify_one();
    throw;
  }
}

void check_servable(const fs::path& db) {
  if (!fs::exists(db))
    throw UserError("no registry at " + db.string() + " (run `lar sync` to create it, or pass --db PATH)");
  registry::Db raw = registry::open_read_only(db);
  const long long v = raw.scalar_int("PRAGMA user_version");
  if (v != registry::schema_version())
    throw UserError(fmt::format("registry {} has schema version {}, this lar uses {}: run `lar sync` once to "
                                "migrate it (lar serve never writes to the registry)",
                                db.string(), v, registry::schema_version()));
}

json experiments_json(Connection& c) {
  std::map<std::string, json> by_name;
  for (const auto& name : c.reg.experiments())
    by_name[name] = {{"name", name}, {"runs", 0}, {"by_status", json::object()}, {"completed", 0},
                     {"step", 0},    {"total_steps", 0}, {"progress", 0.0}, {"updated_at", 0.0}};
  Stmt s(c.raw,
         "SELECT experiment, status, COUNT(*), SUM(MIN(step, total_steps)), SUM(total_steps), MAX(updated_at) "
         "FROM runs GROUP BY experiment, status");
  while (s.step()) {
    const std::string name = s.col_text(0);
    json& e = by_name[name];
    if (e.is_null())
      e = {{"name", name}, {"runs", 0}, {"by_status", json::object()}, {"completed", 0},
           {"step", 0},    {"total_steps", 0}, {"progress", 0.0}, {"updated_at", 0.0}};
    const long long n = s.col_int(2);
    e["by_status"][s.col_text(1)] = n;
    e["runs"] = e["runs"].get<long long>() + n;
    if (s.col_text(1) == "completed") e["completed"] = n;
    e["step"] = e["step"].get<long long>() + s.col_int(3);
    e["total_steps"] = e["total_steps"].get<long long>() + s.col_int(4);
    const double at = s.is_null(5) ? 0.0 : s.col_double(5);
    e["updated_at"] = std::max(e["updated_at"].get<double>(), at);
  }
  json out = json::array();
  for (auto& [_, e] : by_name) {
    const long long total = e["total_steps"].get<long long>();
    // Completed runs count in full even when they stopped short of their plan.
    e["progress"] = total > 0 ? std::min(1.0, static_cast<double>(e["step"].get<long long>()) / static_cast<double>(total)) : 0.0;
    out.push_back(std::move(e));
  }
  return out;
}

RunQuery parse_run_query(const std::multimap<std::string, std::string>& params) {
  RunQuery q;
  for (const auto& [k, v] : params) {
    if (k == "experiment") {
      if (v.empty()) continue;
      if (!valid_name(v)) throw HttpError(400, "bad experiment name");
      q.experiment = v;
    } else if (k == "status") {
      size_t start = 0;
      while (start <= v.size()) {
        size_t comma = v.find(',', start);
        std::string word = v.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        if (!word.empty()) {
          if (!valid_name(word, 32)) throw HttpError(400, "bad status");
          q.status.push_back(word);
        }
        if (comma == std::string::npos) break;
        start = comma + 1;
      }
    } else if (k.rfind("axis.", 0) == 0) {
      if (v.empty()) continue;  // an empty field of the filter form means "any"
      const std::string name = k.substr(5);
      if (!valid_name(name)) throw HttpError(400, "bad axis name");
      if (!valid_value(v)) throw HttpError(400, "bad value for axis." + name);
      if (q.axes.size() >= kMaxAxisFilters) throw HttpError(400, "too many axis filters");
      q.axes.emplace_back(name, v);
    } else if (k == "sort") {
      if (v.empty()) continue;
      const std::string key = v[0] == '-' ? v.substr(1) : v;
      if (!valid_name(key)) throw HttpError(400, "bad sort key");
      q.sort = v;
    } else if (k == "limit") {
      q.limit = parse_count(v, kMaxPage, "limit");
      if (q.limit == 0) q.limit = kDefaultPage;
    } else if (k == "offset") {
      q.offset = parse_count(v, kMaxOffset, "offset");
    }
    // Unknown parameters (a cache-buster, the compare form's fields) are ignored.
  }
  return q;
}

// "WHERE …" over runs for the experiment (?1, "" = any) and the states (?2, ?3, …).
static std::string runs_where(size_t n_states) {
  std::string sql = " WHERE (?1 = '' OR experiment = ?1)";
  if (n_states > 0) {
    sql += " AND status IN (";
    for (size_t i = 0; i < n_states; ++i) sql += fmt::format("{}?{}", i ? ", " : "", i + 2);
    sql += ")";
  }
  return sql;
}

static void bind_where(Stmt& s, const std::string& experiment, const std::vector<RunState>& states) {
  s.bind(1, experiment);
  for (size_t i = 0; i < states.size(); ++i) s.bind(static_cast<int>(i + 2), to_string(states[i]));
}

json runs_json(Connection& c, const RunQuery& q) {
  registry::RunFilter f;
  f.experiment = q.experiment;
  for (const auto& [k, v] : q.axes) f.where.push_back({k, v, false});
  f.status = registry::parse_states(q.status);
  f.sort = q.sort;
  f.with_config = false;
  auto row = [](const registry::RunRecord& r) {
    json j = registry::to_json(r);
    j.erase("history");
    j.erase("config");
    return j;
  };
  json page = json::array();
  json total;
  bool has_more = false;
  if (q.axes.empty()) {
    Stmt n(c.raw, "SELECT COUNT(*) FROM runs" + runs_where(f.status.size()));
    bind_where(n, q.experiment, f.status);
    total = n.step() ? n.col_int(0) : 0;
    has_more = q.offset + q.limit < total.get<size_t>();
  }
  // A deep page of the plain listing: OFFSET over the runs' unique index, then load only
  // the page's runs by id (each costs ~10x a listed record: its config is parsed), so a
  // deep page costs what the first one does. Shallow pages read offset + limit records.
  if (q.axes.empty() && (q.sort == "run_id" || q.sort == "-run_id") && q.offset > kDeepPageFactor * q.limit) {
    const int at = static_cast<int>(f.status.size()) + 2;
    Stmt s(c.raw, "SELECT run_id FROM runs" + runs_where(f.status.size()) + " ORDER BY run_id" + (q.sort[0] == '-' ? " DESC" : "") +
                      fmt::format(" LIMIT ?{} OFFSET ?{}", at, at + 1));
    bind_where(s, q.experiment, f.status);
    s.bind(at, static_cast<long long>(q.limit)).bind(at + 1, static_cast<long long>(q.offset));
    std::vector<std::string> ids;
    while (s.step()) ids.push_back(s.col_text(0));
    for (const auto& id : ids)
      if (auto r = c.reg.run(id)) page.push_back(row(*r));
  } else {
    // Everything else goes through the registry's query builder (axis aliases, config
    // paths, summary keys, numeric comparison), which sorts in SQLite and stops after the
    // page: offset + limit + 1 records are read (the extra one tells whether more follow).
    f.limit = q.offset + q.limit + 1;
    auto runs = c.reg.runs(f);
    has_more = runs.size() > q.offset + q.limit;
    for (size_t i = q.offset; i < runs.size() && i < q.offset + q.limit; ++i) page.push_back(row(runs[i]));
    // With axis filters the total is exact only once the last page is reached; counting
    // every match would read them all.
    if (!q.axes.empty() && !has_more) total = std::max(runs.size(), q.offset);
  }
  const size_t count = page.size();
  return {{"runs", std::move(page)}, {"offset", q.offset}, {"limit", q.limit}, {"count", count}, {"total", total}, {"has_more", has_more}};
}

registry::RunRecord find_run(Connection& c, const std::string& run_id) {
  if (run_id.size() > 300) throw HttpError(400, "run id too long");
  auto r = c.reg.run(run_id);
  if (!r) throw HttpError(404, "unknown run");
  return *r;
}

json run_json(Connection& c, const std::string& run_id) {
  const registry::RunRecord r = find_run(c, run_id);
  json j = registry::to_json(r);
  json last = json::object();
  for (const auto& [name, p] : c.reg.last_metrics(r.run_id)) last[name] = registry::to_json(p);
  j["last_metrics"] = last;
  j["metric_names"] = c.reg.metric_names(r.run_id);
  json evals = json::array();
  for (const auto& e : c.reg.evals(r.run_id))
    evals.push_back({{"step", e.step}, {"tokens", e.tokens}, {"wall_time", e.wall_time}, {"results", e.results}});
  j["evals"] = evals;
  json ckpts = json::array();
  for (const auto& k : c.reg.checkpoints(r.run_id)) ckpts.push_back({{"step", k.step}, {"path", k.path}, {"bytes", k.bytes}});
  j["checkpoints"] = ckpts;
  json files = json::array();
  for (const auto& a : list_artifacts(r.run_dir)) files.push_back({{"path", a.relative}, {"bytes", a.bytes}});
  j["files"] = files;
  return j;
}

json metric_json(Connection& c, const std::string& run_id, const std::string& name, size_t max_points) {
  const registry::RunRecord r = find_run(c, run_id);
  if (name.empty()) return {{"run", r.run_id}, {"names", c.reg.metric_names(r.run_id)}};
  if (!valid_name(name)) throw HttpError(400, "bad metric name");
  const auto pts = c.reg.metric_series(r.run_id, name);
  json arr = json::array();
  // Downsample by index like the charts do (first and last kept).
  const size_t n = pts.size();
  const size_t keep = std::min(n, std::max<size_t>(max_points, 2));
  for (size_t i = 0; i < keep; ++i) {
    const size_t at = keep < 2 || n <= keep ? i
                                            : static_cast<size_t>(std::llround(static_cast<double>(n - 1) *
                                                                              static_cast<double>(i) / static_cast<double>(keep - 1)));
    arr.push_back(registry::to_json(pts[at]));
  }
  return {{"run", r.run_id}, {"name", name}, {"total", n}, {"points", arr}};
}

std::vector<std::string> axis_names(Connection& c, const std::string& experiment) {
  Stmt s(c.raw,
         "SELECT DISTINCT j.key FROM (SELECT axes FROM cells WHERE (?1 = '' OR experiment = ?1) LIMIT 2000) AS c, "
         "json_each(c.axes) AS j ORDER BY j.key LIMIT 64");
  s.bind(1, experiment);
  std::vector<std::string> out;
  while (s.step()) out.push_back(s.col_text(0));
  return out;
}

std::string data_version(Connection& c) {
  Stmt s(c.raw, "SELECT COUNT(*), COALESCE(MAX(updated_at), 0), COALESCE(SUM(step), 0), COALESCE(SUM(attempts), 0) FROM runs");
  if (!s.step()) return "0";
  return fmt::format("{}-{:.3f}-{}-{}", s.col_int(0), s.col_double(1), s.col_int(2), s.col_int(3));
}

std::vector<std::pair<double, double>> series_points(const std::vector<registry::MetricPoint>& pts) {
  std::vector<std::pair<double, double>> out;
  out.reserve(pts.size());
  for (const auto& p : pts) out.emplace_back(static_cast<double>(p.step), p.value);
  return out;
}

}  // namespace lar::serve
