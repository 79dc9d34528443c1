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
#include <memory>
#include <string>
#include <vector>

#include "core/json.hpp"
#include "kernels/backend.hpp"
#include "trainer/data/dataset.hpp"

namespace lar::optim {
class Communicator;  // trainer/optim/zero.hpp
}

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

// Data parallelism (docs/distributed.md): one process per GPU, each holding the whole
// model and optimiser state. The trainer sees only this interface; dist/ implements it
// with NCCL (dist/nccl_data_parallel.hpp) and cli/train.cpp plugs it in.
class DataParallel {
 public:
  virtual ~DataParallel() = default;
  virtual int rank() const = 0;
  virtual int world() const = 0;
  // Start the in-place sum over the ranks of the fp32 elements [offset, offset + count)
  // of `grads` (backend memory), ordered after the work already queued on the backend;
  // returns at once (the sums run beside the rest of the backward pass).
  virtual void reduce_async(const kernels::Tensor& grads, int64_t offset, int64_t count) = 0;
  // Backend work queued after this call sees every sum started so far. Throws
  // lar::RuntimeError (after aborting the communicator) when a peer does not answer.
  virtual void wait_reduced() = 0;
  // The element-wise sum over the ranks of a few host numbers (losses, token counts, stop
  // flags); blocking, doubles as a barrier. timeout_s ≤ 0: the default collective timeout.
  virtual std::vector<double> sum(const std::vector<double>& values, double timeout_s = 0) = 0;
  // On an error: abort the communicator so that no peer stays blocked on this rank.
  virtual void abort() = 0;
  // ZeRO-1's collectives (optimizer.zero_stage: 1) over host buffers; nullptr when this
  // implementation has none. Owned by this object.
  virtual optim::Communicator* communicator() { return nullptr; }
};

struct TrainOptions {
  bool progress = false;      // a live progress line on stdout (a terminal)
  long stop_after_steps = 0;  // tests: behave as if preempted after this many steps (0 = off)
  // Data-parallel runs (cli/train.cpp sets both): the backend of this rank (its GPU), and
  // the communicator, built once the config is read and the backend exists.
  std::function<std::unique_ptr<kernels::Backend>(const json& config)> make_backend;
  std::function<std::unique_ptr<DataParallel>(kernels::Backend& be, const json& config,
                                              const std::filesystem::path& run_dir)>
      make_data_parallel;
};

// Train (or resume) the run in `run_dir` whose config.json exists. Returns the exit code.
int train_run(const std::filesystem::path& run_dir, const TrainOptions& opts = {});

// The backend `lar train` runs this config on, here: `backend` resolved (auto = cuda when
// built with CUDA and a GPU is present), except that auto picks cpu for a model the CUDA
// backend cannot run (trainer::cuda_unsupported, trainer/mixer.hpp).
std::string resolve_train_backend(const json& config);
// The backend options a (defaults-filled) config asks for: deterministic, precision and the
// `cuda` kernel keys (a config without them gets their defaults).
kernels::Backend::Options backend_options(const json& config);
// Why resolve_train_backend falls back to the CPU: `backend: auto` on a machine with a GPU and
// a model the CUDA backend cannot run gives cuda_unsupported's reason; "" otherwise. `lar
// train` prints it on stderr and records it in status.json's summary (backend_fallback).
std::string backend_fallback_reason(const json& config);

// Rows [part·B/parts, (part+1)·B/parts) of a batch of B sequences (B % parts == 0):
// the share of one rank (and one micro-batch) of the global batch. Task answers keep
// their ids (answer_kind is copied whole).
data::Batch slice_batch(const data::Batch& batch, int part, int parts);

// The global batch (data.batch_size) splits into world·data.micro_batches equal
// micro-batches; UserError naming both numbers when it does not divide.
void check_batch_split(const json& config, int world);

// Total optimiser steps of a config: budget.tokens / (batch·seq_len) when > 0, else budget.steps.
long total_steps(const json& config);

}  // namespace lar::trainer
