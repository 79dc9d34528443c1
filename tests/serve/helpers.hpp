#pragma once
// Test helpers for lar serve: a small registry of hand-written run directories, and a
// `lar serve` process on a random loopback port.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>

#include "core/json.hpp"
#include "core/run_dir.hpp"
#include "registry/registry.hpp"
#include "tests/runner/lar_process.hpp"

namespace servetest {

namespace fs = std::filesystem;
using lar::json;

inline fs::path temp_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("lar_servetest_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

inline std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// One run directory: config (with axes), status, `steps` train lines (loss = 10 - 0.01 step,
// lr = 1e-3, tokens_per_s = 1000 + step).
inline fs::path make_run(const fs::path& runs, const std::string& exp, const std::string& cell, const json& axes,
                         lar::RunState state, long steps, long total, const std::string& reason = "") {
  fs::path d = runs / exp / cell;
  fs::create_directories(d);
  json config = {{"model", {{"architecture", axes.value("architecture", "gdn")}, {"d_model", 64}}},
                 {"optimizer", {{"lr", axes.value("lr", 1e-3)}}},
                 {"seed", axes.value("seed", 0)}};
  lar::RunDir rd(d);
  rd.write_config({{"experiment", exp}, {"cell_id", cell}, {"hash", "h_" + cell}, {"axes", axes}, {"role", "main"},
                   {"baseline", nullptr}, {"config", config}});
  lar::RunStatus s;
  s.step = steps;
  s.total_steps = total;
  s.attempt = 1;
  if (state == lar::RunState::completed) s.summary = {{"final_loss", 10.0 - 0.01 * static_cast<double>(steps)}};
  rd.transition(s, lar::RunState::running, "");
  s = *rd.read_status();
  if (state != lar::RunState::running) rd.transition(s, state, reason);
  lar::MetricsWriter w(d / "metrics.jsonl");
  for (long i = 0; i < steps; ++i)
    w.append({{"step", i}, {"tokens", i * 1024}, {"wall_time", 0.5 * static_cast<double>(i)},
              {"loss", 10.0 - 0.01 * static_cast<double>(i)}, {"lr", 1e-3}, {"tokens_per_s", 1000.0 + static_cast<double>(i)}});
  return d;
}

// A `lar serve` process on a free loopback port, stopped (SIGTERM) on destruction.
class ServeProcess {
 public:
  ServeProcess(const fs::path& db, const fs::path& log, std::vector<std::string> extra = {}) : log_(log) {
    std::vector<std::string> args = {"serve", "--db", db.string(), "--port", "0"};
    args.insert(args.end(), extra.begin(), extra.end());
    pid_ = lar::test::spawn_lar(args, log);
    // The server prints "lar serve: http://127.0.0.1:PORT/ …" once it listens.
    const std::regex url_re(R"(lar serve: http://[^:]+:(\d+)/)");
    for (int i = 0; i < 600 && port_ == 0; ++i) {  // up to 30 s on a loaded machine
      std::smatch m;
      const std::string text = read_file(log_);
      if (std::regex_search(text, m, url_re)) port_ = std::stoi(m[1]);
      else std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  ~ServeProcess() { stop(); }
  int port() const { return port_; }
  std::string url(const std::string& path = "/") const { return "http://127.0.0.1:" + std::to_string(port_) + path; }
  std::string log() const { return read_file(log_); }
  int stop() {
    if (pid_ <= 0) return exit_;
    ::kill(pid_, SIGTERM);
    exit_ = lar::test::wait_exit(pid_);
    pid_ = 0;
    return exit_;
  }

 private:
  fs::path log_;
  pid_t pid_ = 0;
  int port_ = 0;
  int exit_ = -1;
};

// The registry most tests use: experiment "alpha" (3 runs: completed gdn, completed
// deltanet, running gdn) and "beta" (one failed run whose reason holds markup).
inline fs::path make_registry(const fs::path& home) {
  const fs::path runs = home / "runs";
  make_run(runs, "alpha", "gdn.s0", {{"architecture", "gdn"}, {"seed", 0}}, lar::RunState::completed, 50, 50);
  make_run(runs, "alpha", "deltanet.s0", {{"architecture", "deltanet"}, {"seed", 0}}, lar::RunState::completed, 40, 40);
  make_run(runs, "alpha", "gdn.s1", {{"architecture", "gdn"}, {"seed", 1}}, lar::RunState::running, 20, 50);
  make_run(runs, "beta", "evil.s0", {{"architecture", "<script>alert(1)</script>"}, {"seed", 0}}, lar::RunState::failed, 5, 30,
           "<img src=x onerror=alert(2)>");
  const fs::path db = home / "lar.db";
  auto reg = lar::registry::Registry::open(db);
  reg.sync(runs);
  return db;
}

}  // namespace servetest
