#pragma once
// The CUDA backend: every Backend op on the GPU. precision "fp32": fp32 storage and
// pedantic fp32 cuBLAS, tracking the CPU reference to ~1e-6. "mixed" (the default): bf16
// tensor-core GEMMs with fp32 accumulation, the bf16 flash attention, and bf16 storage
// of the activations the model and mixers keep inside ops or for backward (act_dtype());
// weights reach the GEMMs through a bf16 mirror refreshed after writes; the residual
// stream, norm statistics and master weights stay fp32. Arena blocks grow in place
// (CUDA virtual memory). Deterministic: no atomics; every reduction has a fixed order
// (dev/perf-history.md, "CUDA backend, part 1").
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <array>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "kernels/backend.hpp"
#include "kernels/cuda/event_profile.hpp"

namespace lar::kernels::cuda {

namespace attention {
class CudnnAttention;
struct FlashShape;
}  // namespace attention

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device = 0);
  ~CudaBackend() override;
  Device device() const override { return Device::cuda; }
  DType dtype() const override { return DType::f32; }
  std::string name() const override { return name_; }

  void* alloc_bytes(std::size_t bytes) override;
  void free_bytes(void* p) override;
  // Arena blocks: address space reserved for the whole device memory, physical memory
  // mapped on demand (CUDA virtual memory management), so an arena grows in place and its
  // first step costs no more device memory than it uses. Falls back to cudaMalloc (and
  // no growth) where the driver lacks these calls.
  void* alloc_growable(std::size_t bytes) override;
  bool grow_bytes(void* p, std::size_t bytes) override;
  void upload(const void* host, const Tensor& dst) override;
  void download(const Tensor& src, void* host) override;
  void zero(const Tensor& t) override;
  void fill(const Tensor& t, double value) override;
  void copy(const Tensor& src, const Tensor& dst) override;

  void gemm(const Tensor& A, bool ta, const Tensor& B, bool tb, const Tensor& C, double alpha,
            double beta) override;
  void gemm_batched(const Tensor& A, bool ta, const Tensor& B, bool tb, const Tensor& C, int64_t batches,
                    double alpha, double beta) override;
  void axpy(double alpha, const Tensor& x, const Tensor& y) override;
  double sum_squares(const Tensor& x) override;
  bool all_finite(const Tensor& x) override;
  void block_sum_squares(const Tensor& x, const std::vector<SumRange>& ranges, int64_t block,
                         const Tensor& out) override;

  void embedding_fwd(const Tensor& ids, const Tensor& table, const Tensor& out) override;
  void embedding_bwd(const Tensor& ids, const Tensor& dout, const Tensor& dtable) override;
  void rmsnorm_fwd(const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& rstd,
                   double eps) override;
  void rmsnorm_bwd(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                   const Tensor& dx, const Tensor& dw) override;
  void swiglu_fwd(const Tensor& gu, const Tensor& h) override;
  void swiglu_bwd(const Tensor& gu, const Tensor& dh, const Tensor& dgu) override;
  void swiglu_bwd_fwd(const Tensor& gu, const Tensor& dh, const Tensor& dgu, const Tensor& h) override;
  void rmsnorm_bwd_convert(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, const Tensor& dx,
                           const Tensor& dw, const Tensor& dx_act) override;
  void add_rmsnorm_bwd_convert(const Tensor& x0, const Tensor& r, const Tensor& w, const Tensor& rstd,
                               const Tensor& dy, const Tensor& dx, const Tensor& dw, const Tensor& dx_act) override;
  void rope_fwd(const Tensor& x, double base, int64_t pos0) override;
  void rope_bwd(const Tensor& dx, double base, int64_t pos0) override;
  void rope_split_qkv(const Tensor& qkv, const Tensor& q, const Tensor& k, const Tensor& v, double base,
                      int64_t pos0) override;
  void rope_merge_qkv(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dqkv, double base,
                      int64_t pos0) override;
  void attention_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                     const Tensor& lse, double scale, int64_t window) override;
  void attention_bwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                     const Tensor& lse, const Tensor& dout, const Tensor& dq, const Tensor& dk,
                     const Tensor& dv, double scale, int64_t window) override;
  double cross_entropy_fwd(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                           const Tensor& losses, const Tensor& argmax) override;
  void cross_entropy_bwd(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                         double grad_scale, const Tensor& dlogits) override;

  DType act_dtype() const override { return bf16_gemm_ ? DType::bf16 : DType::f32; }
  void convert(const Tensor& src, const Tensor& dst) override;
  void add_rmsnorm_fwd(const Tensor& x, const Tensor& r, const Tensor& h, const Tensor& w, const Tensor& y,
                       const Tensor& rstd, double eps) override;
  void register_weights(const Tensor& flat) override;
  double cross_entropy_fwd_bwd(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                               const Tensor& losses, double grad_scale, const Tensor& dlogits) override;

  void adamw_step(const Tensor& w, const Tensor& g, const Tensor& m, const Tensor& v,
                  const AdamWStep& s) override;
  void adamw_step_multi(const Tensor& w, const Tensor& g, const Tensor& m, const Tensor& v,
                        const std::vector<AdamWSegment>& segments) override;
  void momentum_step(const Tensor& g, const Tensor& buf, const Tensor& u, double mu, bool nesterov) override;
  void scale(const Tensor& x, double alpha) override;
  void transpose(const Tensor& src, const Tensor& dst, double alpha) override;
  void normuon_normalize(const Tensor& o, const Tensor& V, double beta2, double eps) override;
  void decayed_update(const Tensor& w, const Tensor& o, double decay, double step) override;
  void frobenius_normalize(const Tensor& src, const Tensor& dst, bool transposed, double eps) override;

  // precision "fp32": pedantic fp32 GEMMs and the fp32 attention kernels (the reference);
  // "mixed"/"auto": bf16 tensor-core GEMMs (operands rounded to bf16 in a scratch
  // buffer, fp32 accumulation and output) and the bf16 flash attention (head dim 64/128) over the same fp32
  // tensors; "tf32": the same with TF32 GEMMs. Deterministic in every mode (no atomics,
  // one stream, cuBLAS is run-to-run reproducible on one GPU).
  void set_options(const Options& o) override;
  std::size_t device_peak_bytes() const override { return peak_bytes_; }
  bool mixed() const { return mixed_; }

  cudaStream_t stream() const { return stream_; }
  void synchronize();
  // Which implementation the last attention_fwd/bwd ran: "cudnn" (cuDNN's fused flash
  // attention), "flash" (our bf16 mma.sync kernels), "fp32" (the reference kernels), or
  // "none". bf16 attention uses cuDNN where attention::cudnn_covers() the shape (causal,
  // optional window, S == T, D 64/128), cuDNN loads and has an engine, unless deterministic
  // or cuda.attention: flash; the flash kernels otherwise (kernels/attention/cudnn_attention.hpp).
  const char* attention_path() const { return attn_path_; }
  // With LAR_CUDA_PROFILE=1 in the environment: device seconds per op kind since the last
  // report (CUDA events around every op), largest first; empty otherwise. GEMMs are split
  // by shape and role, "gemm MxNxK op β=b →C-dtype ×calls TFLOP/s" (op: the row-major
  // operands' transposes, e.g. NT = x·Wᵀ), plus a "gemm (all shapes)" total.
  std::vector<std::pair<std::string, double>> profile_report();
  // How the bf16 GEMMs of precision mixed pick their cuBLASLt algorithm (the run's cuda.gemm):
  // "heuristic" (the default): among cuBLASLt's heuristic candidates for the shape and the
  // operands' alignment, the one measured fastest on the H200 for that shape (a fixed table in
  // cuda_backend.cu), else the first — a fixed function of them (run-to-run and resume
  // bit-identical); "tune" (not in deterministic runs): the heuristic's candidates and
  // their tiles in other cluster shapes / CTA swizzling, timed once per distinct shape at its
  // first use, the fastest cached (LAR_GEMM_LOG=1 prints them all, and in heuristic mode each
  // plan's choice); "cublas": the cublasGemmStridedBatchedEx call of sessions 1–6.
  const char* gemm_mode() const;

 private:
  // Device scratch of at least `bytes` (grown, never shrunk; one user at a time).
  void* scratch_bytes(std::size_t bytes);
  bool flash_ok(const Tensor& q, const Tensor& v) const;
  // RMSNorm backward of x (+ r when r is given), dx_out optional (the three norm-backward ops).
  void norm_bwd(const Tensor& x, const Tensor& r, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                const Tensor& dx, const Tensor& dw, const Tensor& dx_out);
  // True when this bf16 attention shape goes to cuDNN (see attention_path()).
  bool attn_cudnn(const attention::FlashShape& fs);
  std::unique_ptr<attention::CudnnAttention> cudnn_attn_;  // created at the first cuDNN attention
  const char* attn_path_ = "none";
  void flash_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& lse,
                 double scale, int64_t window);
  void flash_bwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& lse,
                 const Tensor& dout, const Tensor& dq, const Tensor& dk, const Tensor& dv, double scale,
                 int64_t window);
  void rope(const Tensor& x, double base, int64_t pos0, double sign);
  // The cached (cos, sin) table of positions pos0 … pos0+T−1 (recomputed when the key changes).
  const float2* rope_table(int64_t T, int64_t D, double base, int64_t pos0);
  // bf16 operand of a mixed GEMM: a bf16 tensor as is, a weight through the mirror, any
  // other f32 tensor rounded into gemm scratch at byte offset `off`.
  const void* gemm_operand(const Tensor& t, std::size_t off);
  // Marks the weight mirror stale when an op writes into the registered weight region.
  void touch(const Tensor& dst) {
    const char* p = static_cast<const char*>(dst.data);
    if (weights_ && p < weights_ + weights_bytes_ && p + dst.bytes() > weights_) mirror_fresh_ = false;
  }
  void track_alloc(void* p, std::size_t bytes);
  // The cuBLASLt plan of one distinct bf16 GEMM (descriptors + chosen algorithm), keyed by
  // shape, transposes, leading dims, strides, output dtype, β ≠ 0 and pointer alignment.
  struct GemmPlan;
  using GemmKey = std::array<int64_t, 14>;
  std::map<GemmKey, std::unique_ptr<GemmPlan>> gemm_plans_;
  GemmPlan& gemm_plan(const GemmKey& key, const void* a, const void* b, void* c, bool c_bf16, float alpha,
                      float beta);
  void gemm_lt(GemmPlan& plan, const void* lt_a, const void* lt_b, void* c, float alpha, float beta);  // Lt's A = our B
  enum class GemmMode { tune, heuristic, cublas };
  GemmMode gemm_mode_ = GemmMode::heuristic;
  int gpu_sms_ = 0, gpu_major_ = 0;
  std::size_t smem_optin_ = 0;  // shared memory a block may opt in to (bytes)
  bool h200_ = false;  // an sm_90 GPU with 132 SMs: the measured GEMM preferences apply
  cublasLtHandle_t lt_ = nullptr;
  void* lt_workspace_ = nullptr;  // shared by cuBLASLt and cuBLAS (one stream)
  // Profile names of the GEMM shapes (stable addresses for EventProfile) and their counts.
  std::set<std::string> prof_names_;
  struct GemmStat {
    int64_t calls = 0;
    double flops = 0;
  };
  std::map<std::string, GemmStat> gemm_stats_;
  struct Growable;
  std::vector<Growable*> growables_;
  Growable* find_growable(void* p);
  bool map_more(Growable& g, std::size_t bytes);
  int device_ = 0;
  std::size_t total_mem_ = 0;
  void track_free(void* p);
  struct OpTimer;
  bool profile_ = false;
  EventProfile prof_;
  // The registered weights (register_weights) and their bf16 mirror for mixed GEMMs.
  const char* weights_ = nullptr;
  std::size_t weights_bytes_ = 0;
  void* mirror_ = nullptr;
  bool mirror_fresh_ = false;
  void* rope_table_ = nullptr;  // float2 (cos, sin) per position and frequency
  int64_t rope_T_ = 0, rope_D_ = 0, rope_pos0_ = -1;  // what the table holds (cached)
  double rope_base_ = 0;
  void* gemm_scratch_ = nullptr;  // bf16 copies of a GEMM's operands (precision mixed)
  std::size_t gemm_scratch_n_ = 0;
  std::size_t rope_table_n_ = 0;
  bool mixed_ = false;      // tensor-core GEMMs and flash attention
  bool bf16_gemm_ = false;  // GEMM products in bf16 (else TF32)
  std::string gpu_name_;
  void* big_scratch_ = nullptr;
  std::size_t big_scratch_n_ = 0;
  int32_t* idx_scratch_ = nullptr;  // embedding backward: sorted ids, positions, sort workspace
  std::size_t idx_scratch_n_ = 0;
  std::size_t live_bytes_ = 0, peak_bytes_ = 0;
  std::vector<std::pair<void*, std::size_t>> allocs_;  // live cudaMalloc blocks (few: arena, params, state)
  double* scratch_doubles(std::size_t n);  // device scratch for reductions
  // Σ x² (squares) or the number of non-finite elements of an f32 or bf16 tensor.
  // Σ x² (squares) or the count of non-finite elements of x, left on the device: the
  // returned pointer holds the total once the stream reaches it.
  const double* reduce_on_device(bool squares, const Tensor& x);
  double reduce_to_host(bool squares, const Tensor& x);
  std::string name_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  double* scratch_ = nullptr;
  std::size_t scratch_n_ = 0;
};

// Number of CUDA devices visible to this process (0 when no driver / no device).
int cuda_device_count();

}  // namespace lar::kernels::cuda
