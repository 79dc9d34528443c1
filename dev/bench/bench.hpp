#pragma once
// `lar-bench <name>`: benchmarks are programs, not timed unit tests, and not part of the `lar`
// binary. Each benchmark registers itself:
//   static lar::bench::Registration reg{"plan", "Expand a 100,000-cell matrix",
//     [](CLI::App& app) -> lar::bench::Runner { ...; return [opts] { ...; return 0; }; }};
// A benchmark prints a table: what was measured, our number, and beside it the goal or an
// anchor measured in the same call (an anchor from elsewhere is an input file, never a constant).
//
// Throw lar::UserError for a bad option (exit 2), lar::RuntimeError for a fault (exit 1).
#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

namespace lar::bench {

using Runner = std::function<int()>;
using Setup = std::function<Runner(CLI::App&)>;

struct Benchmark {
  std::string name;
  std::string summary;
  Setup setup;
};

std::vector<Benchmark>& benchmarks();

struct Registration {
  Registration(std::string name, std::string summary, Setup setup) {
    benchmarks().push_back({std::move(name), std::move(summary), std::move(setup)});
  }
};

}  // namespace lar::bench
