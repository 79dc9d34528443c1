#pragma once
// The CPU reference backend: T = float for training, T = double for finite-difference
// gradient checks. GEMMs through OpenBLAS (kept single-threaded; we split the output
// across our own OpenMP threads so one thread pool owns the cores), everything else in
// plain loops over a fixed partition of rows. Deterministic for a fixed thread count.
#include "kernels/backend.hpp"

namespace lar::kernels::cpu {

template <class T>
class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int threads);
  Device device() const override { return Device::cpu; }
  DType dtype() const override;
  std::string name() const override;
  int threads() const override { return threads_; }

  void* alloc_bytes(std::size_t bytes) override;
  void free_bytes(void* p) override;
  void upload(const void* host, const Tensor& dst) override;
  void download(const Tensor& src, void* host) override;
  void zero(const Tensor& t) override;
  void fill(const Tensor& t, double value) override;
  void copy(const Tensor& src, const Tensor& dst) override;

  void gemm(const Tensor& A, bool ta, const Tensor& B, bool tb, const Tensor& C, double alpha = 1.0,
            double beta = 0.0) override;
  void gemm_batched(const Tensor& A, bool ta, const Tensor& B, bool tb, const Tensor& C, int64_t batches,
                    double alpha = 1.0, double beta = 0.0) override;
  void axpy(double alpha, const Tensor& x, const Tensor& y) override;
  double sum_squares(const Tensor& x) override;
  bool all_finite(const Tensor& x) override;

  void embedding_fwd(const Tensor& ids, const Tensor& table, const Tensor& out) override;
  void embedding_bwd(const Tensor& ids, const Tensor& dout, const Tensor& dtable) override;
  void rmsnorm_fwd(const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& rstd,
                   double eps) override;
  void rmsnorm_bwd(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                   const Tensor& dx, const Tensor& dw) override;
  void swiglu_fwd(const Tensor& gu, const Tensor& h) override;
  void swiglu_bwd(const Tensor& gu, const Tensor& dh, const Tensor& dgu) override;
  void rope_fwd(const Tensor& x, double base, int64_t pos0 = 0) override;
  void rope_bwd(const Tensor& dx, double base, int64_t pos0 = 0) override;
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

  void adamw_step(const Tensor& w, const Tensor& g, const Tensor& m, const Tensor& v,
                  const AdamWStep& s) override;
  void momentum_step(const Tensor& g, const Tensor& buf, const Tensor& u, double mu, bool nesterov) override;
  void scale(const Tensor& x, double alpha) override;
  void transpose(const Tensor& src, const Tensor& dst, double alpha) override;
  void normuon_normalize(const Tensor& o, const Tensor& V, double beta2, double eps) override;
  void decayed_update(const Tensor& w, const Tensor& o, double decay, double step) override;

  // Seconds spent inside gemm()/gemm_batched() and inside attention_fwd/bwd since
  // construction (lar-bench train).
  double gemm_seconds() const { return gemm_seconds_; }
  double attention_seconds() const { return attention_seconds_; }

 private:
  void rope(const Tensor& x, double base, int64_t pos0, double sign);
  // RoPE in place on heads [h0, h0+nh) of p [B,Tn,Htot,D] (rope() is h0 = 0, nh = Htot).
  void rope_heads(T* p, int64_t B, int64_t Tn, int64_t Htot, int64_t h0, int64_t nh, int64_t D, double base,
                  int64_t pos0, double sign);
  // Threads for a loop of `work` element-operations: tiny loops stay on one thread (a
  // parallel region costs more than they do).
  int nt(int64_t work) const { return work >= (1 << 15) ? threads_ : 1; }
  int threads_;
  double gemm_seconds_ = 0;
  double attention_seconds_ = 0;
};

// exp(x) for fp32 in vectorisable form (≈1 ulp); used by the fp32 kernels.
float fast_expf(float x);

// Single-threaded strided GEMM on raw pointers (row-major), for kernels that run inside
// their own parallel loop: C[M,N] = alpha·op(A)·op(B) + beta·C.
template <class T>
void gemm_raw(bool ta, bool tb, int M, int N, int K, T alpha, const T* A, int lda, const T* B, int ldb,
              T beta, T* C, int ldc);

}  // namespace lar::kernels::cpu
