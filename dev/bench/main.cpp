// `lar-bench` — the benchmarks of lar, a program beside `lar` (built from dev/bench/). Each
// benchmark lives in its own file and registers itself through lar::bench::Registration.
#include <algorithm>
#include <iostream>
#include <memory>

#include "core/error.hpp"
#include "dev/bench/bench.hpp"

namespace lar::bench {

std::vector<Benchmark>& benchmarks() {
  static std::vector<Benchmark> table;
  return table;
}

}  // namespace lar::bench

int main(int argc, char** argv) {
  using namespace lar;
  CLI::App app{
      "lar-bench — the benchmarks of lar (plan expansion, registry, dashboard, CPU training,\n"
      "CUDA kernels and training). Each prints what it measured beside its goal, and beside\n"
      "an anchor only where the anchor was measured in the same call (an input file).\n"
      "Results and the commands behind them: docs/perf.md."};
  app.require_subcommand(1);
  auto& table = bench::benchmarks();
  std::sort(table.begin(), table.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  std::vector<std::pair<CLI::App*, bench::Runner>> runners;
  for (auto& b : table) {
    CLI::App* sub = app.add_subcommand(b.name, b.summary);
    runners.emplace_back(sub, b.setup(*sub));
  }

  // CLI11 reports an unknown subcommand as a missing one; name the benchmark that was asked for.
  if (argc > 1 && argv[1][0] != '-' &&
      std::none_of(table.begin(), table.end(), [&](const auto& b) { return b.name == argv[1]; })) {
    std::cerr << "lar-bench: unknown benchmark '" << argv[1] << "' (lar-bench --help lists them)\n";
    return kExitUser;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return kExitUser;
  }

  try {
    for (auto& [sub, run] : runners)
      if (sub->parsed()) return run();
  } catch (const UserError& e) {
    std::cerr << "lar-bench: " << e.what() << "\n";
    return kExitUser;
  } catch (const RuntimeError& e) {
    std::cerr << "lar-bench: error: " << e.what() << "\n";
    return kExitRuntime;
  } catch (const std::exception& e) {
    std::cerr << "lar-bench: internal error: " << e.what() << "\n";
    return kExitRuntime;
  }
  return kExitUser;
}
