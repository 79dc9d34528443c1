#pragma once
// Subcommands register themselves: each cli/<name>.cpp defines one static
// `CommandRegistration`, so adding a subcommand never touches main.cpp.
//
//   static lar::cli::CommandRegistration reg{"plan", "Print the cells of a spec", 20,
//     [](CLI::App& app) -> lar::cli::Runner {
//       auto opts = std::make_shared<PlanOptions>();
//       app.add_option("spec", opts->spec, "...")->required();
//       return [opts] { return run_plan(*opts); };   // returns the exit code
//     }};
//
// Throw lar::UserError for user mistakes (exit 2), lar::RuntimeError for faults (exit 1).
#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

namespace lar::cli {

using Runner = std::function<int()>;
using Setup = std::function<Runner(CLI::App&)>;

struct CommandInfo {
  std::string name;
  std::string summary;
  int order;  // position in `lar --help`
  Setup setup;
};

std::vector<CommandInfo>& command_table();

struct CommandRegistration {
  CommandRegistration(std::string name, std::string summary, int order, Setup setup) {
    command_table().push_back({std::move(name), std::move(summary), order, std::move(setup)});
  }
};

// True when stdout is a terminal (live displays, colours, progress lines).
bool stdout_is_tty();

}  // namespace lar::cli
