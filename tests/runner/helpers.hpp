#pragma once
// Shared by the runner tests: a temporary $LAR_HOME and hand-built plans whose cells run
// the test-only fake trainer (tests/runner/fake_trainer.cpp).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "core/hash.hpp"
#include "core/json.hpp"
#include "core/paths.hpp"
#include "experiments/cell.hpp"

namespace lar::runner::test {

namespace fs = std::filesystem;

// Sets LAR_HOME to a fresh temporary folder for the lifetime of the object.
struct TempHome {
  fs::path dir;
  explicit TempHome(const std::string& name) {
    dir = fs::temp_directory_path() / ("lar_runner_" + name + "_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
    ::setenv("LAR_HOME", dir.c_str(), 1);
  }
  ~TempHome() {
    ::unsetenv("LAR_HOME");
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

inline experiments::Cell make_cell(const std::string& experiment, const std::string& id, json config) {
  experiments::Cell c;
  c.experiment = experiment;
  c.id = id;
  c.config = std::move(config);
  c.hash = sha256_hex(canonical_dump(c.config));
  c.axes = {{"seed", json(0)}};
  return c;
}

// n cells "c0".."c<n-1>", `steps` steps of `step_ms` each; fake options per cell id.
inline experiments::Plan make_plan(const std::string& experiment, int n, long steps = 5, long step_ms = 20,
                                   const std::map<std::string, json>& fake = {}) {
  experiments::Plan p;
  p.experiment = experiment;
  for (int i = 0; i < n; ++i) {
    std::string id = "c" + std::to_string(i);
    json cfg = {{"backend", "cpu"}, {"seed", i}, {"budget", {{"steps", steps}}}, {"fake", {{"step_ms", step_ms}}}};
    if (auto it = fake.find(id); it != fake.end())
      for (auto& [k, v] : it->second.items()) cfg["fake"][k] = v;
    p.cells.push_back(make_cell(experiment, id, cfg));
  }
  return p;
}

inline std::vector<json> read_jsonl(const fs::path& path) {
  std::vector<json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) out.push_back(json::parse(line));
  return out;
}

}  // namespace lar::runner::test
