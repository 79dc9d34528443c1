// A test-only stand-in for `lar train --run-dir D` that speaks the run-directory protocol
// (docs/protocol.md), so the runner can be tested end to end without the real trainer.
// Never installed; the product has no fake trainer.
//
// Usage: fake_trainer [train] --run-dir D
// Reads D/config.json; its config's `budget.steps` (default 5) and a `fake` map steer it:
//   step_ms            sleep per step (default 20)
//   fail_at_step       write status failed, exit 1
//   crash_at_step      die by SIGKILL without writing a final status
//   exit_at_step       {"step": s, "code": c}: exit with code c, no final status
//   preempt_at_step    write status preempted, exit 3
//   hang               never finish; only SIGTERM ends it (→ preempted, exit 3)
//   only_on_attempt    the fail/crash/exit/preempt options apply on this attempt only
// Or LAR_FAKE_TRAINER_OPTIONS (JSON: cell id or "*" → options), for CLI tests.
// A resumed run (an existing status) continues from status.step, as if from a checkpoint.
// SIGTERM, SIGUSR2 (Slurm's time-limit warning): finish the current step, write
// preempted, exit 3 (like the real trainer).
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>

#include "core/error.hpp"
#include "core/run_dir.hpp"

using namespace lar;

static volatile sig_atomic_t g_term = 0;  // the signal that asked us to stop
static void on_term(int sig) { g_term = sig; }

int main(int argc, char** argv) {
  std::string dir;
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "--run-dir" && i + 1 < argc) dir = argv[++i];
  if (dir.empty()) {
    std::cerr << "fake_trainer: --run-dir D is required\n";
    return 2;
  }
  struct sigaction sa {};
  sa.sa_handler = on_term;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGUSR2, &sa, nullptr);

  RunDir rd(dir);
  json cfg;
  try {
    cfg = rd.read_config().at("config");
  } catch (const std::exception& e) {
    std::cerr << "fake_trainer: bad config: " << e.what() << "\n";
    return 2;
  }
  long steps = cfg.contains("budget") ? cfg["budget"].value("steps", 5L) : 5L;
  json fake = cfg.value("fake", json::object());
  // Specs checked by `lar launch` cannot carry unknown keys: CLI tests steer the fake
  // trainer through LAR_FAKE_TRAINER_OPTIONS = {"<cell id>" or "*": {options}} instead.
  if (const char* env = std::getenv("LAR_FAKE_TRAINER_OPTIONS")) {
    json all = json::parse(env);
    std::string id = rd.read_config().value("cell_id", std::string());
    for (const char* key : {"*", id.c_str()})
      if (all.contains(key))
        for (auto& [k, v] : all[key].items()) fake[k] = v;
  }
  long step_ms = fake.value("step_ms", 20L);
  bool hang = fake.value("hang", false);

  RunStatus s = rd.read_status().value_or(RunStatus{});
  if (s.state == RunState::completed) return 0;
  s.attempt += 1;
  int only = fake.value("only_on_attempt", 0);
  bool faults = only == 0 || only == s.attempt;
  long start = s.step;  // "resume from the last checkpoint"
  MetricsWriter::truncate_after(rd.metrics_path(), start);
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  s.host = host;
  s.pid = ::getpid();
  s.total_steps = steps;
  s.started_at = unix_now();
  rd.transition(s, RunState::running);
  std::cout << "fake_trainer: attempt " << s.attempt << " from step " << start << std::endl;

  auto at = [&](const char* key, long step) { return faults && fake.contains(key) && fake[key] == step; };
  MetricsWriter metrics(rd.metrics_path());
  for (long step = start + 1; step <= steps || hang; ++step) {
    // Sleep in small slices so that SIGTERM is noticed promptly.
    for (long t = 0; t < step_ms && !g_term; t += 5) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (g_term) {
      rd.transition(s, RunState::preempted, g_term == SIGUSR2 ? "SIGUSR2" : "SIGTERM");
      std::cout << "fake_trainer: preempted at step " << s.step << std::endl;
      return 3;
    }
    if (hang) continue;
    double loss = 10.0 / static_cast<double>(step + 1);
    metrics.append({{"step", step}, {"tokens", step * 1024}, {"wall_time", unix_now()}, {"loss", loss}});
    s.step = step;
    s.updated_at = unix_now();
    rd.write_status(s);
    if (at("fail_at_step", step)) {
      rd.transition(s, RunState::failed, "fake failure at step " + std::to_string(step));
      return 1;
    }
    if (at("crash_at_step", step)) ::kill(::getpid(), SIGKILL);
    if (faults && fake.contains("exit_at_step") && fake["exit_at_step"].value("step", -1L) == step)
      return fake["exit_at_step"].value("code", 1);
    if (at("preempt_at_step", step)) {
      rd.transition(s, RunState::preempted, "fake preemption");
      return 3;
    }
  }
  s.summary = {{"final_loss", 10.0 / static_cast<double>(steps + 1)}};
  rd.transition(s, RunState::completed);
  return 0;
}
