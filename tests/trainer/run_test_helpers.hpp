#pragma once
// Shared by the trainer and data-parallel tests: a run directory from a bare config, and
// its metric lines without the wall-clock and memory fields (those differ between runs by
// design).
#include <filesystem>
#include <string>
#include <vector>

#include "core/json.hpp"
#include "core/run_dir.hpp"

namespace lar::test {

inline void write_run(const std::filesystem::path& dir, const json& config) {
  RunDir(dir).write_config({{"experiment", "test"}, {"cell_id", "c"}, {"hash", "h"}, {"axes", json::object()},
                            {"role", "main"}, {"baseline", nullptr}, {"config", config}});
}

inline std::vector<std::string> metric_values(const std::filesystem::path& dir) {
  std::vector<std::string> out;
  for (auto l : read_metrics(RunDir(dir).metrics_path()).lines) {
    for (const char* k : {"wall_time", "tokens_per_s", "iter_time", "peak_mem_mb", "gpu_peak_mem_mb"}) l.erase(k);
    out.push_back(l.dump());
  }
  return out;
}

}  // namespace lar::test
