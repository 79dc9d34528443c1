// `lar train` — train (or resume) one run directory. Thin: the logic is trainer/train.hpp.
//   lar train --run-dir D                  config from D/config.json (written by the runner)
//   lar train --config FILE --run-dir D    YAML/JSON run config; writes D/config.json first
// Exit codes: 0 completed, 1 failed, 2 bad config (nothing written), 3 preempted,
// 4 diverged (docs/protocol.md).
#include <iostream>

#include "cli/command.hpp"
#include "core/error.hpp"
#include "core/hash.hpp"
#include "core/run_dir.hpp"
#include "trainer/train.hpp"

namespace {

struct TrainArgs {
  std::string run_dir, config;
  long stop_after = 0;
  bool no_progress = false;
};

int run_train(const TrainArgs& a) {
  namespace fs = std::filesystem;
  lar::RunDir rd(a.run_dir);
  if (!a.config.empty()) {
    // Everything is checked before the directory is created.
    lar::json cfg = lar::trainer::prepare_config(lar::trainer::load_config_file(a.config));
    const std::string hash = lar::sha256_hex(lar::canonical_dump(cfg));
    if (fs::exists(rd.config_path())) {
      lar::json old = lar::trainer::read_run_config(rd.root());
      if (lar::sha256_hex(lar::canonical_dump(old)) != hash)
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
  lar::trainer::TrainOptions opts;
  opts.progress = !a.no_progress && lar::cli::stdout_is_tty();
  opts.stop_after_steps = a.stop_after;
  return lar::trainer::train_run(rd.root(), opts);
}

}  // namespace

static lar::cli::CommandRegistration reg{
    "train", "Train (or resume) one run directory", 30, [](CLI::App& app) -> lar::cli::Runner {
      auto a = std::make_shared<TrainArgs>();
      app.add_option("--run-dir", a->run_dir, "run directory (docs/protocol.md)")->required();
      app.add_option("--config", a->config, "YAML or JSON run config; written to RUN_DIR/config.json");
      app.add_flag("--no-progress", a->no_progress, "no live progress line");
      app.add_option("--stop-after", a->stop_after, "testing: checkpoint and exit 3 after N steps of this attempt")
          ->group("");
      app.footer("Exit codes: 0 completed, 1 failed, 2 bad config, 3 preempted (resume by rerunning), 4 diverged.");
      return [a] { return run_train(*a); };
    }};
