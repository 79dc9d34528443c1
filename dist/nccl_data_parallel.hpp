#pragma once
// trainer::DataParallel over NCCL (built when the CUDA backend is on and NCCL is found;
// LAR_HAVE_NCCL). One process per GPU; docs/distributed.md.
//
//   NcclDataParallel dp(cuda_backend, {rank, world, id_file, deterministic});
//
// - The unique id goes through id_file (dist/id_exchange.hpp); the communicator is
//   non-blocking and its initialisation is polled against LAR_DIST_INIT_TIMEOUT (300 s).
// - Gradient sums run on a second stream (ordered after the backend's stream by an
//   event) so they overlap the rest of backward; wait_reduced() polls until they are
//   done, checking ncclCommGetAsyncError, for at most LAR_DIST_TIMEOUT (40 s) beyond
//   the compute: a peer that died or hangs ends in ncclCommAbort and a RuntimeError,
//   never in a hang.
// - Deterministic runs set NCCL_ALGO=Ring and NCCL_PROTO=Simple before the communicator
//   exists (a fixed reduction order); NVLink multicast is always off (NCCL_NVLS_ENABLE=0).
#include <filesystem>
#include <memory>
#include <string>

#include "core/json.hpp"
#include "kernels/backend.hpp"
#include "trainer/optim/zero.hpp"
#include "trainer/train.hpp"

namespace lar::dist {

struct DistEnv;

struct NcclOptions {
  int rank = 0, world = 1;
  std::filesystem::path id_file;
  bool deterministic = false;
  double init_timeout_s = 300;  // id file and communicator initialisation
  double timeout_s = 40;        // one collective, beyond the compute it waits for
};

class NcclDataParallel final : public trainer::DataParallel {
 public:
  NcclDataParallel(kernels::Backend& be, const NcclOptions& o);
  ~NcclDataParallel() override;
  int rank() const override { return o_.rank; }
  int world() const override { return o_.world; }
  void reduce_async(const kernels::Tensor& grads, int64_t offset, int64_t count) override;
  void wait_reduced() override;
  std::vector<double> sum(const std::vector<double>& values, double timeout_s = 0) override;
  void abort() override;
  // ZeRO-1's collectives over this communicator (dist/nccl_communicator.hpp), ordered after
  // the backend's stream; made on first use, valid while this object lives.
  optim::Communicator* communicator() override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  NcclOptions o_;
  std::unique_ptr<optim::Communicator> zero_comm_;
};

// The CUDA backend on GPU `local_rank` (local_rank modulo the visible GPUs when a
// scheduler shows each rank only its own).
std::unique_ptr<kernels::Backend> make_rank_backend(int local_rank);

// What cli/train.cpp plugs into TrainOptions for a rank of `env`.
void configure_rank(trainer::TrainOptions& opts, const DistEnv& env);

// GPUs this process can see (cudaGetDeviceCount; 0 without a driver).
int visible_gpus();

}  // namespace lar::dist
