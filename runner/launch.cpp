#include "runner/launch.hpp"

#include <signal.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>

#include "core/error.hpp"
#include "core/paths.hpp"
#include "runner/devices.hpp"
#include "runner/local_executor.hpp"

namespace lar::runner {

namespace {

std::atomic<int> g_stop_requests{0};
static_assert(std::atomic<int>::is_always_lock_free, "used from a signal handler");

void on_stop_signal(int) { g_stop_requests.fetch_add(1); }

// Installs SIGINT/SIGTERM handlers for the lifetime of a launch and restores the previous
// ones afterwards (so `lar reproduce` can go on to render tables after a launch).
class ScopedStopSignals {
 public:
  explicit ScopedStopSignals(bool enable) : enabled_(enable) {
    if (!enabled_) return;
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = 0;
    ::sigaction(SIGINT, &sa, &old_int_);
    ::sigaction(SIGTERM, &sa, &old_term_);
  }
  ~ScopedStopSignals() {
    if (!enabled_) return;
    ::sigaction(SIGINT, &old_int_, nullptr);
    ::sigaction(SIGTERM, &old_term_, nullptr);
  }

 private:
  bool enabled_;
  struct sigaction old_int_ {}, old_term_ {};
};

std::unique_ptr<Executor> make_executor(const experiments::Plan& plan, const LaunchOptions& o) {
  if (o.executor == "local") {
    LocalOptions lo;
    lo.parallelism = o.jobs > 0 ? o.jobs : default_parallelism(plan);
    lo.trainer_cmd = o.trainer_cmd.empty() ? default_trainer_cmd() : o.trainer_cmd;
    bool gpu_present = !visible_gpus().empty();
    bool gpu = std::any_of(plan.cells.begin(), plan.cells.end(),
                           [&](const auto& c) { return uses_gpu(c, gpu_present); });
    if (gpu) lo.gpus = gpu_slots(lo.parallelism);
    return std::make_unique<LocalExecutor>(lo);
  }
  if (o.executor == "slurm") return std::make_unique<SlurmExecutor>(plan.experiment, o.slurm);
  throw UserError("unknown executor '" + o.executor + "' (available: local, slurm)");
}

RunState state_of(const std::optional<RunStatus>& s) { return s ? s->state : RunState::pending; }

}  // namespace

void request_stop() { g_stop_requests.fetch_add(1); }

void LaunchSummary::recount() {
  total = static_cast<int>(cells.size());
  completed = skipped = failed = diverged = stopped = pending = 0;
  for (const auto& c : cells) {
    if (c.action == CellAction::skip_completed) ++skipped;
    switch (c.state) {
      case RunState::completed: ++completed; break;
      case RunState::failed: ++failed; break;
      case RunState::diverged: ++diverged; break;
      case RunState::pending: ++pending; break;
      case RunState::running: ++pending; break;  // owned by another process
      default: ++stopped; break;
    }
  }
}

LaunchSummary launch(const experiments::Plan& plan, const LaunchOptions& options,
                     const ProgressCallback& progress) {
  LaunchSummary summary;
  summary.experiment = plan.experiment;
  summary.dry_run = options.dry_run;
  using Kind = ProgressEvent::Kind;
  auto emit = [&](Kind kind, const std::string& cell_id, RunState state, const std::string& message,
                  const Executor* ex = nullptr) {
    if (!progress) return;
    ProgressEvent ev;
    ev.kind = kind;
    ev.cell_id = cell_id;
    ev.state = state;
    ev.message = message;
    ev.summary = &summary;
    if (ex) {
      ev.running = ex->running();
      ev.queued = ex->queued();
    }
    progress(ev);
  };

  // Validate the executor choice before touching anything.
  std::unique_ptr<Executor> executor;
  if (!options.dry_run) executor = make_executor(plan, options);
  else if (options.executor != "local" && options.executor != "slurm")
    throw UserError("unknown executor '" + options.executor + "' (available: local, slurm)");

  std::unique_ptr<LaunchLock> lock;
  if (!options.dry_run) lock = std::make_unique<LaunchLock>(plan.experiment);

  std::vector<CellPlan> cells;
  for (const auto& cell : plan.cells) cells.push_back(classify_cell(cell, run_dir_for(plan.experiment, cell.id)));

  for (const auto& cp : cells) {
    CellOutcome o;
    o.cell_id = cp.cell->id;
    o.run_dir = cp.run_dir;
    o.action = cp.action;
    o.state = cp.hash_changed ? RunState::pending : state_of(cp.prior);
    o.attempt = cp.prior && !cp.hash_changed ? cp.prior->attempt : 0;
    o.reason = cp.prior && !cp.hash_changed ? cp.prior->reason : "";
    if (cp.action == CellAction::start_new || cp.action == CellAction::resume) o.state = RunState::pending;
    summary.cells.push_back(o);
  }
  summary.recount();
  for (const auto& cp : cells) {
    std::string msg = to_string(cp.action) + (cp.detail.empty() ? "" : ": " + cp.detail);
    emit(Kind::planned, cp.cell->id, RunState::pending, msg);
  }
  if (options.dry_run) return summary;

  ScopedStopSignals signals(options.handle_signals);
  g_stop_requests.store(0);

  const bool gpu_present = !visible_gpus().empty();
  std::vector<Job> jobs;
  std::map<std::string, size_t> index;        // cell id → position in summary.cells
  std::map<std::string, int> attempt_before;  // cell id → status.attempt before its start
  for (size_t i = 0; i < cells.size(); ++i) {
    const CellPlan& cp = cells[i];
    index[cp.cell->id] = i;
    if (cp.action == CellAction::skip_running)
      emit(Kind::note, cp.cell->id, RunState::pending, "not started: " + cp.detail);
    if (cp.rekeyed && cp.action != CellAction::skip_running) {
      RunDir(cp.run_dir).write_config(cp.cell->run_config_json());
      emit(Kind::note, cp.cell->id, RunState::pending,
           "config hash re-keyed (the schema gained keys at their defaults); the run is kept");
    }
    if (cp.action != CellAction::start_new && cp.action != CellAction::resume) continue;
    if (auto moved = prepare_run_dir(cp))
      emit(Kind::note, cp.cell->id, RunState::pending, cp.detail + "; the old run dir was moved aside to " + moved->string());
    attempt_before[cp.cell->id] = cp.prior && !cp.hash_changed ? cp.prior->attempt : 0;
    bool gpu = uses_gpu(*cp.cell, gpu_present);
    jobs.push_back({plan.experiment, cp.cell->id, cp.run_dir, gpu});
  }
  if (options.hooks.before_start) options.hooks.before_start(plan);

  using clock = std::chrono::steady_clock;
  int stops_seen = 0;
  bool forced = false;
  clock::time_point stop_deadline{};
  if (g_stop_requests.load() == 0) executor->submit(jobs);
  else summary.interrupted = true;
  auto next_tick = clock::now();

  while (!executor->idle()) {
    int stops = g_stop_requests.load();
    if (stops > stops_seen) {
      if (stops_seen == 0) {
        summary.interrupted = true;
        executor->stop(false);
        stop_deadline = clock::now() + std::chrono::milliseconds(static_cast<long>(options.stop_grace_s * 1000));
        std::string how = executor->name() == "slurm" ? "scancelled the launch's jobs; Slurm sent SIGTERM to "
                                                      : "sent SIGTERM to ";
        emit(Kind::stopping, "", RunState::pending, "stopping: " + how + std::to_string(executor->running()) +
                         " running cell(s), waiting for their checkpoints (again to kill them now)", executor.get());
      } else if (!forced) {
        forced = true;
        executor->stop(true);
        emit(Kind::stopping, "", RunState::pending, "killing running cells (SIGKILL)", executor.get());
      }
      stops_seen = stops;
    }
    if (stops_seen > 0 && !forced && clock::now() > stop_deadline) {
      forced = true;
      executor->stop(true);
      emit(Kind::stopping, "", RunState::pending, "cells still running after the grace period: killing them (SIGKILL)", executor.get());
    }

    PollResult r = executor->poll(std::chrono::milliseconds(100));
    for (const auto& n : r.notes) emit(Kind::note, "", RunState::pending, n, executor.get());
    // Exits first: a start in the same poll usually took the slot an exit freed.
    for (const auto& e : r.exited) {
      Settled st = settle_after_exit(e, attempt_before[e.job.cell_id]);
      if (!e.never_started) append_attempt_record(e, st, executor->name());
      CellOutcome& o = summary.cells[index[e.job.cell_id]];
      o.state = st.state;
      o.reason = st.reason;
      o.attempt = st.attempt;
      summary.recount();
      if (options.hooks.after_cell) options.hooks.after_cell(o);
      emit(Kind::finished, o.cell_id, o.state, o.reason, executor.get());
    }
    for (const auto& s : r.started) {
      CellOutcome& o = summary.cells[index[s.job.cell_id]];
      o.state = RunState::running;
      o.started = true;
      emit(Kind::started, s.job.cell_id, RunState::running, s.where, executor.get());
    }
    if (!r.started.empty()) summary.recount();
    if (clock::now() >= next_tick) {
      next_tick = clock::now() + std::chrono::milliseconds(static_cast<long>(options.tick_s * 1000));
      emit(Kind::tick, "", RunState::pending, "", executor.get());
    }
  }
  summary.recount();
  if (auto* slurm = dynamic_cast<SlurmExecutor*>(executor.get())) summary.followup = slurm->followup();
  if (options.hooks.at_end) options.hooks.at_end(summary);
  return summary;
}

}  // namespace lar::runner
