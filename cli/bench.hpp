#pragma once
// `lar bench <name>`: benchmarks are programs, not timed unit tests. Each benchmark
// registers itself like a subcommand:
//   static lar::cli::BenchRegistration reg{"plan", "Expand a 100,000-cell matrix",
//     [](CLI::App& app) -> lar::cli::Runner { ...; return [opts] { ...; return 0; }; }};
// A benchmark prints a table: what was measured, our number, the goal or anchor beside it.
#include "cli/command.hpp"

namespace lar::cli {
std::vector<CommandInfo>& bench_table();
struct BenchRegistration {
  BenchRegistration(std::string name, std::string summary, Setup setup) {
    bench_table().push_back({std::move(name), std::move(summary), 0, std::move(setup)});
  }
};
}  // namespace lar::cli
