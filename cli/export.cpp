// `lar export figure NAME` — paper figures from the registry, drawn by gnuplot
// (SVG / PNG / PDF) in one visual grammar (registry/report/style.hpp); prints the run ids
// each figure was drawn from.
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
  std::optional<double> smooth;
  bool grid = false, no_grid = false;
};

int run_export(const ExportArgs& a) {
  using namespace lar;
  if (a.list) {
    for (const auto& d : report::figure_catalogue())
      std::cout << d.name << "  (" << d.table << (d.grid_cols.empty() ? "" : d.grid_default ? ", panels" : ", --grid") << ")  "
                << d.title << "\n";
    return 0;
  }
  if (a.name.empty()) throw UserError("name a figure (lar export figure --list shows them)");
  const report::FigureDef& def = report::find_figure(a.name);
  const auto db = default_db_path();
  auto p = report::paper_report(def.table, a.scale, a.seeds, db);
  report::FigureOptions opt;
  opt.smooth = a.smooth;
  if (a.grid) opt.grid = true;
  if (a.no_grid) opt.grid = false;
  const report::Figure fig = report::build_figure(def, p, db, opt);
  std::string out = a.out;
  if (out.empty()) {
    out = def.name;
    std::replace(out.begin(), out.end(), '/', '_');
    out += "." + a.format;
  }
  report::render_figure(fig, a.format, out);
  const auto runs = fig.runs();
  size_t n = fig.series.size();
  for (const auto& panel : fig.panels) n += panel.series.size();
  std::cout << "wrote " << out << " (" << a.format << ", " << n << " series"
            << (fig.panels.empty() ? "" : ", " + std::to_string(fig.panels.size()) + " panels") << ") from " << runs.size()
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
      CLI::App* fig = app.add_subcommand("figure", "Draw a paper figure from the registry")
                          ->footer(
                              "Colour names the architecture (the same in every figure), line style the optimiser\n"
                              "(Muon solid, AdamW dashed) or CCQ (dashed), shade and marker the stack (hybrid ●,\n"
                              "pure ▲ darker, dense ■); the paper's values are open markers; seeds are a band\n"
                              "(mean ± std). Figures: laa/fig3 laa/fig4 laa/fig5 laa/fig6 laa/frontier ccq/fig3\n"
                              "ccq/fig4 ccq/fig3_4 ccq/fig5 carve/table3 (--list shows their tables).\n"
                              "Example: lar export figure laa/fig4 --format png --scale smoke");
      fig->add_option("name", a->name, "figure name (lar export figure --list)");
      fig->add_option("--format", a->format, "svg | png | pdf")->check(CLI::IsMember({"svg", "png", "pdf"}));
      fig->add_option("-o,--out", a->out, "output file (default: <name>.<format>, '/' → '_')");
      fig->add_option("--scale", a->scale, "scale the runs were made at (default: the spec's)");
      fig->add_option("--seeds", a->seeds, "seeds per cell the reproduction used")->check(CLI::NonNegativeNumber);
      fig->add_option("--smooth", a->smooth,
                      "EMA factor for training-loss curves, in [0, 1) (default 1 − 20/points, at most 0.95; 0: raw); the raw curve stays faint behind");
      auto* grid = fig->add_flag("--grid", a->grid, "small multiples: laa/fig3 one panel per mixer (laa/fig4 is 2 × 5 panels by default)");
      fig->add_flag("--no-grid", a->no_grid, "one panel (laa/fig4: all 40 curves together)")->excludes(grid);
      fig->add_flag("--list", a->list, "list the figures");
      return [a] { return run_export(*a); };
    }};
