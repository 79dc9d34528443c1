// Registry queries: run listings with filters and sorting, single runs, metric series.
#include <cmath>
#include <cstdlib>
#include <set>
#include <unordered_map>

#include "core/config_schema.hpp"
#include "core/error.hpp"
#include "registry/impl.hpp"
#include "registry/registry.hpp"

namespace lar::registry {

namespace {

// Columns a --where / --sort key may name directly.
const std::map<std::string, std::string>& column_keys() {
  static const std::map<std::string, std::string> m = {
      {"run_id", "r.run_id"},   {"experiment", "r.experiment"}, {"cell_id", "r.cell_id"},
      {"cell", "r.cell_id"},    {"status", "r.status"},         {"step", "r.step"},
      {"total_steps", "r.total_steps"}, {"updated_at", "r.updated_at"},
      {"attempts", "r.attempts"}, {"host", "r.host"},           {"reason", "r.reason"},
      {"hash", "c.hash"},       {"role", "c.role"},             {"baseline", "c.baseline"},
  };
  return m;
}

struct SqlExpr {
  std::string sql;                  // with ? placeholders
  std::vector<std::string> params;  // bound as text, in order
};

// The value of `key` for a run: a column, "summary.X", "config.X", else an axis of the
// cell, a config path (axis aliases such as `architecture` resolve through
// core/config_schema) or a summary scalar, in that order.
SqlExpr key_expr(const std::string& key) {
  if (auto it = column_keys().find(key); it != column_keys().end()) return {it->second, {}};
  if (key.rfind("summary.", 0) == 0)
    return {"json_extract(r.summary, ?)", {json_key_path(key.substr(8))}};
  if (key.rfind("config.", 0) == 0)
    return {"json_extract(c.config, ?)", {json_path(key.substr(7))}};
  return {"COALESCE(json_extract(c.axes, ?), json_extract(c.config, ?), json_extract(r.summary, ?))",
          {json_key_path(key), json_path(resolve_axis(key)), json_key_path(key)}};
}

bool parse_number(const std::string& s, double& out) {
  if (s.empty()) return false;
  char* end = nullptr;
  out = std::strtod(s.c_str(), &end);
  return end == s.c_str() + s.size() && std::isfinite(out);
}

const char* kSelect =
    "SELECT r.id, r.run_id, r.experiment, r.cell_id, COALESCE(c.hash, ''), COALESCE(c.axes, '{}'), "
    "%CONFIG%, COALESCE(c.role, 'main'), COALESCE(c.baseline, ''), r.status, r.step, r.total_steps, "
    "r.reason, r.summary, r.attempts, r.host, r.run_dir, r.updated_at "
    "FROM runs r LEFT JOIN cells c ON c.experiment = r.experiment AND c.cell_id = r.cell_id";

std::string select_sql(bool with_config) {
  std::string s = kSelect;
  s.replace(s.find("%CONFIG%"), 8, with_config ? "COALESCE(c.config, '{}')" : "NULL");
  return s;
}

json parse_json_column(const std::string& text) {
  if (text.empty()) return json::object();
  return json::parse(text, nullptr, /*allow_exceptions=*/false);
}

RunRecord read_record(const Stmt& s) {
  RunRecord r;
  r.run_id = s.col_text(1);
  r.experiment = s.col_text(2);
  r.cell_id = s.col_text(3);
  r.hash = s.col_text(4);
  r.axes = parse_json_column(s.col_text(5));
  r.config = s.is_null(6) ? json() : parse_json_column(s.col_text(6));
  r.role = s.col_text(7);
  r.baseline = s.col_text(8);
  r.status = run_state_from_string(s.col_text(9)).value_or(RunState::pending);
  r.step = static_cast<long>(s.col_int(10));
  r.total_steps = static_cast<long>(s.col_int(11));
  r.reason = s.col_text(12);
  r.summary = parse_json_column(s.col_text(13));
  r.attempts = static_cast<int>(s.col_int(14));
  r.host = s.col_text(15);
  r.run_dir = s.col_text(16);
  r.updated_at = s.col_double(17);
  return r;
}

void load_history(Db& db, long long rowid, RunRecord& r) {
  Stmt h(db, "SELECT state, at, step, reason, attempt FROM status_history WHERE run = ? ORDER BY seq");
  h.bind(1, rowid);
  while (h.step()) {
    StatusEvent e;
    e.state = run_state_from_string(h.col_text(0)).value_or(RunState::pending);
    e.at = h.col_double(1);
    e.step = static_cast<long>(h.col_int(2));
    e.reason = h.col_text(3);
    e.attempt = static_cast<int>(h.col_int(4));
    r.history.push_back(e);
  }
}

std::string like_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '%' || c == '_' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

// A --where / --sort key must mean something: a column, a summary/config path, an axis
// alias, a schema path, or an axis or summary key some run actually has. Otherwise a typo
// would silently match nothing (or sort nothing).
void check_key(Db& db, const std::string& key, const std::string& context) {
  if (column_keys().count(key) || key.rfind("summary.", 0) == 0 || key.rfind("config.", 0) == 0 ||
      axis_aliases().count(key) || schema_lookup(key) != nullptr)
    return;
  {
    Stmt s(db,
           "SELECT 1 WHERE EXISTS (SELECT 1 FROM cells WHERE json_extract(axes, ?1) IS NOT NULL) "
           "OR EXISTS (SELECT 1 FROM runs WHERE json_extract(summary, ?1) IS NOT NULL)");
    s.bind(1, json_key_path(key));
    if (s.step()) return;
  }
  std::vector<std::string> cands;
  for (const auto& [k, _] : column_keys()) cands.push_back(k);
  for (const auto& [k, _] : axis_aliases()) cands.push_back(k);
  Stmt s(db,
         "SELECT DISTINCT j.key FROM runs, json_each(runs.summary) AS j UNION "
         "SELECT DISTINCT j.key FROM cells, json_each(cells.axes) AS j");
  while (s.step()) cands.push_back(s.col_text(0));
  std::string hint = did_you_mean(key, cands);
  throw UserError("unknown key '" + key + "' " + context + (hint.empty() ? "" : " (" + hint + ")"));
}

}  // namespace

WhereClause RunFilter::parse_where(const std::string& text) {
  WhereClause w;
  size_t eq = text.find('=');
  if (eq == std::string::npos || eq == 0)
    throw UserError("bad --where '" + text + "': expected KEY=VALUE or KEY!=VALUE");
  if (text[eq - 1] == '!') {
    w.negate = true;
    w.key = text.substr(0, eq - 1);
  } else {
    w.key = text.substr(0, eq);
  }
  w.value = text.substr(eq + 1);
  if (w.key.empty()) throw UserError("bad --where '" + text + "': empty key");
  return w;
}

std::vector<std::string> Registry::experiments() {
  Stmt s(impl_->db, "SELECT name FROM experiments ORDER BY name");
  std::vector<std::string> out;
  while (s.step()) out.push_back(s.col_text(0));
  return out;
}

std::vector<std::string> Registry::run_ids() {
  Stmt s(impl_->db, "SELECT run_id FROM runs ORDER BY run_id");
  std::vector<std::string> out;
  while (s.step()) out.push_back(s.col_text(0));
  return out;
}

std::vector<RunRecord> Registry::runs(const RunFilter& f) {
  Db& db = impl_->db;
  std::string sql = select_sql(f.with_config);
  std::vector<std::string> where;
  // Parameters in order: text, or numbers given as a tagged text ("\x01" + number).
  struct Param {
    bool numeric = false;
    std::string text;
    double number = 0;
  };
  std::vector<Param> params;

  if (!f.experiment.empty()) {
    // An experiment with no runs yet simply lists nothing (callers such as report ask
    // before anything ran); `lar runs` itself rejects unknown names with a did-you-mean.
    where.push_back("r.experiment = ?");
    params.push_back({false, f.experiment, 0});
  }
  for (const auto& w : f.where) {
    check_key(db, w.key, "in --where " + w.key + (w.negate ? "!=" : "=") + w.value);
    SqlExpr e = key_expr(w.key);
    for (auto& p : e.params) params.push_back({false, p, 0});
    // Numbers compare as numbers (lr=3e-4 matches 0.0003), booleans as JSON true/false
    // (which json_extract returns as 1/0), everything else as text.
    std::string cond;
    double num = 0;
    if (parse_number(w.value, num) || w.value == "true" || w.value == "false") {
      if (w.value == "true") num = 1;
      if (w.value == "false") num = 0;
      // Evaluate the key expression once per comparison: repeat its parameters.
      cond = "(" + e.sql + " = ? OR CAST(" + e.sql + " AS TEXT) = ?)";
      params.push_back({true, "", num});
      for (auto& p : e.params) params.push_back({false, p, 0});
      params.push_back({false, w.value, 0});
    } else {
      cond = "(CAST(" + e.sql + " AS TEXT) = ?)";
      params.push_back({false, w.value, 0});
    }
    where.push_back(w.negate ? "NOT COALESCE(" + cond + ", 0)" : "COALESCE(" + cond + ", 0)");
  }
  if (!f.status.empty()) {
    std::string in;
    for (auto s : f.status) {
      in += in.empty() ? "?" : ", ?";
      params.push_back({false, to_string(s), 0});
    }
    where.push_back("r.status IN (" + in + ")");
  }
  if (!where.empty()) {
    sql += " WHERE ";
    for (size_t i = 0; i < where.size(); ++i) sql += (i ? " AND " : "") + where[i];
  }

  std::string key = f.sort.empty() ? "run_id" : f.sort;
  bool desc = false;
  if (key[0] == '-') {
    desc = true;
    key = key.substr(1);
  }
  check_key(db, key, "in --sort");
  SqlExpr order;
  if (column_keys().count(key) || key.rfind("summary.", 0) == 0 || key.rfind("config.", 0) == 0) {
    order = key_expr(key);
  } else {
    // A bare name: a summary scalar (final_loss), else an axis or config path.
    order = {"COALESCE(json_extract(r.summary, ?), json_extract(c.axes, ?), json_extract(c.config, ?))",
             {json_key_path(key), json_key_path(key), json_path(resolve_axis(key))}};
  }
  if (key == "run_id") {
    sql += std::string(" ORDER BY r.run_id") + (desc ? " DESC" : "");  // the unique index: no sort
  } else {
    for (int twice = 0; twice < 2; ++twice)
      for (auto& p : order.params) params.push_back({false, p, 0});
    // Runs without a value for the key (no final_loss yet) go last in either direction.
    sql += " ORDER BY (" + order.sql + ") IS NULL, " + order.sql + (desc ? " DESC" : " ASC") + ", r.run_id";
  }
  if (f.limit > 0) sql += " LIMIT " + std::to_string(f.limit);

  Stmt s(db, sql);
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].numeric) s.bind(static_cast<int>(i + 1), params[i].number);
    else s.bind(static_cast<int>(i + 1), params[i].text);
  }
  std::vector<RunRecord> out;
  std::vector<long long> rowids;
  while (s.step()) {
    out.push_back(read_record(s));
    rowids.push_back(s.col_int(0));
  }
  if (f.with_history)
    for (size_t i = 0; i < out.size(); ++i) load_history(db, rowids[i], out[i]);
  return out;
}

std::optional<RunRecord> Registry::run(const std::string& id) {
  Db& db = impl_->db;
  auto fetch = [&](const std::string& where, const std::string& param) {
    Stmt s(db, select_sql(true) + " WHERE " + where + " ORDER BY r.run_id LIMIT 6");
    s.bind(1, param);
    std::vector<std::pair<long long, RunRecord>> rows;
    while (s.step()) rows.emplace_back(s.col_int(0), read_record(s));
    return rows;
  };
  auto pick = [&](std::vector<std::pair<long long, RunRecord>> rows) -> std::optional<RunRecord> {
    if (rows.size() == 1) {
      load_history(db, rows[0].first, rows[0].second);
      return std::move(rows[0].second);
    }
    std::string list;
    for (size_t i = 0; i < rows.size() && i < 5; ++i) list += "\n  " + rows[i].second.run_id;
    throw UserError("run '" + id + "' is ambiguous; it matches:" + list + (rows.size() > 5 ? "\n  ..." : ""));
  };
  if (id.empty()) return std::nullopt;
  if (auto rows = fetch("r.run_id = ?", id); !rows.empty()) return pick(std::move(rows));
  if (auto rows = fetch("r.run_id LIKE ? ESCAPE '\\'", like_escape(id) + "%"); !rows.empty())
    return pick(std::move(rows));
  if (auto rows = fetch("r.cell_id = ?", id); !rows.empty()) return pick(std::move(rows));
  if (auto rows = fetch("r.cell_id LIKE ? ESCAPE '\\'", like_escape(id) + "%"); !rows.empty())
    return pick(std::move(rows));
  if (id.size() >= 6)
    if (auto rows = fetch("c.hash LIKE ? ESCAPE '\\'", like_escape(id) + "%"); !rows.empty())
      return pick(std::move(rows));
  return std::nullopt;
}

RunRecord Registry::require_run(const std::string& id) {
  if (auto r = run(id)) return *r;
  // Suggest among run ids and, for a bare cell id, among cell ids.
  std::vector<std::string> cands = run_ids();
  if (id.find('/') == std::string::npos) {
    Stmt s(impl_->db, "SELECT DISTINCT cell_id FROM runs");
    while (s.step()) cands.push_back(s.col_text(0));
  }
  std::string hint = did_you_mean(id, cands);
  throw UserError("unknown run '" + id + "'" + (hint.empty() ? "" : " (" + hint + ")"));
}

std::vector<MetricPoint> Registry::metric_series(const std::string& run_id, const std::string& name) {
  long long rowid = impl_->require_rowid(run_id);
  Stmt s(impl_->db,
         "SELECT step, tokens, value, wall_time FROM metrics WHERE run = ? AND name = ? ORDER BY step, line");
  s.bind(1, rowid).bind(2, name);
  std::vector<MetricPoint> out;
  while (s.step())
    out.push_back({static_cast<long>(s.col_int(0)), s.col_double(1), s.col_double(2), s.col_double(3)});
  return out;
}

std::vector<std::string> Registry::metric_names(const std::string& run_id) {
  long long rowid = impl_->require_rowid(run_id);
  Stmt s(impl_->db, "SELECT DISTINCT name FROM metrics WHERE run = ? ORDER BY name");
  s.bind(1, rowid);
  std::vector<std::string> out;
  while (s.step()) out.push_back(s.col_text(0));
  return out;
}

std::map<std::string, MetricPoint> Registry::last_metrics(const std::string& run_id) {
  long long rowid = impl_->require_rowid(run_id);
  std::map<std::string, MetricPoint> out;
  Stmt s(impl_->db,
         "SELECT step, tokens, value, wall_time FROM metrics WHERE run = ? AND name = ? "
         "ORDER BY step DESC, line DESC LIMIT 1");
  for (const auto& name : metric_names(run_id)) {
    s.bind(1, rowid).bind(2, name);
    if (s.step())
      out[name] = {static_cast<long>(s.col_int(0)), s.col_double(1), s.col_double(2), s.col_double(3)};
    s.reset();
  }
  return out;
}

long long Registry::metric_row_count(const std::string& run_id) {
  if (run_id.empty()) return impl_->db.scalar_int("SELECT COUNT(*) FROM metrics");
  Stmt s(impl_->db, "SELECT COUNT(*) FROM metrics WHERE run = ?");
  s.bind(1, impl_->require_rowid(run_id));
  return s.step() ? s.col_int(0) : 0;
}

std::vector<CheckpointRecord> Registry::checkpoints(const std::string& run_id) {
  Stmt s(impl_->db, "SELECT step, path, bytes FROM checkpoints WHERE run = ? ORDER BY step");
  s.bind(1, impl_->require_rowid(run_id));
  std::vector<CheckpointRecord> out;
  while (s.step()) out.push_back({static_cast<long>(s.col_int(0)), s.col_text(1), s.col_int(2)});
  return out;
}

std::vector<EvalRecord> Registry::evals(const std::string& run_id) {
  Stmt s(impl_->db, "SELECT step, tokens, wall_time, results FROM evals WHERE run = ? ORDER BY step, rowid");
  s.bind(1, impl_->require_rowid(run_id));
  std::vector<EvalRecord> out;
  while (s.step())
    out.push_back({static_cast<long>(s.col_int(0)), s.col_double(1), s.col_double(2), parse_json_column(s.col_text(3))});
  return out;
}

}  // namespace lar::registry
