#pragma once
// One run = one run directory (docs/protocol.md). `lar train` (cli/train.cpp) is a thin
// wrapper around these functions.
//
//   json cfg = trainer::prepare_config(raw);            // defaults + every check, UserError
//   int rc   = trainer::train_run(run_dir, options);    // exit code of `lar train`
//
// Exit codes: 0 completed, 1 failed, 2 bad config (nothing written), 3 preempted
// (SIGUSR2/SIGTERM/SIGINT: the step finishes, a checkpoint is written), 4 diverged
// (NaN/Inf loss or gradients; recorded in status.json with the step).
#include <filesystem>
#include <functional>
#include <string>

#include "core/json.hpp"

namespace lar::trainer {

constexpr int kExitPreempted = 3;
constexpr int kExitDiverged = 4;

// The run config with schema defaults applied, after every check that can be made
// before any work: schema (unknown keys, types, choices), model shapes, data (paths,
// vocabulary), optimiser and schedule values. Throws lar::UserError with the key path.
json prepare_config(const json& raw);

// The config of run directory D (config.json's "config"), prepared. UserError when
// config.json is missing or malformed.
json read_run_config(const std::filesystem::path& run_dir);

// `lar train --config FILE`: a YAML or JSON run config (a bare config, or a protocol
// config.json with a "config" key). UserError naming file:line:col when it cannot parse.
json load_config_file(const std::filesystem::path& file);

struct TrainOptions {
  bool progress = false;      // a live progress line on stdout (a terminal)
  long stop_after_steps = 0;  // tests: behave as if preempted after this many steps (0 = off)
};

// Train (or resume) the run in `run_dir` whose config.json exists. Returns the exit code.
int train_run(const std::filesystem::path& run_dir, const TrainOptions& opts = {});

// The backend `lar train` runs this config on, here: `backend` resolved (auto = cuda when
// built with CUDA and a GPU is present), except that auto picks cpu for a model with a
// mixer the CUDA backend cannot run yet.
std::string resolve_train_backend(const json& config);
// The first mixer kind of the model that the CUDA backend cannot run ("" when none);
// prepare_config throws UserError for such a model under backend: cuda.
std::string cuda_unsupported_mixer(const json& config);

// Total optimiser steps of a config: budget.tokens / (batch·seq_len) when > 0, else budget.steps.
long total_steps(const json& config);

}  // namespace lar::trainer
