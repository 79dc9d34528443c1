#pragma once
// Keeps the SQLite registry in step with a launch: register the plan's cells before any
// start, sync each run directory when its child exits, sync every cell at the end.
// The run directories stay the source of truth: a registry failure is reported through
// `warn` and never stops the runs (`lar sync` repairs the index later).
#include <filesystem>
#include <functional>
#include <string>

#include "runner/launch.hpp"

namespace lar::runner {

LaunchHooks registry_hooks(const std::filesystem::path& db_path,
                           std::function<void(const std::string&)> warn);

}  // namespace lar::runner
