#pragma once
// ZeRO-1 with parameters, gradients and state in backend memory (the CUDA backend): the host
// ZeroOptimizer's plan and rules (zero.hpp) run through the DeviceOptimizer's code.
//
//   DeviceZeroOptimizer zero(be, cfg, views, numel, comm);   // comm works on device pointers
//   zero.reduce_gradients(grads);          // or an all-reduce of every gradient (the trainer)
//   double norm = zero.clip_gradients(grads);
//   zero.step(params, grads, schedule, step);
//
// - The plan is plan_zero's (zero_layout): AdamW ranges cut on norm-block boundaries, Muon /
//   NorMuon matrices whole. This rank's pieces are a DeviceOptimizer of their own (its table
//   is ZeroLayout::shard_views), so the moments held are only this rank's, in device memory,
//   and every update runs the DeviceOptimizer's code, Muon's batched Newton–Schulz included.
// - The clip norm: this rank's block sums (Backend::block_sum_squares) in a device buffer of
//   one double per norm block, zero elsewhere, all-reduced (x + 0 is exact), fetched and
//   added in table order: the unsharded DeviceOptimizer's blocked norm (blocked_norm) bit for
//   bit, and on the CPU backend the host Optimizer's.
// - Parameters after step(): the all-gather copies the owners' bits (and the backend is told
//   that the weights changed, so a bf16 mirror is refreshed).
// - save_state(): the unsharded Optimizer::save_state blob on every rank (collective), the
//   shards gathered window by window (at most kSaveWindow floats of device memory at a time,
//   so a checkpoint does not need the unsharded state in device memory); load_state() reads
//   such a blob (any world size, any backend wrote it) and keeps this rank's share.
//
// Bit-identical to the unsharded DeviceOptimizer given the same summed gradients for AdamW
// (elementwise) and on the CPU backend for every optimiser. On the GPU, Muon / NorMuon agree to
// rounding only: Newton–Schulz batches the matrices of one shape that the shard holds, so a
// batch may be smaller than the unsharded one, and cuBLAS's strided-batched GEMM does not compute
// a matrix alike at every batch count (tests/gpu/test_device_zero.cpp bounds the difference).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.hpp"
#include "trainer/optim/device_optimizer.hpp"
#include "trainer/optim/zero.hpp"

namespace lar::optim {

// The trainer runs optimizer.zero_stage 1 on a non-cpu backend only once
// tests/gpu/test_device_zero passes on a GPU (it refuses the config by this name until then).
inline constexpr bool kDeviceZeroGpuVerified = false;

class DeviceZeroOptimizer {
 public:
  // `be` and `comm` must outlive this object; comm's collectives take pointers into `be`'s
  // memory (dist::NcclCommunicator on the CUDA backend; host pointers on a CPU backend).
  DeviceZeroOptimizer(kernels::Backend& be, OptimizerConfig config, std::vector<ParamView> params,
                      std::size_t total_size, Communicator& comm);
  ~DeviceZeroOptimizer();
  DeviceZeroOptimizer(const DeviceZeroOptimizer&) = delete;
  DeviceZeroOptimizer& operator=(const DeviceZeroOptimizer&) = delete;

  // Reduce-scatter: afterwards this rank's pieces of `grads` hold the sums over the ranks.
  void reduce_gradients(const kernels::Tensor& grads);
  // As DeviceOptimizer::clip_gradients (blocked) on the summed gradients of this rank's
  // pieces (collective; every rank returns the same norm). NaN/Inf: returned, nothing scaled.
  double clip_gradients(const kernels::Tensor& grads);
  // Updates this rank's pieces, then all-gathers the parameters (collective).
  void step(const kernels::Tensor& params, const kernels::Tensor& grads, const Schedule& schedule,
            std::int64_t step);
  void step(const kernels::Tensor& params, const kernels::Tensor& grads, double lr_factor, double scalar_factor);

  std::string save_state();                  // collective
  void load_state(const std::string& blob);  // not collective

  std::int64_t steps_taken() const { return shard_->steps_taken(); }
  const ZeroPlan& plan() const { return lay_.plan; }
  std::size_t state_bytes() const { return sizeof(float) * shard_->host_.state_floats(); }

  // Device floats a save_state() window holds (tests set it small to cross windows).
  static std::size_t save_window();
  static void set_save_window_for_tests(std::size_t floats);

 private:
  // Gathers the unsharded m_ (v = false) or v_ into `full` (host, the unsharded length).
  void gather_state(bool v, std::vector<float>& full);

  kernels::Backend& be_;
  OptimizerConfig cfg_;
  std::vector<ParamView> params_;
  std::size_t total_size_ = 0;
  Communicator& comm_;
  ZeroLayout lay_;
  std::unique_ptr<DeviceOptimizer> shard_;
  std::vector<ZeroLayout::StateMap> map_;
  std::vector<kernels::Backend::SumRange> norm_ranges_;  // this rank's pieces, global block index
  void* block_sums_ = nullptr;  // f64 [lay_.n_blocks]
};

}  // namespace lar::optim
