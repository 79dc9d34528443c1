// The paper figures: from an audited report (and, for training curves, the registry) to
// Figure values in the shared grammar; the catalogue behind `lar export figure`.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "core/error.hpp"
#include "registry/report/adapter.hpp"
#include "registry/report/figure.hpp"

namespace lar::report {

namespace {

std::string axis_text(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_number()) return fmt::format("{:g}", v.get<double>());
  return v.dump();
}

// Axes a matrix ties to others (`by:` lists): they never tell two series apart.
bool tied_axis(const std::string& a) {
  return a == "seed" || a.rfind("budget.", 0) == 0 || a.rfind("schedule.", 0) == 0 || a == "data.batch_size" ||
         a == "model.n_heads" || a == "model.n_kv_heads";
}

std::optional<double> axis_number(const Row& row, const std::string& axis) {
  for (const auto& [a, v] : row.axes)
    if (a == axis && v.is_number()) return v.get<double>();
  return std::nullopt;
}

std::string metric_base(const std::string& m) { return m.substr(0, m.find('@')); }

// Powers of two as "4K", "16K": the sequence-length axes of the papers.
std::vector<std::pair<double, std::string>> length_tics(const std::set<double>& xs) {
  std::vector<std::pair<double, std::string>> t;
  for (double x : xs) {
    const double k = x / 1024;
    t.push_back({x, x >= 1024 && std::abs(k - std::round(k)) < 1e-9 ? fmt::format("{:g}K", k) : fmt::format("{:g}", x)});
  }
  return t;
}

bool is_length_axis(const std::string& a) { return a == "seq_len" || a == "data.seq_len" || a == "context"; }

}  // namespace

Facets row_facets(const Row& row, const std::string& x_axis) {
  Facets f;
  for (const auto& [a, v] : row.axes) {
    if (a == x_axis || tied_axis(a)) continue;
    std::string key = a;
    if (a == "model.architecture") key = "architecture";
    if (a == "optimizer.name") key = "optimizer";
    if (a == "model.stack") key = "stack";
    if (a == "data.seq_len") key = "seq_len";
    f[key] = axis_text(v);
  }
  // Fixed by the spec's base (not an axis), still what the series is: the mixer's colour.
  return f;
}

Figure metric_vs_axis(const Report& rep, const std::string& x_axis, const std::string& y_metric,
                      const std::vector<std::string>& series_axes) {
  Figure fig;
  fig.xlabel = axis_label(x_axis);
  fig.ylabel = axis_label(metric_base(y_metric));
  std::map<std::string, size_t> index;  // series key → position (ours); paper series follow
  std::vector<Series> ours, paper;
  std::set<double> xs;
  for (const auto& row : rep.rows) {
    std::optional<double> x = axis_number(row, x_axis);
    if (!x) continue;
    std::string key;
    Facets all = row_facets(row, x_axis), f;
    for (const auto& [a, v] : row.axes)
      if (std::find(series_axes.begin(), series_axes.end(), a) != series_axes.end()) key += (key.empty() ? "" : "/") + axis_text(v);
    for (const auto& a : series_axes)
      if (all.count(a)) f[a] = all[a];
    if (key.empty()) key = "all";
    auto [it, fresh] = index.try_emplace(key, ours.size());
    if (fresh) {
      ours.push_back(make_series("", {}, {}, false, true, f));
      paper.push_back(make_series("", {}, {}, true, true, f));
    }
    xs.insert(*x);
    if (auto o = row.ours.find(y_metric); o != row.ours.end() && o->second.stats.n > 0) {
      ours[it->second].points.push_back({*x, o->second.stats.mean, o->second.stats.std});
      auto& ids = ours[it->second].run_ids;
      ids.insert(ids.end(), o->second.run_ids.begin(), o->second.run_ids.end());
    }
    if (auto p = row.published.find(y_metric); p != row.published.end()) paper[it->second].points.push_back({*x, p->second});
  }
  auto by_x = [](const Point& a, const Point& b) { return a.x < b.x; };
  for (auto& s : ours) std::stable_sort(s.points.begin(), s.points.end(), by_x);
  for (auto& s : paper) std::stable_sort(s.points.begin(), s.points.end(), by_x);
  fig.series = ours;
  for (auto& s : paper)
    if (!s.points.empty()) fig.series.push_back(s);
  if (x_axis == "lr" && !xs.empty()) {  // the swept rates themselves, as "3e-4"
    for (double x : xs) fig.xtics.push_back({x, facet_words("lr", fmt::format("{:g}", x)).substr(3)});
  }
  if (is_length_axis(x_axis) && !xs.empty()) {
    fig.logx = true;
    fig.log_base_x = 2;
    fig.xtics = length_tics(xs);
  }
  return fig;
}

Figure metric_vs_suffix(const Report& rep, const std::string& prefix, bool exp_y) {
  Figure fig;
  fig.xlabel = axis_label("context");
  fig.ylabel = exp_y ? "validation perplexity" : axis_label(metric_base(prefix));
  std::set<double> xs;
  auto value = [&](double v) { return exp_y ? std::exp(v) : v; };
  for (const auto& row : rep.rows) {
    Series s = make_series("", {}, {}, false, true, row_facets(row));
    Series paper = make_series("", {}, {}, true, true, s.facets);
    for (const auto& m : rep.metrics) {
      if (m.rfind(prefix, 0) != 0) continue;
      double L = 0;
      try {
        L = std::stod(m.substr(prefix.size()));
      } catch (const std::exception&) {
        continue;
      }
      if (auto o = row.ours.find(m); o != row.ours.end() && o->second.stats.n > 0) {
        xs.insert(L);
        std::vector<double> vals;
        for (double v : o->second.values) vals.push_back(value(v));
        const SampleStats st = sample_stats(vals);
        s.points.push_back({L, st.mean, st.std});
        s.run_ids.insert(s.run_ids.end(), o->second.run_ids.begin(), o->second.run_ids.end());
      }
      if (auto p = row.published.find(m); p != row.published.end()) {
        xs.insert(L);
        paper.points.push_back({L, value(p->second)});
      }
    }
    fig.series.push_back(s);
    if (!paper.points.empty()) fig.series.push_back(paper);
  }
  fig.xtics = length_tics(xs);
  return fig;
}

Figure metric_vs_metric(const Report& rep, const std::string& x_metric, const std::string& y_metric) {
  Figure fig;
  fig.xlabel = axis_label(x_metric);
  fig.ylabel = axis_label(y_metric);
  // One series per row (its marker and colour name the cell), ours and the paper's; the
  // label and the joining segment say which paper point is the same cell.
  std::vector<Series> ours, paper;
  std::vector<Point> paper_pts;
  std::vector<Facets> links_facets;
  for (const auto& row : rep.rows) {
    const Facets f = row_facets(row);
    auto ox = row.ours.find(x_metric), oy = row.ours.find(y_metric);
    auto px = row.published.find(x_metric), py = row.published.find(y_metric);
    std::optional<Point> o, p;
    if (ox != row.ours.end() && oy != row.ours.end() && ox->second.stats.n > 0 && oy->second.stats.n > 0) {
      o = Point{ox->second.stats.mean, oy->second.stats.mean, oy->second.stats.std};
      Series s = make_series("", {*o}, oy->second.run_ids, false, false, f);
      ours.push_back(s);
    }
    if (px != row.published.end() && py != row.published.end()) {
      p = Point{px->second, py->second};
      paper.push_back(make_series("", {*p}, {}, true, false, f));
      paper_pts.push_back(*p);
    }
    if (o) fig.labels.push_back({*o, short_label(f)});
    if (o && p) {
      // The segment's dash is the optimiser's (solid Muon, dashed AdamW), its colour the cell's.
      links_facets.push_back(f);
      fig.links.push_back({*o, *p});
    }
  }
  const auto link_styles = styles_for(links_facets);
  for (size_t i = 0; i < fig.links.size(); ++i) {
    fig.links[i].colour = tint(link_styles[i].colour, 0.3);
    fig.links[i].dash = link_styles[i].dash;
  }
  // The legend names each cell once (ours); the paper's points share their style, so one
  // neutral legend entry explains open markers.
  fig.series = ours;
  if (!paper_pts.empty()) {
    Series front = make_series("paper's Pareto front", pareto_front(paper_pts), {}, false, true);
    front.style.colour = "#b0b0b0";
    front.style.width = 4;
    front.style.marker = -1;
    front.keep_style = true;
    fig.series.insert(fig.series.begin(), front);
  }
  for (auto& s : paper) {
    s.keyed = false;
    fig.series.push_back(s);
  }
  if (!paper.empty()) {
    // One neutral entry explains the open markers.
    Series key = make_series("open: the paper's value", {{std::nan(""), std::nan("")}}, {}, true, false);
    key.style.colour = "#555555";
    key.keep_style = true;
    fig.series.push_back(key);
  }
  return fig;
}

Figure bars_figure(const Report& rep, const std::vector<std::string>& metrics, bool relative) {
  Figure fig;
  fig.cols = static_cast<int>(metrics.size());
  // The reference row: the baseline the spec names, else the first row.
  const Row* ref = rep.rows.empty() ? nullptr : &rep.rows.front();
  for (const auto& r : rep.rows)
    if (r.baseline_row)
      for (const auto& b : rep.rows)
        if (b.id == *r.baseline_row) ref = &b;
  for (const auto& m : metrics) {
    Figure p;
    p.bars = true;
    p.title = axis_label(m);
    p.ylabel = relative && ref ? fmt::format("relative to {} (%)", legends_for({row_facets(*ref)}).front()) : axis_label(m);
    const double ours_ref = ref && ref->ours.count(m) && ref->ours.at(m).stats.n > 0 ? ref->ours.at(m).stats.mean : 0;
    const double paper_ref = ref && ref->published.count(m) ? ref->published.at(m) : 0;
    std::vector<Facets> facets;
    for (const auto& r : rep.rows) facets.push_back(row_facets(r));
    const auto names = legends_for(facets);
    for (size_t i = 0; i < rep.rows.size(); ++i) {
      const Row& r = rep.rows[i];
      const double x = static_cast<double>(i);
      p.xtics.push_back({x, names[i]});
      auto scale = [&](double v, double base) { return relative && base > 0 ? 100.0 * v / base : v; };
      auto text = [&](double v) { return v >= 1e3 ? fmt::format("{:.1f}k", v / 1e3) : fmt::format("{:.3g}", v); };
      if (auto o = r.ours.find(m); o != r.ours.end() && o->second.stats.n > 0) {
        const Point pt{x - 0.19, scale(o->second.stats.mean, ours_ref), relative && ours_ref > 0 ? 100 * o->second.stats.std / ours_ref : o->second.stats.std};
        p.series.push_back(make_series("ours", {pt}, o->second.run_ids, false, false, facets[i]));
        p.labels.push_back({{pt.x - 0.17, pt.y}, text(o->second.stats.mean)});
      }
      if (auto q = r.published.find(m); q != r.published.end()) {
        const Point pt{x + 0.19, scale(q->second, paper_ref)};
        p.series.push_back(make_series("paper", {pt}, {}, true, false, facets[i]));
        p.labels.push_back({{pt.x - 0.17, pt.y}, text(q->second)});
      }
    }
    // Only the first bar of each kind names it in the legend.
    bool ours_named = false, paper_named = false;
    for (auto& s : p.series) {
      bool& named = s.published ? paper_named : ours_named;
      s.label = s.published ? "paper (light)" : "ours (solid)";
      s.keyed = !named;
      named = true;
    }
    fig.panels.push_back(p);
  }
  return fig;
}

Figure curves_figure(const std::string& name, const std::string& title, const std::string& xlabel,
                     const std::string& ylabel, const std::vector<Curve>& curves, double smooth) {
  Figure fig;
  fig.name = name;
  fig.title = title;
  fig.xlabel = xlabel;
  fig.ylabel = ylabel;
  // Seeds of one row share a label: one series, mean ± std.
  std::vector<std::string> order;
  std::map<std::string, std::vector<const Curve*>> by_label;
  for (const auto& c : curves) {
    if (!by_label.count(c.label)) order.push_back(c.label);
    by_label[c.label].push_back(&c);
  }
  for (const auto& label : order) {
    const auto& group = by_label[label];
    std::vector<std::vector<Point>> raw, smoothed;
    Series s;
    s.facets = group.front()->facets;
    if (s.facets.empty()) s.label = label;
    for (const Curve* c : group) {
      raw.push_back(c->points);
      smoothed.push_back(ema(c->points, smooth));
      s.run_ids.push_back(c->run_id);
    }
    s.points = mean_curve(smoothed);
    if (smooth > 0) {
      s.raw = mean_curve(raw);
      for (auto& p : s.raw) p.err = 0;
    }
    s.band = true;
    fig.series.push_back(s);
  }
  if (smooth > 0) fig.note = fmt::format("EMA-smoothed (factor {:.2f}); raw curves faint behind", smooth);
  return fig;
}

Figure split_panels(const Figure& fig, const std::string& row_facet, const std::string& col_facet) {
  auto values = [&](const std::string& facet) {
    std::vector<std::string> v;
    for (const auto& s : fig.series) {
      auto it = s.facets.find(facet);
      const std::string x = it == s.facets.end() ? "" : it->second;
      if (std::find(v.begin(), v.end(), x) == v.end()) v.push_back(x);
    }
    return facet.empty() ? std::vector<std::string>{""} : v;
  };
  auto rows = values(row_facet), cols = values(col_facet);
  // The paper's order: Muon above AdamW.
  if (row_facet == "optimizer")
    std::stable_sort(rows.begin(), rows.end(), [](const std::string& a, const std::string& b) {
      return (a == "normuon" || a == "muon") && !(b == "normuon" || b == "muon");
    });
  Figure out = fig;
  out.series.clear();
  out.links.clear();
  out.labels.clear();
  out.cols = static_cast<int>(cols.size());
  for (const auto& r : rows)
    for (const auto& c : cols) {
      Figure p;
      p.xlabel = fig.xlabel;
      p.ylabel = fig.ylabel;
      p.logx = fig.logx;
      p.logy = fig.logy;
      p.log_base_x = fig.log_base_x;
      p.xtics = fig.xtics;
      p.xformat = fig.xformat;
      p.colour_by = fig.colour_by;
      std::string t;
      for (const auto& [facet, v] : {std::pair{col_facet, c}, std::pair{row_facet, r}})
        if (!facet.empty()) t += (t.empty() ? "" : " · ") + facet_words(facet, v);
      p.title = t;
      for (const auto& s : fig.series) {
        auto get = [&](const std::string& facet) {
          auto it = s.facets.find(facet);
          return it == s.facets.end() ? std::string() : it->second;
        };
        if ((row_facet.empty() || get(row_facet) == r) && (col_facet.empty() || get(col_facet) == c)) {
          // The panel's title names its facets; the legend (made per panel) says only what
          // differs inside it, and the mixer keeps its colour.
          Series copy = s;
          if (!copy.facets.empty()) copy.label.clear();
          p.series.push_back(copy);
        }
      }
      out.panels.push_back(p);
    }
  return out;
}

const std::vector<FigureDef>& figure_catalogue() {
  static const std::vector<FigureDef> defs = [] {
    std::vector<FigureDef> d;
    auto def = [](std::string name, std::string table, std::string kind, std::string x, std::string y,
                  std::vector<std::string> axes, std::string title) {
      FigureDef f;
      f.name = std::move(name);
      f.table = std::move(table);
      f.kind = std::move(kind);
      f.x = std::move(x);
      f.y = std::move(y);
      f.series_axes = std::move(axes);
      f.title = std::move(title);
      return f;
    };
    // The paper plots validation loss; lar evaluates at the phase ends only (eval.every
    // 0), so the curves are the training loss logged every step.
    FigureDef f3 = def("laa/fig3", "laa/table2", "curves", "tokens", "loss", {}, "LAA Fig. 3: training loss vs tokens (Table 2 runs)");
    f3.grid_cols = "architecture";
    // 18 curves in one panel overlap wherever the mixers train alike; a panel per mixer
    // (--no-grid for the paper's single panel) keeps each under five, told apart by dash
    // and shade.
    f3.grid_default = true;
    d.push_back(f3);
    FigureDef f4 = def("laa/fig4", "laa/lr_sweep", "curves", "step", "loss", {}, "LAA Fig. 4: training loss of the learning-rate sweep");
    f4.grid_rows = "optimizer";
    f4.grid_cols = "architecture";
    f4.grid_default = true;
    f4.colour_by = "lr";
    f4.mark_best = true;
    d.push_back(f4);
    FigureDef f5 = def("laa/fig5", "laa/lr_sweep", "metric_vs_axis", "lr", "final_loss", {"architecture", "optimizer"},
                 "LAA Fig. 5: final loss vs learning rate");
    f5.logx = true;
    f5.mark_best = true;
    d.push_back(f5);
    d.push_back(def("laa/fig6", "laa/fig6", "metric_vs_axis", "seq_len", "sec_per_iter", {"architecture", "stack"},
                 "LAA Fig. 6: time per iteration vs sequence length"));
    d.push_back(def("laa/frontier", "laa/table2", "metric_vs_metric", "rel_throughput_pct", "final_loss", {},
                 "LAA Table 2: loss–throughput frontier"));
    d.push_back(def("ccq/fig3", "ccq/fig3", "metric_vs_length", "context", "val_loss@", {},
                 "CCQ Fig. 3: length extrapolation, 500M (perplexity vs context)"));
    d.push_back(def("ccq/fig4", "ccq/fig4", "metric_vs_length", "context", "val_loss@", {},
                 "CCQ Fig. 4: length extrapolation, 1.3B (perplexity vs context)"));
    // ppl@L of `lar eval --lengths` (token-weighted, non-overlapping windows) on a corpus.
    d.push_back(def("ccq/fig3_4", "ccq/fig3_4", "metric_vs_length", "context", "ppl@", {},
                 "CCQ Figs. 3-4: token perplexity vs context length (lar eval --lengths)"));
    d.push_back(def("ccq/fig5", "ccq/fig5", "metric_vs_axis", "seq_len", "tokens_per_s", {"architecture", "ccq"},
                 "CCQ Fig. 5: training throughput at 32K tokens per step"));
    d.push_back(def("carve/table3", "carve/table3", "bars", "", "tokens_per_s,peak_mem_gb", {},
                 "CARVE Table 3: throughput and peak memory (GDN-2 = 100)"));
    return d;
  }();
  return defs;
}

const FigureDef& find_figure(const std::string& name) {
  std::vector<std::string> names;
  for (const auto& d : figure_catalogue()) {
    if (d.name == name) return d;
    names.push_back(d.name);
  }
  std::string all;
  for (const auto& n : names) all += (all.empty() ? "" : ", ") + n;
  std::string msg = "unknown figure '" + name + "' (choices: " + all + ")";
  std::string hint = did_you_mean(name, names);
  if (!hint.empty()) msg += "; " + hint;
  throw UserError(msg);
}

std::vector<std::string> figures_of_table(const std::string& paper_table) {
  std::vector<std::string> out;
  for (const auto& d : figure_catalogue())
    if (d.table == paper_table) out.push_back(d.name);
  return out;
}

namespace {

std::vector<Curve> registry_curves(const FigureDef& def, const Report& rep, const std::filesystem::path& db) {
  std::vector<Curve> list;
  if (!std::filesystem::exists(db)) return list;
  auto reg = registry::Registry::open(db, /*read_only=*/true);
  for (const auto& row : rep.rows) {
    std::vector<std::string> ids;
    for (const auto& [m, v] : row.ours) ids.insert(ids.end(), v.run_ids.begin(), v.run_ids.end());
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    for (const auto& id : ids) {
      Curve c;
      c.label = row.id;
      c.run_id = id;
      c.facets = row_facets(row);
      for (const auto& pt : reg.metric_series(id, def.y))
        if (pt.value == pt.value) c.points.push_back({def.x == "tokens" ? pt.tokens : static_cast<double>(pt.step), pt.value});
      if (!c.points.empty()) list.push_back(std::move(c));
    }
  }
  return list;
}

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t p; (p = s.find(',', start)) != std::string::npos; start = p + 1) out.push_back(s.substr(start, p - start));
  out.push_back(s.substr(start));
  return out;
}

// The best learning rate per mixer × optimiser: the row with the lowest final loss.
std::map<Facets, std::string> best_lr(const Report& rep) {
  std::map<Facets, std::pair<double, std::string>> best;
  for (const auto& row : rep.rows) {
    auto o = row.ours.find("final_loss");
    if (o == row.ours.end() || o->second.stats.n == 0 || !std::isfinite(o->second.stats.mean)) continue;
    Facets f = row_facets(row);
    const std::string lr = f["lr"];
    f.erase("lr");
    auto it = best.find(f);
    if (it == best.end() || o->second.stats.mean < it->second.first) best[f] = {o->second.stats.mean, lr};
  }
  std::map<Facets, std::string> out;
  for (const auto& [f, v] : best) out[f] = v.second;
  return out;
}

}  // namespace

double auto_smoothing(size_t points) {
  // An EMA lags by about a/(1−a) points: keep that near 1/20 of the curve, so a short
  // smoke run is not drawn late, and never smooth over more than ~20 points.
  if (points < 10) return 0;
  return std::min(0.95, std::max(0.0, 1.0 - 20.0 / static_cast<double>(points)));
}

Figure build_figure(const FigureDef& def, const PaperReport& p, const std::filesystem::path& db, const FigureOptions& opt) {
  const Report& rep = p.report;
  Figure fig;
  if (def.kind == "curves") {
    const auto curves = registry_curves(def, rep, db);
    size_t longest = 0;
    for (const auto& c : curves) longest = std::max(longest, c.points.size());
    const double smooth = opt.smooth.value_or(auto_smoothing(longest));
    if (smooth < 0 || smooth >= 1) throw UserError(fmt::format("--smooth {:g}: the EMA factor must be in [0, 1)", smooth));
    fig = curves_figure(def.name, def.title, axis_label(def.x), axis_label(def.y), curves, smooth);
    if (def.x == "tokens") fig.xformat = "%.0s%c";
    if (def.mark_best) {
      const auto best = best_lr(rep);
      for (auto& s : fig.series) {
        Facets f = s.facets;
        const std::string lr = f["lr"];
        f.erase("lr");
        if (auto it = best.find(f); it != best.end() && it->second == lr) s.emphasis = true;
      }
    }
  } else if (def.kind == "metric_vs_axis") {
    fig = metric_vs_axis(rep, def.x, def.y, def.series_axes);
    if (def.mark_best)
      for (auto& s : fig.series) {
        if (s.published || s.points.empty()) continue;
        auto lowest = std::min_element(s.points.begin(), s.points.end(), [](const Point& a, const Point& b) { return a.y < b.y; });
        s.best = *lowest;
      }
  } else if (def.kind == "metric_vs_length") {
    // A loss at each length is drawn as its perplexity; a perplexity as it is.
    fig = metric_vs_suffix(rep, def.y, /*exp_y=*/def.y.find("loss") != std::string::npos);
  } else if (def.kind == "bars") {
    fig = bars_figure(rep, split_commas(def.y), /*relative=*/true);
  } else {
    fig = metric_vs_metric(rep, def.x, def.y);
  }
  fig.name = def.name;
  fig.title = def.title;
  const std::string where = rep.experiment + (rep.scale.empty() ? "" : ", scale " + rep.scale);
  fig.note = fig.note.empty() ? where : where + "; " + fig.note;
  fig.logx = fig.logx || def.logx;
  fig.logy = def.logy;
  fig.colour_by = def.colour_by;
  const bool grid = opt.grid.value_or(def.grid_default);
  if (grid && def.grid_rows.empty() && def.grid_cols.empty() && fig.panels.empty())
    throw UserError("figure " + def.name + " has no small-multiples layout (--grid applies to laa/fig3, laa/fig4)");
  if (grid && fig.panels.empty()) {
    fig = split_panels(fig, def.grid_rows, def.grid_cols);
    fig.key_in_first_panel_only = false;
  }
  apply_grammar(fig);
  // The best learning rate's curve says so in its legend.
  auto mark = [](Figure& f) {
    for (auto& s : f.series)
      if (s.emphasis) s.label += " (best)";
  };
  mark(fig);
  for (auto& panel : fig.panels) mark(panel);
  return fig;
}

std::vector<std::filesystem::path> render_table_figures(const PaperReport& p, const std::filesystem::path& db,
                                                        const std::filesystem::path& dir,
                                                        const std::vector<std::string>& formats) {
  const std::string table = p.spec.parent_path().filename().string() + "/" + p.spec.stem().string();
  std::vector<std::filesystem::path> written;
  const auto names = figures_of_table(table);
  if (names.empty()) return written;
  std::filesystem::create_directories(dir);
  for (const auto& name : names) {
    const Figure fig = build_figure(find_figure(name), p, db);
    std::string stem = name;
    std::replace(stem.begin(), stem.end(), '/', '_');
    for (const auto& format : formats) {
      const auto out = dir / (stem + "." + format);
      render_figure(fig, format, out);
      written.push_back(out);
    }
  }
  return written;
}

std::vector<std::filesystem::path> render_table_figures(const std::string& paper_table, const std::string& scale, int seeds,
                                                        const std::filesystem::path& db, const std::filesystem::path& dir,
                                                        const std::vector<std::string>& formats) {
  if (figures_of_table(paper_table).empty()) return {};
  return render_table_figures(paper_report(paper_table, scale, seeds, db), db, dir, formats);
}

}  // namespace lar::report
