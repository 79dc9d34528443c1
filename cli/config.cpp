// `lar config` — print the run-config schema: every key, its type, default and meaning.
#include <iostream>

#include "cli/command.hpp"
#include "core/config_schema.hpp"

static lar::cli::CommandRegistration reg{
    "config", "Print every run-config key with its type, default and meaning", 90,
    [](CLI::App&) -> lar::cli::Runner {
      return [] {
        std::cout << lar::describe_schema();
        return 0;
      };
    }};
