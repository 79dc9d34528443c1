#pragma once
// Test helpers: temp folders and hand-written run directories (docs/protocol.md).
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "core/fs.hpp"
#include "core/json.hpp"
#include "core/run_dir.hpp"

namespace regtest {

namespace fs = std::filesystem;
using lar::json;

inline fs::path temp_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("lar_regtest_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// runs_root/<exp>/<cell>/config.json
inline fs::path make_run(const fs::path& runs_root, const std::string& exp, const std::string& cell,
                         json axes = json::object(), json config = json::object(),
                         const std::string& role = "main", const std::string& baseline = "") {
  fs::path d = runs_root / exp / cell;
  fs::create_directories(d);
  json c = {{"experiment", exp}, {"cell_id", cell}, {"hash", "h_" + exp + "_" + cell},
            {"axes", axes},      {"role", role},    {"baseline", baseline.empty() ? json() : json(baseline)},
            {"config", config}};
  lar::RunDir(d).write_config(c);
  return d;
}

inline void write_status(const fs::path& d, lar::RunState state, long step, long total,
                         json summary = json::object(), int attempt = 1) {
  lar::RunDir rd(d);
  lar::RunStatus s = rd.read_status().value_or(lar::RunStatus{});
  s.step = step;
  s.total_steps = total;
  s.attempt = attempt;
  s.summary = summary;
  rd.transition(s, state, state == lar::RunState::failed ? "boom" : "");
}

// Appends train lines for steps [from, to): each line holds `loss` and `lr` (2 metric rows).
inline void append_train_lines(const fs::path& d, long from, long to) {
  lar::MetricsWriter w(d / "metrics.jsonl");
  for (long s = from; s < to; ++s)
    w.append({{"step", s}, {"tokens", s * 1024}, {"wall_time", 0.5 * s}, {"loss", 10.0 - 0.01 * s}, {"lr", 1e-3}});
}

inline void append_raw(const fs::path& file, const std::string& bytes) {
  std::ofstream out(file, std::ios::app | std::ios::binary);
  out << bytes;
}

}  // namespace regtest
