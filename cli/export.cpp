// `lar export figure NAME` — paper figures from the registry, drawn by gnuplot
// (SVG / PNG / PDF); prints the run ids each figure was drawn from.
#include <algorithm>
#include <iostream>
#include <memory>

#include "cli/command.hpp"
#include "core/error.hpp"
#include "core/paths.hpp"
#include "registry/report/adapter.hpp"
#include "registry/report/figure.hpp"

namespace {

struct ExportArgs {
  std::string name;
  std::string format = "svg";
  std::string out;
  std::string scale;
  int seeds = 0;
  bool list = false;
};

lar::report::Figure curves(const lar::report::FigureDef& def, const lar::report::PaperReport& p,
                           const std::filesystem::path& db) {
  using namespace lar;
  std::vector<report::Curve> list;
  if (std::filesystem::exists(db)) {
    auto reg = registry::Registry::open(db, /*read_only=*/true);
    for (const auto& row : p.report.rows) {
      std::vector<std::string> ids;
      for (const auto& [m, v] : row.ours) ids.insert(ids.end(), v.run_ids.begin(), v.run_ids.end());
      std::sort(ids.begin(), ids.end());
      ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
      for (const auto& id : ids) {
        report::Curve c;
        c.label = ids.size() > 1 ? row.id + " (" + id.substr(id.rfind('.') + 1) + ")" : row.id;
        c.run_id = id;
        for (const auto& pt : reg.metric_series(id, def.y))
          if (pt.value == pt.value) c.points.push_back({def.x == "tokens" ? pt.tokens : static_cast<double>(pt.step), pt.value});
        if (!c.points.empty()) list.push_back(std::move(c));
      }
    }
  }
  return report::curves_figure(def.name, def.title, def.x, def.y, list);
}

int run_export(const ExportArgs& a) {
  using namespace lar;
  if (a.list) {
    for (const auto& d : report::figure_catalogue()) std::cout << d.name << "  (" << d.table << ")  " << d.title << "\n";
    return 0;
  }
  if (a.name.empty()) throw UserError("name a figure (lar export figure --list shows them)");
  const report::FigureDef& def = report::find_figure(a.name);
  const auto db = default_db_path();
  auto p = report::paper_report(def.table, a.scale, a.seeds, db);
  report::Figure fig;
  if (def.kind == "curves") fig = curves(def, p, db);
  else if (def.kind == "metric_vs_axis") fig = report::metric_vs_axis(p.report, def.x, def.y, def.series_axes);
  else if (def.kind == "metrics_at_lengths") fig = report::metrics_at_lengths(p.report, def.y);
  else fig = report::metric_vs_metric(p.report, def.x, def.y);
  fig.name = def.name;
  fig.title = def.title + " — " + p.report.experiment + (p.report.scale.empty() ? "" : ", scale " + p.report.scale);
  fig.logx = def.x == "lr";
  std::string out = a.out;
  if (out.empty()) {
    out = def.name;
    std::replace(out.begin(), out.end(), '/', '_');
    out += "." + a.format;
  }
  report::render_figure(fig, a.format, out);
  const auto runs = fig.runs();
  std::cout << "wrote " << out << " (" << a.format << ", " << fig.series.size() << " series) from " << runs.size()
            << " runs:\n";
  for (const auto& id : runs) std::cout << "  " << id << "\n";
  if (runs.empty()) std::cout << "  (none yet: run `lar reproduce " << def.table << "` first)\n";
  return 0;
}

}  // namespace

static lar::cli::CommandRegistration reg{
    "export", "Export paper figures (gnuplot: svg, png, pdf)", 62,
    [](CLI::App& app) -> lar::cli::Runner {
      auto a = std::make_shared<ExportArgs>();
      app.require_subcommand(1);
      CLI::App* fig = app.add_subcommand("figure", "Draw a paper figure from the registry");
      fig->add_option("name", a->name, "figure: laa/fig3, laa/fig4, laa/fig5, laa/fig6, laa/frontier, ccq/fig3_4");
      fig->add_option("--format", a->format, "svg | png | pdf")->check(CLI::IsMember({"svg", "png", "pdf"}));
      fig->add_option("-o,--out", a->out, "output file (default: <name>.<format>, '/' → '_')");
      fig->add_option("--scale", a->scale, "scale the runs were made at (default: the spec's)");
      fig->add_option("--seeds", a->seeds, "seeds per cell the reproduction used")->check(CLI::NonNegativeNumber);
      fig->add_flag("--list", a->list, "list the figures");
      return [a] { return run_export(*a); };
    }};
