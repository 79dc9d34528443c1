#pragma once
// The optimisers of optimizer.hpp with parameters, gradients and state in backend memory
// (the CUDA backend: fp32 master weights and moments on the device). Every update is a
// backend op (kernels/backend.hpp, "optimiser updates") and Newton–Schulz runs through
// the backend's GEMMs, so the same code runs on any backend; on the CPU backend it gives
// the host Optimizer's results (AdamW bit for bit; Muon to rounding, as its GEMMs and
// Frobenius sums run in another order).
//
//   DeviceOptimizer opt(be, OptimizerConfig::from_json(cfg), param_views(table), numel);
//   double norm = opt.clip_gradients(store.grads());   // pre-clip global norm
//   opt.step(store.params(), store.grads(), schedule, step);
//   std::string blob = opt.save_state();               // Optimizer::save_state's format
//
// The state blob is the host Optimizer's format, so a checkpoint written on the GPU
// resumes on the CPU and the other way round.
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/backend.hpp"
#include "trainer/optim/optimizer.hpp"

namespace lar::optim {

class DeviceOptimizer {
 public:
  // blocked_norm: clip_gradients sums the squares in optimizer.hpp's kNormBlock blocks, added
  // in table order (Backend::block_sum_squares): the norm ZeRO-1's shards add up to bit for
  // bit (device_zero.hpp), and on the CPU backend the host Optimizer's norm bit for bit.
  // Off: one sum_squares over the flat buffer (one reduction, no per-block sums to fetch).
  DeviceOptimizer(kernels::Backend& be, OptimizerConfig config, std::vector<ParamView> params,
                  std::size_t total_size, bool blocked_norm = false);
  ~DeviceOptimizer();
  DeviceOptimizer(const DeviceOptimizer&) = delete;
  DeviceOptimizer& operator=(const DeviceOptimizer&) = delete;

  // As Optimizer::clip_gradients, on the flat gradient buffer in backend memory. When every
  // parameter is updated by AdamW, the clip's factor is not applied to `grads` here but by
  // the next step() as it reads them (the same bits, one pass fewer over the gradients):
  // call step() next, with these grads; they stay unscaled in memory.
  double clip_gradients(const kernels::Tensor& grads);
  void step(const kernels::Tensor& params, const kernels::Tensor& grads, const Schedule& schedule,
            std::int64_t step);
  void step(const kernels::Tensor& params, const kernels::Tensor& grads, double lr_factor, double scalar_factor);

  std::string save_state();
  void load_state(const std::string& blob);
  std::int64_t steps_taken() const { return host_.t_; }
  const OptimizerConfig& config() const { return host_.config(); }

 private:
  friend class DeviceZeroOptimizer;  // runs its shard as a DeviceOptimizer of its pieces
  kernels::Tensor at(const kernels::Tensor& flat, std::size_t offset, std::size_t n) const;
  // clip_gradients after its norm: scales this table's gradients (or defers the factor to
  // the next step()) when grad_clip / (norm + 1e-6) < 1.
  void clip_by_norm(const kernels::Tensor& grads, double norm);
  // Muon matrices of one shape, updated together: Newton–Schulz's GEMMs run batched over them
  // (one launch per product instead of one per matrix, which dominated small models' steps).
  struct MuonBatch {
    int rows = 0, cols = 0;
    std::vector<std::size_t> slots;  // indices into host_.params_
  };
  void muon_batch(const MuonBatch& b, const kernels::Tensor& params, const kernels::Tensor& grads,
                  const std::vector<double>& lrs);


  kernels::Backend& be_;
  Optimizer host_;  // config, slot layout and the state format; its m_/v_ stage save/load
  bool covers_all_ = false;  // the table tiles [0, total): one norm over the flat buffer
  bool all_adamw_ = false;   // no Muon slot: the clip's factor goes into the AdamW step
  float pending_scale_ = 1.0f;  // that factor, from clip_gradients to the next step()
  void* m_ = nullptr;        // moments / momentum buffers, host_.m_'s layout
  void* v_ = nullptr;        // second moments, host_.v_'s layout
  std::vector<MuonBatch> batches_;
  bool blocked_norm_ = false;
  std::vector<kernels::Backend::SumRange> norm_ranges_;  // every tensor, its first block
  std::size_t norm_blocks_ = 0;
  void* block_sums_ = nullptr;  // f64, one per norm block
  void* work_ = nullptr;  // Muon: U, X, Y (a batch's matrices each) and A, B (its r×r products)
};

}  // namespace lar::optim
