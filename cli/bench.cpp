// `lar bench` — the benchmarks; each lives beside the code it measures and registers
// itself through BenchRegistration.
#include "cli/bench.hpp"

#include <algorithm>

namespace lar::cli {

std::vector<CommandInfo>& bench_table() {
  static std::vector<CommandInfo> table;
  return table;
}

}  // namespace lar::cli

static lar::cli::CommandRegistration reg{
    "bench", "Run a benchmark (lar bench --help lists them)", 80,
    [](CLI::App& app) -> lar::cli::Runner {
      using namespace lar::cli;
      app.require_subcommand(1);
      auto& table = bench_table();
      std::sort(table.begin(), table.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
      auto runners = std::make_shared<std::vector<std::pair<CLI::App*, Runner>>>();
      for (auto& b : table) {
        CLI::App* sub = app.add_subcommand(b.name, b.summary);
        runners->emplace_back(sub, b.setup(*sub));
      }
      return [runners] {
        for (auto& [sub, run] : *runners)
          if (sub->parsed()) return run();
        return 2;
      };
    }};
