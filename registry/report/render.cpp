#include "registry/report/render.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>
#include <sstream>

#include "core/error.hpp"

namespace lar::report {

namespace {

std::string axis_text(const json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); }

std::string num(double v, int decimals) { return fmt::format("{:.{}f}", v, decimals); }
std::string signed_num(double v, int decimals) {
  std::string s = fmt::format("{:+.{}f}", v, decimals);
  return s;
}

std::string title_line(const Report& r) {
  std::string t = r.title.empty() ? r.experiment : r.title;
  std::string src;
  if (r.source.is_object()) {
    if (r.source.contains("arxiv")) src += "arXiv " + axis_text(r.source["arxiv"]);
    if (r.source.contains("table")) src += (src.empty() ? "" : ", ") + axis_text(r.source["table"]);
    if (r.source.contains("page")) src += (src.empty() ? "" : ", ") + std::string("p. ") + axis_text(r.source["page"]);
  }
  return t + (src.empty() ? "" : " (" + src + ")") + " — " + r.experiment +
         (r.scale.empty() ? "" : ", scale " + r.scale);
}

std::string axis_value(const Row& row, const std::string& axis) {
  for (const auto& [a, v] : row.axes)
    if (a == axis) return axis_text(v);
  return "";
}

// The axis columns of a table: every axis, in order, except those whose value follows from
// the columns before it (LAA Table 2's lr is fixed by the optimizer; Table 7's width by
// the budget) — the row id in the audit still names them. The first axis always shows.
std::vector<std::string> axis_names(const Report& r) {
  std::vector<std::string> all, shown;
  for (const auto& row : r.rows)
    for (const auto& [a, v] : row.axes)
      if (std::find(all.begin(), all.end(), a) == all.end()) all.push_back(a);
  for (const auto& a : all) {
    std::map<std::string, std::string> seen;  // values of the shown columns → value of a
    bool determined = !shown.empty() || r.rows.size() < 2;
    for (const auto& row : r.rows) {
      std::string key;
      for (const auto& s : shown) key += axis_value(row, s) + "\x1f";
      auto [it, fresh] = seen.emplace(key, axis_value(row, a));
      if (!fresh && it->second != axis_value(row, a)) determined = false;
    }
    if (shown.empty() || !determined) shown.push_back(a);
  }
  return shown;
}

const MetricValue& value_of(const Row& row, const std::string& m) {
  static const MetricValue empty;
  auto it = row.ours.find(m);
  return it == row.ours.end() ? empty : it->second;
}

std::string published_text(const Row& row, const std::string& m, int dec) {
  auto it = row.published.find(m);
  return it == row.published.end() ? "—" : num(it->second, dec);
}

std::string published_delta_text(const Row& row, const std::string& m, int dec) {
  auto it = row.deltas.find(m);
  if (it == row.deltas.end() || !it->second.published) return "—";
  return signed_num(*it->second.published, dec);
}

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

std::string latex_escape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '_' || c == '%' || c == '&' || c == '#' || c == '$' || c == '{' || c == '}') {
      out += '\\';
      out += c;
    } else if (s.compare(i, 2, "±") == 0) {
      out += "$\\pm$";
      ++i;
    } else if (s.compare(i, 3, "—") == 0) {
      out += "---";
      i += 2;
    } else if (s.compare(i, 2, "Δ") == 0) {
      out += "$\\Delta$";
      i += 1;
    } else {
      out += c;
    }
  }
  return out;
}

// Metrics shown with a Δ column: every metric but the normalised throughput, and once
// runs exist only those we measure (a Δ of a column we have no value for says nothing).
std::vector<std::string> delta_metrics(const Report& r) {
  std::vector<std::string> out;
  if (!r.has_deltas()) return out;
  auto measured = [&](const std::string& m) {
    for (const auto& row : r.rows)
      if (auto it = row.ours.find(m); it != row.ours.end() && it->second.stats.n > 0) return true;
    return false;
  };
  bool any = false;
  for (const auto& m : r.metrics) any |= measured(m);
  for (const auto& m : r.metrics)
    if (m != "rel_throughput_pct" && (!any || measured(m))) out.push_back(m);
  return out;
}

std::vector<std::string> footnotes(const Report& r) {
  std::vector<std::string> out;
  if (r.source.is_object() && r.source.contains("table"))
    out.push_back("paper: the published value (" + axis_text(r.source["table"]) +
                  (r.scale.empty() || r.scale == "paper" ? "" : "; at the paper's scale, for the cell at the same place in the matrix") +
                  ").");
  if (r.throughput_reference)
    out.push_back("rel_throughput_pct: our tokens/s relative to " + *r.throughput_reference + " = 100 (as in the paper).");
  std::set<std::string> proxies;
  for (const auto& row : r.rows)
    for (const auto& [m, v] : row.ours)
      if (v.proxy) proxies.insert(v.proxy_note);
  for (const auto& p : proxies) out.push_back("proxy: " + p + ".");
  if (r.has_deltas())
    out.push_back("Δ = row − its matched baseline (same config except the compared axis); "
                  "± is the standard error with Welch's p when both sides have ≥ 2 seeds.");
  out.push_back("(n=k): mean ± sample std over k seeds; (1 seed): single run, no significance claim.");
  return out;
}

json opt(const std::optional<double>& v) { return v ? json(*v) : json(); }

std::string epochs_text(const Row& row) {
  if (!row.epochs) return "—";
  std::string s = *row.epochs < 10 ? fmt::format("{:.2f}", *row.epochs) : fmt::format("{:.1f}", *row.epochs);
  if (*row.epochs > 1) s += " ⚠ >1";
  if (row.epochs_planned) s += " (planned)";
  return s;
}

std::string g4(double v) { return fmt::format("{:.4g}", v); }
std::string signed_g4(double v) { return fmt::format("{:+.4g}", v); }
std::string p_text(double p) { return p < 1e-4 ? fmt::format("{:.1e}", p) : fmt::format("{:.3g}", p); }

std::string selector_text(const experiments::Selector& s) {
  std::string out;
  for (const auto& [a, v] : s) out += (out.empty() ? "" : ", ") + a + "=" + axis_text(v);
  return out;
}

std::string claim_statement(const experiments::Claim& c) {
  using K = experiments::Claim::Kind;
  std::string s;
  switch (c.kind) {
    case K::better: s = selector_text(c.sides[0]) + " beats " + selector_text(c.sides[1]); break;
    case K::no_gain: s = selector_text(c.sides[0]) + " no reliable gain over " + selector_text(c.sides[1]); break;
    case K::order:
      for (size_t i = 0; i < c.sides.size(); ++i) s += (i ? " < " : "") + selector_text(c.sides[i]);
      s += " (best first)";
      break;
    case K::lowest: s = selector_text(c.sides[0]) + " lowest"; break;
    case K::highest: s = selector_text(c.sides[0]) + " highest"; break;
    case K::grows_least: s = selector_text(c.sides[0]) + " grows least along " + c.along; break;
  }
  s += " in " + c.metric + " (" + (c.lower_is_better ? "lower" : "higher") + " is better)";
  if (!c.where.empty()) s += ", where " + selector_text(c.where);
  if (!c.among.empty()) s += ", among " + selector_text(c.among);
  return s;
}

std::string delta_se_text(const PairSummary& s) {
  if (!s.mean_delta) return "—";
  std::string t = signed_g4(*s.mean_delta);
  if (s.se) t += " ± " + g4(*s.se) + (s.se_across_pairs ? " (across pairs)" : "");
  return t;
}

std::string ci_text(const std::optional<Interval>& ci) {
  return ci ? "[" + signed_g4(ci->lo) + ", " + signed_g4(ci->hi) + "]" : "—";
}

json pair_summary_json(const PairSummary& s) {
  json j = {{"expected", s.expected}, {"measured", s.measured}, {"agree", s.agree},
            {"mean_delta", opt(s.mean_delta)}, {"se", opt(s.se)}, {"se_across_pairs", s.se_across_pairs},
            {"welch_p", opt(s.p)}, {"welch_df", opt(s.df)}, {"sign_test_p", s.sign_p},
            {"published_pairs", s.published}, {"published_agree", s.published_agree},
            {"published_mean_delta", opt(s.published_mean_delta)}, {"verdict", s.verdict}, {"why", s.why}};
  j["bootstrap_ci95"] = s.ci ? json::array({s.ci->lo, s.ci->hi}) : json();
  return j;
}

}  // namespace

std::string claims_markdown(const Report& r) {
  if (r.claims.empty()) return "";
  std::ostringstream os;
  os << "### Claims\n\n"
     << "| claim | verdict | pairs agree | mean Δ ± SE | Welch p | 95% bootstrap CI | paper |\n"
     << "|---|---|---:|---:|---:|---:|---|\n";
  for (const auto& c : r.claims) {
    const PairSummary* s = c.links.empty() ? nullptr : &c.links.front();
    const bool single = c.links.size() == 1;
    std::string agree = "—", delta = "—", p = "—", ci = "—";
    if (single && s && s->measured > 0) {
      agree = std::to_string(s->agree) + "/" + std::to_string(s->measured) +
              (s->measured < s->expected ? " (of " + std::to_string(s->expected) + ")" : "");
      delta = delta_se_text(*s);
      const bool pairwise = c.claim.kind == experiments::Claim::Kind::better || c.claim.kind == experiments::Claim::Kind::no_gain;
      p = s->p ? p_text(*s->p) : pairwise ? "— (sign p " + p_text(s->sign_p) + ")" : "—";
      ci = ci_text(s->ci);
    } else if (!single) {
      agree = "per link ↓";
    }
    std::string paper = c.paper_reading;
    if (c.paper_consistent && !*c.paper_consistent) paper += " — the published values do not show it";
    os << "| " << c.claim.name << " | **" << c.verdict << "** | " << agree << " | " << delta << " | " << p << " | " << ci
       << " | " << paper << " |\n";
  }
  os << "\n";
  for (const auto& c : r.claims) {
    os << "- **" << c.claim.name << "** (" << experiments::to_string(c.claim.kind)
       << (c.claim.source.empty() ? "" : "; " + c.claim.source) << "): " << claim_statement(c.claim) << ". "
       << c.verdict << ": " << c.why << ".";
    if (c.p_best) os << " Bootstrap: the named row is best in " << fmt::format("{:.0f}", 100 * *c.p_best) << "% of resamples.";
    if (!c.ranking.empty()) {
      os << " Ours, best first:";
      for (size_t i = 0; i < c.ranking.size() && i < 5; ++i)
        os << (i ? "," : "") << " " << c.ranking[i].first << " " << g4(c.ranking[i].second);
      if (c.ranking.size() > 5) os << ", …";
      os << ".";
    }
    os << "\n";
    if (c.links.size() > 1)
      for (size_t l = 0; l < c.links.size(); ++l) {
        const auto& s = c.links[l];
        os << "  - link " << l + 1 << " (" << selector_text(c.claim.sides[l]) << " vs "
           << selector_text(c.claim.sides[l + 1]) << "): " << s.verdict << "; " << s.agree << "/" << s.measured
           << " agree, mean Δ " << delta_se_text(s) << ", Welch p " << (s.p ? p_text(*s.p) : "—") << ", CI "
           << ci_text(s.ci) << "; " << s.why << "\n";
      }
    for (const auto& p : c.pairs) {
      os << "  - " << p.a << " vs " << p.b << ": ";
      if (!p.delta) os << "not measured";
      else {
        os << "Δ " << signed_g4(*p.delta) << " (n=" << p.a_values.size() << " vs " << p.b_values.size() << ")";
        if (p.test) os << " ± " << g4(p.test->se) << ", Welch p " << p_text(p.test->p);
        if (p.ci) os << ", CI " << ci_text(p.ci);
        os << (p.agrees ? ", agrees" : ", disagrees");
      }
      if (p.published_delta) os << "; paper Δ " << signed_g4(*p.published_delta);
      os << "\n";
    }
  }
  os << "\nVerdicts: holds — every measured pair goes the claimed way and the effect is significant at α "
        "(Welch over seeds with ≥ 2 seeds a side, else the sign test across pairs; with ≥ 3 seeds the bootstrap "
        "interval must exclude 0 too); fails — significant the other way (no_gain: a significant gain); "
        "inconclusive — neither; not enough data — no matched pair measured. Δ = the claim's better side − the "
        "other, in the metric's units.\n";
  return os.str();
}

json claims_json(const Report& r) {
  json out = json::array();
  for (const auto& c : r.claims) {
    json j = {{"name", c.claim.name}, {"kind", experiments::to_string(c.claim.kind)}, {"metric", c.claim.metric},
              {"lower_is_better", c.claim.lower_is_better}, {"alpha", c.claim.alpha}, {"source", c.claim.source},
              {"statement", claim_statement(c.claim)}, {"verdict", c.verdict}, {"why", c.why},
              {"paper_reading", c.paper_reading}};
    j["paper_consistent"] = c.paper_consistent ? json(*c.paper_consistent) : json();
    j["best"] = c.best ? json(*c.best) : json();
    j["published_best"] = c.published_best ? json(*c.published_best) : json();
    j["p_best"] = opt(c.p_best);
    j["links"] = json::array();
    for (const auto& s : c.links) j["links"].push_back(pair_summary_json(s));
    j["pairs"] = json::array();
    for (const auto& p : c.pairs) {
      json jp = {{"a", p.a}, {"b", p.b}, {"link", p.link}, {"a_values", p.a_values}, {"b_values", p.b_values},
                 {"delta", opt(p.delta)}, {"published_delta", opt(p.published_delta)}, {"agrees", p.agrees}};
      jp["welch"] = p.test ? json{{"t", p.test->t}, {"df", p.test->df}, {"p", p.test->p}, {"se", p.test->se}} : json();
      jp["bootstrap_ci95"] = p.ci ? json::array({p.ci->lo, p.ci->hi}) : json();
      j["pairs"].push_back(jp);
    }
    j["ranking"] = json::array();
    for (const auto& [id, v] : c.ranking) j["ranking"].push_back({{"id", id}, {"mean", v}});
    out.push_back(j);
  }
  return out;
}

std::string format_value(const MetricValue& v, int decimals) {
  if (v.stats.n == 0) return "—";
  if (v.stats.n == 1) return num(v.stats.mean, decimals) + " (1 seed)";
  return num(v.stats.mean, decimals) + " ± " + num(v.stats.std, decimals) + " (n=" + std::to_string(v.stats.n) + ")";
}

std::string format_delta(const Delta& d, int decimals) {
  if (!d.matched) return "unmatched";
  if (!d.ours) return "—";
  std::string s = signed_num(*d.ours, decimals);
  if (d.test) {
    s += " ± " + num(d.test->se, decimals) + " (p=" + fmt::format("{:.3g}", d.test->p) + ")";
  } else {
    s += " (n=" + std::to_string(d.n) + " vs " + std::to_string(d.n_baseline) + ")";
  }
  return s;
}

std::string table_markdown(const Report& r) {
  std::ostringstream os;
  os << "### " << title_line(r) << "\n\n";
  const auto axes = axis_names(r);
  std::vector<std::string> head = axes;
  for (const auto& m : r.metrics) {
    head.push_back(m + " (ours)");
    head.push_back(m + " (paper)");
  }
  for (const auto& m : delta_metrics(r)) {
      head.push_back("Δ " + m + " (ours)");
      head.push_back("Δ " + m + " (paper)");
    }
  const bool epochs = std::any_of(r.rows.begin(), r.rows.end(), [](const Row& row) { return row.epochs.has_value(); });
  if (epochs) head.push_back("epochs");
  head.push_back("status");
  os << "|";
  for (const auto& h : head) os << " " << h << " |";
  os << "\n|";
  for (size_t i = 0; i < head.size(); ++i) os << (i < axes.size() || i + 1 == head.size() ? "---|" : "---:|");
  os << "\n";
  for (const auto& row : r.rows) {
    os << "|";
    for (const auto& a : axes) os << " " << axis_value(row, a) << " |";
    for (const auto& m : r.metrics)
      os << " " << format_value(value_of(row, m), r.decimals.at(m)) << " | " << published_text(row, m, r.decimals.at(m)) << " |";
    for (const auto& m : delta_metrics(r)) {
        auto d = row.deltas.find(m);
        os << " " << (d == row.deltas.end() ? "—" : format_delta(d->second, r.decimals.at(m))) << " | "
           << published_delta_text(row, m, r.decimals.at(m)) << " |";
      }
    if (epochs) os << " " << epochs_text(row) << " |";
    os << " " << row.status << (row.role == "main" ? "" : " (" + row.role + ")") << " |\n";
  }
  os << "\n";
  for (const auto& f : footnotes(r)) os << "- " << f << "\n";
  if (epochs)
    os << "- epochs: tokens trained / the corpus's train tokens (the most of a row's seeds; \"planned\" before any "
          "run): ⚠ marks more than one pass over the data, where the loss partly measures memorisation.\n";
  return os.str();
}

std::string table_latex(const Report& r) {
  std::ostringstream os;
  const auto axes = axis_names(r);
  const size_t groups = r.metrics.size() + delta_metrics(r).size();
  os << "% " << title_line(r) << "\n";
  os << "% generated by `lar table`; runs:";
  for (const auto& row : r.rows)
    for (const auto& [m, v] : row.ours)
      if (m == r.metrics.front())
        for (const auto& id : v.run_ids) os << " " << id;
  os << "\n";
  os << "\\begin{table}[t]\n\\centering\n\\small\n";
  os << "\\caption{" << latex_escape(title_line(r)) << ". Ours beside the published value.}\n";
  os << "\\begin{tabular}{" << std::string(axes.size(), 'l') << std::string(2 * groups, 'r') << "l}\n\\toprule\n";
  // Two header lines: the metric over its ours/paper pair, then the pair.
  for (const auto& a : axes) os << latex_escape(a) << " & ";
  std::vector<std::string> names;
  for (const auto& m : r.metrics) names.push_back(m);
  for (const auto& m : delta_metrics(r)) names.push_back("Δ " + m);
  for (const auto& n : names) os << "\\multicolumn{2}{c}{" << latex_escape(n) << "} & ";
  os << "status \\\\\n";
  for (size_t g = 0; g < names.size(); ++g) {
    const size_t first = axes.size() + 2 * g + 1;
    os << "\\cmidrule(lr){" << first << "-" << first + 1 << "}";
  }
  os << "\n";
  for (size_t i = 0; i < axes.size(); ++i) os << " & ";
  for (size_t g = 0; g < names.size(); ++g) os << "ours & paper & ";
  os << "\\\\\n\\midrule\n";
  for (const auto& row : r.rows) {
    for (const auto& a : axes) os << latex_escape(axis_value(row, a)) << " & ";
    for (const auto& m : r.metrics)
      os << latex_escape(format_value(value_of(row, m), r.decimals.at(m))) << " & "
         << latex_escape(published_text(row, m, r.decimals.at(m))) << " & ";
    for (const auto& m : delta_metrics(r)) {
        auto d = row.deltas.find(m);
        os << latex_escape(d == row.deltas.end() ? "—" : format_delta(d->second, r.decimals.at(m))) << " & "
           << latex_escape(published_delta_text(row, m, r.decimals.at(m))) << " & ";
      }
    os << latex_escape(row.status) << " \\\\\n";
  }
  os << "\\bottomrule\n\\end{tabular}\n";
  for (const auto& f : footnotes(r)) os << "% " << f << "\n";
  os << "\\end{table}\n";
  return os.str();
}

std::string table_csv(const Report& r) {
  std::ostringstream os;
  const auto axes = axis_names(r);
  std::vector<std::string> head = {"row"};
  for (const auto& a : axes) head.push_back(a);
  head.insert(head.end(), {"role", "status"});
  for (const auto& m : r.metrics)
    for (const char* suffix : {"_mean", "_std", "_n", "_paper"}) head.push_back(m + suffix);
  for (const auto& m : delta_metrics(r))
      for (const char* suffix : {"_delta", "_delta_se", "_delta_p", "_delta_paper"}) head.push_back(m + suffix);
  head.push_back("run_ids");
  for (size_t i = 0; i < head.size(); ++i) os << (i ? "," : "") << csv_field(head[i]);
  os << "\n";
  auto full = [](double v) { return json(v).dump(); };  // shortest round-trip text
  for (const auto& row : r.rows) {
    std::vector<std::string> f = {row.id};
    for (const auto& a : axes) f.push_back(axis_value(row, a));
    f.push_back(row.role);
    f.push_back(row.status);
    std::set<std::string> runs;
    for (const auto& m : r.metrics) {
      const MetricValue& v = value_of(row, m);
      runs.insert(v.run_ids.begin(), v.run_ids.end());
      f.push_back(v.stats.n ? full(v.stats.mean) : "");
      f.push_back(v.stats.n >= 2 ? full(v.stats.std) : "");
      f.push_back(std::to_string(v.stats.n));
      auto p = row.published.find(m);
      f.push_back(p == row.published.end() ? "" : full(p->second));
    }
    for (const auto& m : delta_metrics(r)) {
        auto it = row.deltas.find(m);
        const Delta* d = it == row.deltas.end() ? nullptr : &it->second;
        f.push_back(d && d->ours ? full(*d->ours) : "");
        f.push_back(d && d->se ? full(*d->se) : "");
        f.push_back(d && d->test ? full(d->test->p) : "");
        f.push_back(d && d->published ? full(*d->published) : "");
      }
    std::string ids;
    for (const auto& id : runs) ids += (ids.empty() ? "" : " ") + id;
    f.push_back(ids);
    for (size_t i = 0; i < f.size(); ++i) os << (i ? "," : "") << csv_field(f[i]);
    os << "\n";
  }
  return os.str();
}

json table_json(const Report& r) {
  json j;
  j["experiment"] = r.experiment;
  j["scale"] = r.scale;
  j["title"] = r.title;
  j["source"] = r.source;
  j["metrics"] = r.metrics;
  j["throughput_reference"] = r.throughput_reference ? json(*r.throughput_reference) : json();
  j["rows"] = json::array();
  for (const auto& row : r.rows) {
    json jr;
    jr["id"] = row.id;
    jr["axes"] = json::object();
    for (const auto& [a, v] : row.axes) jr["axes"][a] = v;
    jr["role"] = row.role;
    jr["status"] = row.status;
    jr["cells"] = row.cell_ids;
    jr["baseline"] = row.baseline_row ? json(*row.baseline_row) : json();
    jr["ours"] = json::object();
    for (const auto& m : r.metrics) {
      const MetricValue& v = value_of(row, m);
      json jm = {{"n", v.stats.n}, {"values", v.values}, {"run_ids", v.run_ids}, {"proxy", v.proxy}};
      jm["mean"] = v.stats.n ? json(v.stats.mean) : json();
      jm["std"] = v.stats.n >= 2 ? json(v.stats.std) : json();
      jr["ours"][m] = jm;
    }
    jr["published"] = json::object();
    for (const auto& [m, v] : row.published) jr["published"][m] = v;
    jr["deltas"] = json::object();
    for (const auto& [m, d] : row.deltas) {
      json jd = {{"matched", d.matched}, {"ours", opt(d.ours)}, {"se", opt(d.se)}, {"published", opt(d.published)},
                 {"n", d.n}, {"n_baseline", d.n_baseline}};
      jd["mismatch"] = d.matched ? json() : json(d.mismatch);
      if (d.test) jd["welch"] = {{"t", d.test->t}, {"df", d.test->df}, {"p", d.test->p}};
      jr["deltas"][m] = jd;
    }
    jr["notes"] = row.notes;
    jr["epochs"] = opt(row.epochs);
    jr["epochs_planned"] = row.epochs_planned;
    j["rows"].push_back(jr);
  }
  return j;
}

json audit_json(const Report& r) {
  json j = table_json(r);
  j["runs"] = json::array();
  for (const auto& v : r.runs)
    j["runs"].push_back({{"run_id", v.run_id}, {"cell", v.cell_id}, {"included", v.included},
                         {"reason_code", v.code.empty() ? json() : json(v.code)}, {"reason", v.reason}});
  j["agreement"] = json::array();
  for (const auto& a : r.agreement)
    j["agreement"].push_back({{"metric", a.metric}, {"n", a.n}, {"spearman", opt(a.spearman)}, {"kendall_tau_b", opt(a.kendall)}});
  j["claims"] = claims_json(r);
  j["sign_agreement"] = json::array();
  for (const auto& s : r.signs) j["sign_agreement"].push_back({{"metric", s.metric}, {"n", s.n}, {"agree", s.agree}});
  j["known_issues"] = json::array();
  for (const auto& k : r.known_issues) j["known_issues"].push_back({{"where", k.where}, {"text", k.text}});
  const auto failed = r.failed_main_rows();
  j["failed_main_rows"] = failed;
  j["incomplete_main_rows"] = r.main_rows_with_status("incomplete");
  j["pass"] = failed.empty();
  return j;
}

std::string audit_markdown(const Report& r) {
  std::ostringstream os;
  os << "## Audit: " << title_line(r) << "\n\n";
  os << "### Cells\n\n| row | role | status | included runs | excluded runs | notes |\n|---|---|---|---|---|---|\n";
  std::map<std::string, std::vector<const RunVerdict*>> by_cell;
  for (const auto& v : r.runs) by_cell[v.cell_id].push_back(&v);
  for (const auto& row : r.rows) {
    std::string inc, exc;
    for (const auto& cid : row.cell_ids)
      for (const RunVerdict* v : by_cell[cid]) {
        if (v->included) inc += (inc.empty() ? "" : ", ") + v->run_id;
        else exc += (exc.empty() ? "" : "; ") + v->run_id + ": " + v->reason;
      }
    std::string notes;
    for (const auto& n : row.notes) notes += (notes.empty() ? "" : "; ") + n;
    os << "| " << row.id << " | " << row.role << " | " << row.status << " | " << (inc.empty() ? "—" : inc) << " | "
       << (exc.empty() ? "—" : exc) << " | " << (notes.empty() ? "—" : notes) << " |\n";
  }
  std::vector<const RunVerdict*> stray;
  for (const auto& v : r.runs)
    if (v.code == reason::not_in_plan) stray.push_back(&v);
  if (!stray.empty()) {
    os << "\nRuns of " << r.experiment << " outside this table:\n";
    for (const auto* v : stray) os << "- " << v->run_id << ": " << v->reason << "\n";
  }

  os << "\n### Agreement with the paper\n\n";
  bool any = false;
  for (const auto& a : r.agreement) {
    if (a.n == 0) continue;
    any = true;
    os << "- " << a.metric << ": Spearman ρ = " << (a.spearman ? fmt::format("{:.3f}", *a.spearman) : std::string("n/a"))
       << ", Kendall τ-b = " << (a.kendall ? fmt::format("{:.3f}", *a.kendall) : std::string("n/a")) << " over " << a.n
       << " main rows\n";
  }
  for (const auto& s : r.signs) {
    if (s.n == 0) continue;
    any = true;
    os << "- Δ " << s.metric << ": sign agrees in " << s.agree << " of " << s.n << " matched deltas\n";
  }
  if (!any) os << "- no row has both our value and a published one yet\n";

  if (!r.claims.empty()) os << "\n" << claims_markdown(r);

  if (!r.known_issues.empty()) {
    os << "\n### The paper's own inconsistencies\n\n";
    for (const auto& k : r.known_issues) os << "- " << k.where << ": " << k.text << "\n";
  }

  const auto failed = r.failed_main_rows();
  int main_rows = 0;
  for (const auto& row : r.rows) main_rows += row.role == "main";
  os << "\n### Verdict\n\n";
  if (failed.empty()) {
    os << "PASS: all " << main_rows << " main rows have an included run for every seed and matched baselines.\n";
  } else {
    // fail and not-yet-run first (the verdict's first word), then the rows still in progress
    const auto incomplete = r.main_rows_with_status("incomplete");
    const std::size_t bad = failed.size() - incomplete.size();
    if (bad > 0) {
      os << "FAIL: " << bad << " of " << main_rows << " main rows fail:";
      for (const auto& f : failed)
        if (std::find(incomplete.begin(), incomplete.end(), f) == incomplete.end()) os << " " << f;
      os << "\n";
    }
    if (!incomplete.empty()) {
      os << (bad > 0 ? "\n" : "") << "INCOMPLETE: " << incomplete.size() << " of " << main_rows
         << " main rows have runs not finished yet (training, or cut before the end of their schedule; "
            "`lar reproduce` again trains what is missing):";
      for (const auto& f : incomplete) os << " " << f;
      os << "\n";
    }
  }
  return os.str();
}

std::string render_table(const Report& r, const std::string& format) {
  if (format == "md" || format == "markdown") return table_markdown(r);
  if (format == "latex" || format == "tex") return table_latex(r);
  if (format == "csv") return table_csv(r);
  if (format == "json") return table_json(r).dump(2) + "\n";
  throw UserError("unknown table format '" + format + "' (choices: md, latex, csv, json)");
}

std::string render_audit(const Report& r, const std::string& format) {
  if (format == "md" || format == "markdown") return audit_markdown(r);
  if (format == "json") return audit_json(r).dump(2) + "\n";
  throw UserError("unknown audit format '" + format + "' (choices: md, json)");
}

}  // namespace lar::report
