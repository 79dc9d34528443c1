// The `lar` binary: a thin dispatcher. Each subcommand lives in its own file (see
// command.hpp); the logic lives in the module folders.
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <iostream>

#include "cli/command.hpp"
#include "core/error.hpp"

namespace lar::cli {

std::vector<CommandInfo>& command_table() {
  static std::vector<CommandInfo> table;
  return table;
}

bool stdout_is_tty() { return ::isatty(STDOUT_FILENO) == 1; }

}  // namespace lar::cli

int main(int argc, char** argv) {
  using namespace lar;
  CLI::App app{
      "lar — reproduce linear-attention papers with one command.\n"
      "Plans experiment matrices, trains every cell with its own trainer (CPU or CUDA),\n"
      "locally or on Slurm, records runs in SQLite and renders audited paper tables.\n"
      "Start with: lar reproduce laa/table2 --scale smoke"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("lar 0.1.0"));

  auto& table = cli::command_table();
  std::stable_sort(table.begin(), table.end(),
                   [](const auto& a, const auto& b) { return a.order < b.order; });
  std::vector<std::pair<CLI::App*, cli::Runner>> runners;
  for (auto& cmd : table) {
    CLI::App* sub = app.add_subcommand(cmd.name, cmd.summary);
    runners.emplace_back(sub, cmd.setup(*sub));
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return kExitUser;
  }

  try {
    for (auto& [sub, run] : runners)
      if (sub->parsed()) return run();
  } catch (const UserError& e) {
    std::cerr << "lar: " << e.what() << "\n";
    return kExitUser;
  } catch (const RuntimeError& e) {
    std::cerr << "lar: error: " << e.what() << "\n";
    return kExitRuntime;
  } catch (const std::exception& e) {
    std::cerr << "lar: internal error: " << e.what() << "\n";
    return kExitRuntime;
  }
  return kExitUser;
}
