// `lar train` — train (or resume) one run directory. Thin: the logic is trainer/train.hpp.
//   lar train --run-dir D                  config from D/config.json (written by the runner)
//   lar train --config FILE --run-dir D    YAML/JSON run config; writes D/config.json first
//   lar train --nproc N --run-dir D        N data-parallel ranks, one per GPU (docs/distributed.md)
// Exit codes: 0 completed, 1 failed, 2 bad config (nothing written), 3 preempted,
// 4 diverged (docs/protocol.md).
//
// A process started by `--nproc` (LAR_RANK/LAR_WORLD_SIZE) or by srun (SLURM_PROCID/
// SLURM_NTASKS in a job step) is one rank: dist/env.hpp.
#include <chrono>
#include <iostream>
#include <thread>

#include "cli/command.hpp"
#include "core/config_hash.hpp"
#include "core/error.hpp"
#include "core/hash.hpp"
#include "core/run_dir.hpp"
#include "dist/env.hpp"
#include "dist/launch.hpp"
#include "runner/slurm_executor.hpp"
#include "trainer/train.hpp"
#ifdef LAR_HAVE_NCCL
#include "dist/nccl_data_parallel.hpp"
#endif

namespace {

struct TrainArgs {
  std::string run_dir, config;
  long stop_after = 0;
  bool no_progress = false;
  int nproc = 1;
};

namespace fs = std::filesystem;

// A rank other than 0 of a launch given --config: rank 0 writes config.json; wait for it.
void wait_for_config(const lar::RunDir& rd) {
  const auto start = std::chrono::steady_clock::now();
  while (!fs::exists(rd.config_path())) {
    if (std::chrono::steady_clock::now() - start > std::chrono::seconds(300))
      throw lar::RuntimeError(rd.config_path().string() + ": rank 0 did not write it within 300 s");
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}


// --nproc N is possible here: NCCL in this build, N GPUs visible. Checked before anything
// is written.
void check_nproc(int nproc) {
#ifndef LAR_HAVE_NCCL
  throw lar::UserError("--nproc " + std::to_string(nproc) +
                       ": this lar was built without NCCL (needs the CUDA backend and NCCL; docs/distributed.md)");
#else
  const int gpus = lar::dist::visible_gpus();
  if (nproc > gpus)
    throw lar::UserError("--nproc " + std::to_string(nproc) + ": only " + std::to_string(gpus) +
                         " GPU(s) visible (one rank per GPU)");
#endif
}

int launch_nproc(const TrainArgs& a, const lar::RunDir& rd) {
#ifndef LAR_HAVE_NCCL
  check_nproc(a.nproc);
  return lar::kExitUser;
#else
  lar::json cfg = lar::trainer::read_run_config(rd.root());
  lar::trainer::check_batch_split(cfg, a.nproc);
  const auto before = rd.read_status();
  lar::dist::LaunchOptions lo;
  lo.nproc = a.nproc;
  lo.argv = {lar::runner::this_executable(), "train", "--run-dir", fs::absolute(rd.root()).string()};
  if (a.no_progress) lo.argv.push_back("--no-progress");
  if (a.stop_after > 0) lo.argv.insert(lo.argv.end(), {"--stop-after", std::to_string(a.stop_after)});
  // Ranks notice a dead peer within LAR_DIST_TIMEOUT; give them that and a margin.
  lo.grace_s = lar::dist::dist_timeout_s() + 15.0;
  lar::dist::LaunchResult res = lar::dist::launch_ranks(lo);
  if (res.exit_code == lar::kExitRuntime) {
    lar::dist::record_launch_failure(rd, before ? before->attempt : 0, res.failure);
    std::cerr << "lar train: " << res.failure << "\n";
  }
  return res.exit_code;
#endif
}

int run_train(const TrainArgs& a) {
  // Who this process is, before anything initialises CUDA.
  const lar::dist::DistEnv env = lar::dist::dist_env();
  if (a.nproc < 1) throw lar::UserError("--nproc " + std::to_string(a.nproc) + ": at least 1");
  if (a.nproc > 1 && env.distributed())
    throw lar::UserError("--nproc inside a rank of a " + std::to_string(env.world) + "-rank launch (" + env.source +
                         "): start the ranks one way only");
  if (a.nproc > 1) check_nproc(a.nproc);
  lar::RunDir rd(a.run_dir);
  if (!a.config.empty() && env.rank > 0) {
    wait_for_config(rd);
  } else if (!a.config.empty()) {
    // Everything is checked before the directory is created.
    lar::json cfg = lar::trainer::prepare_config(lar::trainer::load_config_file(a.config));
    const std::string hash = lar::config_hash(cfg);
    if (fs::exists(rd.config_path())) {
      lar::json old = lar::trainer::read_run_config(rd.root());
      if (lar::config_hash(old) != hash)
        throw lar::UserError(rd.config_path().string() + ": the run directory holds a different config; "
                             "use a new --run-dir, or omit --config to resume it");
    } else {
      fs::create_directories(rd.root());
      rd.write_config({{"experiment", "adhoc"},
                       {"cell_id", fs::absolute(rd.root()).filename().string()},
                       {"hash", hash},
                       {"axes", lar::json::object()},
                       {"role", "main"},
                       {"baseline", nullptr},
                       {"config", cfg}});
    }
  }
  if (a.nproc > 1) return launch_nproc(a, rd);
  lar::trainer::TrainOptions opts;
  opts.progress = !a.no_progress && lar::cli::stdout_is_tty();
  opts.stop_after_steps = a.stop_after;
  if (env.distributed()) {
#ifdef LAR_HAVE_NCCL
    lar::dist::configure_rank(opts, env);
#else
    throw lar::UserError("rank " + std::to_string(env.rank) + " of " + std::to_string(env.world) + " (" + env.source +
                         "): this lar was built without NCCL (docs/distributed.md)");
#endif
  }
  return lar::trainer::train_run(rd.root(), opts);
}

}  // namespace

static lar::cli::CommandRegistration reg{
    "train", "Train (or resume) one run directory", 30, [](CLI::App& app) -> lar::cli::Runner {
      auto a = std::make_shared<TrainArgs>();
      app.add_option("--run-dir", a->run_dir, "run directory (docs/protocol.md)")->required();
      app.add_option("--config", a->config, "YAML or JSON run config; written to RUN_DIR/config.json");
      app.add_flag("--no-progress", a->no_progress, "no live progress line");
      app.add_option("--nproc", a->nproc, "data-parallel ranks on this host, one per GPU (docs/distributed.md)");
      app.add_option("--stop-after", a->stop_after, "testing: checkpoint and exit 3 after N steps of this attempt")
          ->group("");
      app.footer("Exit codes: 0 completed, 1 failed, 2 bad config, 3 preempted (resume by rerunning), 4 diverged.");
      return [a] { return run_train(*a); };
    }};
