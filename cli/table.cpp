// `lar table PAPER/TABLE` — the reproduced paper table beside the published one, from the
// registry (our values: mean ± std over seeds; deltas against matched baselines).
#include <fstream>
#include <iostream>
#include <memory>

#include "cli/command.hpp"
#include "core/error.hpp"
#include "core/paths.hpp"
#include "registry/report/adapter.hpp"
#include "registry/report/render.hpp"

namespace {

struct TableArgs {
  std::string table;
  std::string format = "md";
  std::string scale;
  int seeds = 0;
  std::string out;
};

int run_table(const TableArgs& a) {
  using namespace lar;
  auto p = report::paper_report(a.table, a.scale, a.seeds, default_db_path());
  const std::string text = report::render_table(p.report, a.format);
  if (a.out.empty()) {
    std::cout << text;
    return 0;
  }
  std::ofstream f(a.out, std::ios::trunc);
  f << text;
  if (!f) throw RuntimeError("cannot write " + a.out);
  std::cerr << "wrote " << a.out << "\n";
  return 0;
}

}  // namespace

static lar::cli::CommandRegistration reg{
    "table", "Render a paper table: our values beside the published ones", 60,
    [](CLI::App& app) -> lar::cli::Runner {
      auto a = std::make_shared<TableArgs>();
      app.add_option("table", a->table, "paper table, e.g. laa/table2 (or a spec .yaml)")->required();
      app.add_option("--format", a->format, "md | latex | csv | json")
          ->check(CLI::IsMember({"md", "latex", "csv", "json"}));
      app.add_option("--scale", a->scale, "scale the runs were made at (default: the spec's)");
      app.add_option("--seeds", a->seeds, "seeds per cell the reproduction used (default: the spec's)")
          ->check(CLI::NonNegativeNumber);
      app.add_option("-o,--out", a->out, "write to FILE instead of stdout");
      app.footer("Runs come from the registry ($LAR_DB or $LAR_HOME/lar.db). Multi-seed cells show\n"
                 "mean ± std (n); deltas carry the standard error and Welch's p when both sides\n"
                 "have ≥ 2 seeds. See docs/reproduce.md.");
      return [a] { return run_table(*a); };
    }};
