#include "serve/pages.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "core/error.hpp"
#include "registry/report/render.hpp"
#include "registry/report/style.hpp"
#include "registry/text_table.hpp"
#include "registry/views.hpp"
#include "serve/artifacts.hpp"
#include "serve/http_error.hpp"
#include "serve/svg_chart.hpp"
#include "serve/text.hpp"

namespace lar::serve {

const char* const kStyleCss = R"css(
body { font-family: system-ui, sans-serif; margin: 0; color: #222; background: #fafafa; }
header { background: #23395d; color: #fff; padding: 8px 16px; display: flex; gap: 18px; align-items: center; }
header a { color: #fff; text-decoration: none; font-weight: 600; }
header .brand { font-size: 18px; margin-right: 12px; }
header #live { margin-left: auto; font-size: 12px; opacity: .8; }
main { padding: 12px 16px; }
footer { padding: 8px 16px; font-size: 12px; color: #777; }
table { border-collapse: collapse; background: #fff; margin: 8px 0 16px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; font-size: 13px; text-align: left; vertical-align: top; }
th { background: #eef1f6; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.status { font-weight: 600; }
.status-completed { color: #1a7f37; } .status-running { color: #0b5cad; } .status-failed, .status-diverged { color: #c62828; }
.status-pending { color: #777; } .status-preempted, .status-timeout, .status-cancelled { color: #a15c00; }
.row-fail { background: #fde8e8; } .row-ok { background: #eefbea; } .row-missing { background: #fff6dd; }
.charts { display: flex; flex-wrap: wrap; gap: 12px; }
svg.chart { background: #fff; border: 1px solid #ddd; }
form.filters { background: #fff; border: 1px solid #ddd; padding: 8px; display: flex; flex-wrap: wrap; gap: 10px; align-items: end; }
form.filters label { display: flex; flex-direction: column; font-size: 12px; }
.muted { color: #777; font-size: 12px; }
progress { width: 160px; }
pre { background: #fff; border: 1px solid #ddd; padding: 8px; overflow-x: auto; }
)css";

// Polls the change marker every 3 s and reloads the page when the registry moved.
const char* const kLiveJs = R"js((function () {
  var seen = document.body.getAttribute('data-version');
  var label = document.getElementById('live');
  function poll() {
    fetch('/api/version', {cache: 'no-store'}).then(function (r) { return r.json(); }).then(function (j) {
      if (label) label.textContent = 'live \u00b7 checked ' + new Date().toLocaleTimeString();
      if (seen && j.version !== seen) location.reload();
    }).catch(function () { if (label) label.textContent = 'server unreachable'; });
  }
  setInterval(poll, 3000);
})();
)js";

namespace {

using registry::cell_text;

std::string esc(const std::string& s) { return html_escape(s); }
std::string escj(const json& v) { return html_escape(cell_text(v)); }

std::string layout(const std::string& title, const std::string& body, const PageContext& ctx) {
  return fmt::format(
      "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{} · lar</title>"
      "<meta name=\"viewport\" content=\"width=device-width\">"
      "<link rel=\"stylesheet\" href=\"/static/style.css\"><script src=\"/static/live.js\" defer></script></head>"
      "<body data-version=\"{}\"><header><span class=\"brand\">lar</span><a href=\"/\">Experiments</a>"
      "<a href=\"/runs\">Runs</a><a href=\"/tables\">Paper tables</a><span id=\"live\">live</span></header>"
      "<main>{}</main><footer>lar serve · read-only view of the registry · <a href=\"/api/experiments\">JSON API</a></footer>"
      "</body></html>\n",
      esc(title), esc(ctx.version), body);
}

std::string status_span(const std::string& s) {
  return fmt::format("<span class=\"status status-{}\">{}</span>", esc(s), esc(s));
}

// /runs/<experiment>/<cell>: each segment encoded on its own.
std::string run_href(const std::string& run_id) {
  const size_t slash = run_id.find('/');
  if (slash == std::string::npos) return "/runs/" + url_encode(run_id);
  return "/runs/" + url_encode(run_id.substr(0, slash)) + "/" + url_encode(run_id.substr(slash + 1));
}

std::string query_string(const RunQuery& q, size_t offset) {
  std::string s;
  auto add = [&](const std::string& k, const std::string& v) { s += (s.empty() ? "?" : "&") + url_encode(k) + "=" + url_encode(v); };
  if (!q.experiment.empty()) add("experiment", q.experiment);
  if (!q.status.empty()) {
    std::string st;
    for (const auto& x : q.status) st += (st.empty() ? "" : ",") + x;
    add("status", st);
  }
  for (const auto& [k, v] : q.axes) add("axis." + k, v);
  if (q.sort != "run_id") add("sort", q.sort);
  add("limit", std::to_string(q.limit));
  add("offset", std::to_string(offset));
  return s;
}

std::string summary_text(const json& summary, const char* key) {
  auto it = summary.find(key);
  if (it == summary.end()) return "-";
  return it->is_number() ? num_text(it->get<double>(), 5) : cell_text(*it);
}

// The paper figures' grammar for runs: colour by architecture, dashed for AdamW (or +CCQ);
// runs with the same cell facets (seeds) are told apart by their run id.
std::vector<report::Style> run_styles(const std::vector<registry::RunRecord>& runs) {
  std::vector<report::Facets> facets;
  auto text = [](const json& cfg, const char* section, const char* key) {
    if (!cfg.is_object() || !cfg.contains(section) || !cfg[section].is_object() || !cfg[section].contains(key)) return std::string();
    const json& v = cfg[section][key];
    return v.is_string() ? v.get<std::string>() : v.dump();
  };
  for (const auto& r : runs) {
    report::Facets f = {{"architecture", text(r.config, "model", "architecture")},
                        {"optimizer", text(r.config, "optimizer", "name")},
                        {"stack", text(r.config, "model", "stack")}};
    if (r.config.is_object() && r.config.contains("model") && r.config["model"].contains("ccq"))
      f["ccq"] = text(r.config["model"], "ccq", "enabled");
    facets.push_back(f);
  }
  return report::styles_for(facets);
}

std::string chart_for(Connection& c, const std::vector<registry::RunRecord>& runs, const std::string& metric,
                      const std::string& title, const std::string& y_label) {
  std::vector<ChartSeries> series;
  const auto styles = run_styles(runs);
  for (size_t i = 0; i < runs.size(); ++i) {
    ChartSeries s{runs[i].run_id, series_points(c.reg.metric_series(runs[i].run_id, metric))};
    // One run alone keeps the neutral first colour; several take their architecture's.
    if (runs.size() > 1) {
      s.colour = styles[i].colour;
      s.dashed = styles[i].dash != 1;
    }
    series.push_back(std::move(s));
  }
  return svg_line_chart(series, {title, "step", y_label});
}

}  // namespace

std::string experiments_page(Connection& c, const PageContext& ctx) {
  json exps = experiments_json(c);
  std::string b = "<h1>Experiments</h1>";
  if (exps.empty()) {
    b += "<p>The registry has no experiments yet. Plan and launch some (<code>lar launch SPEC</code>), then "
         "<code>lar sync</code>.</p>";
    return layout("Experiments", b, ctx);
  }
  b += "<table id=\"experiments\"><tr><th>experiment</th><th>runs</th><th>progress</th><th>by status</th><th>last update</th></tr>";
  for (const auto& e : exps) {
    const std::string name = e["name"].get<std::string>();
    std::string by;
    for (auto it = e["by_status"].begin(); it != e["by_status"].end(); ++it)
      by += fmt::format("<a href=\"/runs?experiment={}&amp;status={}\">{}</a> {} ", url_encode(name), url_encode(it.key()),
                        status_span(it.key()), it->get<long long>());
    const double p = e["progress"].get<double>();
    b += fmt::format(
        "<tr><td><a href=\"/runs?experiment={}\">{}</a></td><td class=\"num\">{} / {} completed</td>"
        "<td><progress max=\"100\" value=\"{:.1f}\"></progress> {:.0f}%</td><td>{}</td><td>{}</td></tr>",
        url_encode(name), esc(name), e["completed"].get<long long>(), e["runs"].get<long long>(), p * 100, p * 100, by,
        esc(registry::fmt_time(e["updated_at"].get<double>())));
  }
  b += "</table>";
  return layout("Experiments", b, ctx);
}

std::string runs_page(Connection& c, const RunQuery& q, const PageContext& ctx) {
  json page = runs_json(c, q);
  const auto exps = c.reg.experiments();
  const auto axes = axis_names(c, q.experiment);
  std::string b = "<h1>Runs</h1><form class=\"filters\" method=\"get\" action=\"/runs\">";
  b += "<label>experiment<select name=\"experiment\"><option value=\"\">(all)</option>";
  for (const auto& e : exps)
    b += fmt::format("<option value=\"{}\"{}>{}</option>", esc(e), e == q.experiment ? " selected" : "", esc(e));
  b += "</select></label><label>status<select name=\"status\"><option value=\"\">(any)</option>";
  const std::string cur_status = q.status.size() == 1 ? q.status[0] : "";
  for (const char* s : {"pending", "running", "completed", "failed", "diverged", "preempted", "cancelled", "timeout"})
    b += fmt::format("<option{}>{}</option>", cur_status == s ? " selected" : "", s);
  b += "</select></label>";
  for (const auto& a : axes) {
    std::string val;
    for (const auto& [k, v] : q.axes)
      if (k == a) val = v;
    b += fmt::format("<label>{}<input name=\"axis.{}\" value=\"{}\" size=\"10\"></label>", esc(a), esc(a), esc(val));
  }
  b += fmt::format("<label>sort<input name=\"sort\" value=\"{}\" size=\"12\"></label>", esc(q.sort));
  b += fmt::format("<input type=\"hidden\" name=\"limit\" value=\"{}\"><button>filter</button></form>", q.limit);

  const size_t count = page["count"].get<size_t>();
  const std::string total = page["total"].is_null() ? "more than " + std::to_string(q.offset + count) : page["total"].dump();
  b += fmt::format("<p id=\"run-count\">{} run(s) match; showing {}–{}.</p>", total, count ? q.offset + 1 : 0, q.offset + count);
  // The run table is its own form: tick runs, then compare them.
  b += "<form method=\"get\" action=\"/compare\"><table id=\"runs\"><tr><th></th><th>run</th><th>status</th><th>step</th>";
  std::vector<std::string> cols;
  std::set<std::string> seen;
  for (const auto& r : page["runs"])
    for (auto it = r["axes"].begin(); it != r["axes"].end(); ++it)
      if (cols.size() < 8 && seen.insert(it.key()).second) cols.push_back(it.key());
  for (const auto& a : cols) b += "<th>" + esc(a) + "</th>";
  b += "<th>final_loss</th><th>tokens/s</th><th>updated</th></tr>";
  for (const auto& r : page["runs"]) {
    const std::string id = r["run_id"].get<std::string>();
    b += fmt::format("<tr class=\"run\"><td><input type=\"checkbox\" name=\"run\" value=\"{}\"></td><td><a href=\"{}\">{}</a></td><td>{}</td>"
                     "<td class=\"num\">{}/{}</td>",
                     esc(id), run_href(id), esc(id), status_span(r["status"].get<std::string>()), r["step"].get<long>(),
                     r["total_steps"].get<long>());
    for (const auto& a : cols) b += "<td>" + (r["axes"].contains(a) ? escj(r["axes"][a]) : "-") + "</td>";
    b += fmt::format("<td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td></tr>", esc(summary_text(r["summary"], "final_loss")),
                     esc(summary_text(r["summary"], "tokens_per_s")), esc(registry::fmt_time(r["updated_at"].get<double>())));
  }
  b += "</table><button>compare selected</button></form><p>";
  if (q.offset > 0) b += fmt::format("<a href=\"/runs{}\">« previous</a> ", esc(query_string(q, q.offset > q.limit ? q.offset - q.limit : 0)));
  if (page["has_more"].get<bool>()) b += fmt::format("<a href=\"/runs{}\">next »</a>", esc(query_string(q, q.offset + q.limit)));
  b += fmt::format("</p><p class=\"muted\">JSON: <a href=\"/api/runs{}\">/api/runs{}</a></p>", esc(query_string(q, q.offset)),
                   esc(query_string(q, q.offset)));
  return layout("Runs", b, ctx);
}

std::string run_page(Connection& c, const std::string& run_id, const PageContext& ctx) {
  const registry::RunRecord r = find_run(c, run_id);
  std::string b = fmt::format("<h1>{}</h1><p>{} · step {} / {} · attempt {} · host {} · hash <code>{}</code></p>", esc(r.run_id),
                              status_span(to_string(r.status)), r.step, r.total_steps, r.attempts, esc(r.host.empty() ? "-" : r.host),
                              esc(r.hash.substr(0, 12)));
  if (!r.reason.empty()) b += "<p>reason: " + esc(r.reason) + "</p>";
  const std::vector<registry::RunRecord> one = {r};
  const auto names = c.reg.metric_names(r.run_id);
  auto has = [&](const char* m) { return std::find(names.begin(), names.end(), m) != names.end(); };
  b += "<h2>Curves</h2><div class=\"charts\" id=\"charts\">";
  {
    std::vector<ChartSeries> loss = {{"loss", series_points(c.reg.metric_series(r.run_id, "loss"))}};
    if (has("val_loss")) loss.push_back({"val_loss", series_points(c.reg.metric_series(r.run_id, "val_loss"))});
    b += svg_line_chart(loss, {"loss", "step", "loss"});
  }
  b += chart_for(c, one, "lr", "learning rate", "lr");
  b += chart_for(c, one, "tokens_per_s", "throughput", "tokens/s");
  b += "</div>";

  b += "<h2>Summary</h2><table id=\"summary\">";
  for (auto it = r.summary.begin(); it != r.summary.end(); ++it) b += "<tr><th>" + esc(it.key()) + "</th><td>" + escj(*it) + "</td></tr>";
  b += "</table><h2>Axes</h2><table id=\"axes\">";
  for (auto it = r.axes.begin(); it != r.axes.end(); ++it) b += "<tr><th>" + esc(it.key()) + "</th><td>" + escj(*it) + "</td></tr>";
  b += fmt::format("<tr><th>role</th><td>{}</td></tr><tr><th>baseline</th><td>{}</td></tr></table>", esc(r.role),
                   esc(r.baseline.empty() ? "-" : r.baseline));

  b += "<h2>Status history</h2><table id=\"history\"><tr><th>time</th><th>state</th><th>step</th><th>attempt</th><th>reason</th></tr>";
  for (const auto& e : r.history)
    b += fmt::format("<tr><td>{}</td><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td></tr>",
                     esc(registry::fmt_time(e.at)), status_span(to_string(e.state)), e.step, e.attempt, esc(e.reason));
  b += "</table>";

  const auto evals = c.reg.evals(r.run_id);
  if (!evals.empty()) {
    b += "<h2>Evaluations</h2><table id=\"evals\"><tr><th>step</th><th>results</th></tr>";
    for (const auto& e : evals) {
      std::string res;
      for (auto it = e.results.begin(); it != e.results.end(); ++it) res += esc(it.key()) + " = " + escj(*it) + "; ";
      b += fmt::format("<tr><td class=\"num\">{}</td><td>{}</td></tr>", e.step, res);
    }
    b += "</table>";
  }

  b += "<h2>Files</h2><table id=\"files\"><tr><th>file</th><th>bytes</th></tr>";
  for (const auto& a : list_artifacts(r.run_dir)) {
    std::string href = run_href(r.run_id) + "/files";
    size_t start = 0;
    while (start <= a.relative.size()) {  // encode each path segment
      size_t slash = a.relative.find('/', start);
      href += "/" + url_encode(a.relative.substr(start, slash == std::string::npos ? std::string::npos : slash - start));
      if (slash == std::string::npos) break;
      start = slash + 1;
    }
    b += fmt::format("<tr><td><a href=\"{}\">{}</a></td><td class=\"num\">{}</td></tr>", href, esc(a.relative), a.bytes);
  }
  b += "</table>";

  b += "<h2>Config</h2><table id=\"config\">";
  for (const auto& [k, v] : registry::flatten(r.config)) b += "<tr><th>" + esc(k) + "</th><td>" + escj(v) + "</td></tr>";
  b += "</table>";
  b += fmt::format("<p class=\"muted\">JSON: <a href=\"/api{}\">/api{}</a></p>", run_href(r.run_id), run_href(r.run_id));
  return layout(r.run_id, b, ctx);
}

std::string compare_page(Connection& c, const std::vector<std::string>& ids, const PageContext& ctx) {
  if (ids.empty() || ids.size() > kMaxCompare)
    throw HttpError(400, fmt::format("compare needs 1 to {} runs (got {})", kMaxCompare, ids.size()));
  std::vector<registry::RunRecord> runs;
  for (const auto& id : ids) runs.push_back(find_run(c, id));
  std::string b = "<h1>Compare runs</h1><p>";
  const auto styles = run_styles(runs);
  for (size_t i = 0; i < runs.size(); ++i)
    b += fmt::format("<span class=\"legend\"><svg width=\"14\" height=\"4\"><line x1=\"0\" y1=\"2\" x2=\"14\" y2=\"2\" stroke=\"{}\" "
                     "stroke-width=\"3\"{}/></svg> <a href=\"{}\">{}</a> {}</span> ",
                     runs.size() > 1 ? styles[i].colour : std::string(series_colour(0)),
                     runs.size() > 1 && styles[i].dash != 1 ? " stroke-dasharray=\"4 2\"" : "", run_href(runs[i].run_id),
                     esc(runs[i].run_id), status_span(to_string(runs[i].status)));
  b += "</p><div class=\"charts\" id=\"charts\">";
  b += chart_for(c, runs, "loss", "loss", "loss");
  b += chart_for(c, runs, "lr", "learning rate", "lr");
  b += chart_for(c, runs, "tokens_per_s", "throughput", "tokens/s");
  b += "</div>";

  // Config diff over the flattened configs (as `lar compare`): keys whose values differ,
  // a key missing from a run counting as different.
  std::vector<std::map<std::string, json>> flat;
  std::set<std::string> keys;
  for (const auto& r : runs) {
    flat.push_back(registry::flatten(r.config));
    for (const auto& [k, _] : flat.back()) keys.insert(k);
  }
  std::string rows;
  size_t differ = 0;
  for (const auto& k : keys) {
    std::vector<json> vals;
    for (const auto& f : flat) {
      auto it = f.find(k);
      vals.push_back(it == f.end() ? json() : it->second);
    }
    if (std::all_of(vals.begin(), vals.end(), [&](const json& v) { return v == vals[0]; })) continue;
    ++differ;
    rows += "<tr><th>" + esc(k) + "</th>";
    for (const auto& v : vals) rows += "<td>" + escj(v) + "</td>";
    rows += "</tr>";
  }
  b += fmt::format("<h2>Config differences</h2><p>{} of {} keys differ.</p><table id=\"config-diff\"><tr><th>key</th>", differ, keys.size());
  for (const auto& r : runs) b += "<th>" + esc(r.run_id) + "</th>";
  b += "</tr>" + rows + "</table>";

  b += "<h2>Summary</h2><table id=\"compare-summary\"><tr><th></th>";
  for (const auto& r : runs) b += "<th>" + esc(r.run_id) + "</th>";
  b += "</tr><tr><th>step</th>";
  for (const auto& r : runs) b += fmt::format("<td class=\"num\">{}/{}</td>", r.step, r.total_steps);
  for (const char* key : {"final_loss", "saturation_loss", "tokens_per_s", "params"}) {
    b += fmt::format("</tr><tr><th>{}</th>", key);
    for (const auto& r : runs) b += "<td class=\"num\">" + esc(summary_text(r.summary, key)) + "</td>";
  }
  b += "</tr></table>";
  return layout("Compare", b, ctx);
}

std::string tables_index_page(const std::vector<std::string>& tables, const PageContext& ctx) {
  std::string b = "<h1>Paper tables</h1><p>Each table is audited against the registry: which runs count for each "
                  "cell, our values (mean ± std over seeds) beside the published ones.</p><ul id=\"tables\">";
  for (const auto& t : tables) b += fmt::format("<li><a href=\"/tables/{}\">{}</a></li>", esc(t), esc(t));
  b += "</ul>";
  return layout("Paper tables", b, ctx);
}

std::string table_page(const report::Report& r, const std::string& paper_table, const std::string& scale, const PageContext& ctx) {
  std::string b = fmt::format("<h1>{}</h1><p>experiment <a href=\"/runs?experiment={}\">{}</a> · scale {}</p>",
                              esc(r.title.empty() ? paper_table : r.title), url_encode(r.experiment), esc(r.experiment),
                              esc(r.scale));
  b += fmt::format("<form class=\"filters\" method=\"get\"><label>scale<input name=\"scale\" value=\"{}\" size=\"8\"></label>"
                   "<button>show</button></form>",
                   esc(scale.empty() ? r.scale : scale));
  if (!r.description.empty()) b += "<p>" + esc(r.description) + "</p>";
  std::vector<std::string> axes;
  for (const auto& row : r.rows)
    for (const auto& [a, _] : row.axes)
      if (std::find(axes.begin(), axes.end(), a) == axes.end()) axes.push_back(a);
  b += "<table id=\"paper-table\"><tr><th>row</th>";
  for (const auto& a : axes) b += "<th>" + esc(a) + "</th>";
  for (const auto& m : r.metrics) b += "<th>" + esc(m) + " (ours)</th><th>" + esc(m) + " (paper)</th>";
  if (r.has_deltas())
    for (const auto& m : r.metrics) b += "<th>Δ " + esc(m) + " (ours)</th><th>Δ (paper)</th>";
  b += "<th>status</th><th>notes</th></tr>";
  for (const auto& row : r.rows) {
    b += fmt::format("<tr class=\"row-{}\"><td>{}</td>", esc(row.status), esc(row.id));
    for (const auto& a : axes) {
      std::string v = "-";
      for (const auto& [k, val] : row.axes)
        if (k == a) v = cell_text(val);
      b += "<td>" + esc(v) + "</td>";
    }
    for (const auto& m : r.metrics) {
      const int dec = r.decimals.count(m) ? r.decimals.at(m) : 3;
      auto ours = row.ours.find(m);
      auto pub = row.published.find(m);
      b += "<td class=\"num\">" + esc(ours == row.ours.end() ? "—" : report::format_value(ours->second, dec)) + "</td>";
      b += "<td class=\"num\">" + esc(pub == row.published.end() ? "—" : fmt::format("{:.{}f}", pub->second, dec)) + "</td>";
    }
    if (r.has_deltas())
      for (const auto& m : r.metrics) {
        const int dec = r.decimals.count(m) ? r.decimals.at(m) : 3;
        auto d = row.deltas.find(m);
        b += "<td class=\"num\">" + esc(d == row.deltas.end() ? "" : report::format_delta(d->second, dec)) + "</td>";
        b += "<td class=\"num\">" +
             esc(d == row.deltas.end() || !d->second.published ? "" : fmt::format("{:+.{}f}", *d->second.published, dec)) + "</td>";
      }
    std::string notes;
    for (const auto& n : row.notes) notes += esc(n) + "<br>";
    b += "<td>" + esc(row.status) + "</td><td>" + notes + "</td></tr>";
  }
  b += "</table>";

  if (!r.agreement.empty()) {
    b += "<h2>Agreement with the paper</h2><table id=\"agreement\"><tr><th>metric</th><th>rows</th><th>Spearman ρ</th></tr>";
    for (const auto& a : r.agreement)
      b += fmt::format("<tr><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td></tr>", esc(a.metric), a.n,
                       a.spearman ? fmt::format("{:.3f}", *a.spearman) : "—");
    for (const auto& s : r.signs)
      b += fmt::format("<tr><td>sign of Δ {}</td><td class=\"num\">{}</td><td class=\"num\">{} agree</td></tr>", esc(s.metric), s.n, s.agree);
    b += "</table>";
  }

  b += "<h2>Audit: runs</h2><table id=\"audit\"><tr><th>run</th><th>cell</th><th>counts</th><th>why not</th></tr>";
  for (const auto& v : r.runs)
    b += fmt::format("<tr><td><a href=\"{}\">{}</a></td><td>{}</td><td>{}</td><td>{}</td></tr>", run_href(v.run_id), esc(v.run_id),
                     esc(v.cell_id), v.included ? "yes" : "no", esc(v.reason));
  b += "</table>";
  if (!r.known_issues.empty()) {
    b += "<h2>Known issues in the paper</h2><ul>";
    for (const auto& k : r.known_issues) b += "<li><b>" + esc(k.where) + "</b>: " + esc(k.text) + "</li>";
    b += "</ul>";
  }
  b += fmt::format("<p class=\"muted\">JSON: <a href=\"/api/tables/{0}\">/api/tables/{0}</a> · "
                   "<a href=\"/api/audit/{0}\">/api/audit/{0}</a></p>",
                   esc(paper_table));
  return layout(r.title.empty() ? paper_table : r.title, b, ctx);
}

std::string error_page(int status, const std::string& message, const PageContext& ctx) {
  return layout(fmt::format("Error {}", status), fmt::format("<h1>Error {}</h1><p id=\"error\">{}</p>", status, esc(message)), ctx);
}

}  // namespace lar::serve
