// `lar audit PAPER/TABLE` — which runs count for each cell and why not, agreement with the
// paper, the paper's own inconsistencies. --strict: exit 1 when a main cell fails.
#include <iostream>
#include <memory>

#include "cli/command.hpp"
#include "core/paths.hpp"
#include "registry/report/adapter.hpp"
#include "registry/report/render.hpp"

namespace {

struct AuditArgs {
  std::string table;
  std::string format = "md";
  std::string scale;
  int seeds = 0;
  bool strict = false;
};

int run_audit(const AuditArgs& a) {
  using namespace lar;
  auto p = report::paper_report(a.table, a.scale, a.seeds, default_db_path());
  std::cout << report::render_audit(p.report, a.format);
  const auto failed = p.report.failed_main_rows();
  if (a.strict && !failed.empty()) {
    std::cerr << "lar audit --strict: " << failed.size() << " main cell(s) fail\n";
    return 1;
  }
  return 0;
}

}  // namespace

static lar::cli::CommandRegistration reg{
    "audit", "Audit a paper table: included/excluded runs and why, agreement with the paper", 61,
    [](CLI::App& app) -> lar::cli::Runner {
      auto a = std::make_shared<AuditArgs>();
      app.add_option("table", a->table, "paper table, e.g. laa/table2 (or a spec .yaml)")->required();
      app.add_option("--format", a->format, "md | json")->check(CLI::IsMember({"md", "json"}));
      app.add_option("--scale", a->scale, "scale the runs were made at (default: the spec's)");
      app.add_option("--seeds", a->seeds, "seeds per cell the reproduction used (default: the spec's)")
          ->check(CLI::NonNegativeNumber);
      app.add_flag("--strict", a->strict, "exit 1 when a main cell fails (no included run, unmatched baseline)");
      app.footer("Exclusion reasons: schedule not completed, diverged, not the final checkpoint, a\n"
                 "required field missing (LAA App. B), config differs from the spec, superseded.\n"
                 "See docs/reproduce.md.");
      return [a] { return run_audit(*a); };
    }};
