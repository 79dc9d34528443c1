#pragma once
// The backend interface: every tensor operation the model performs goes through a
// `Backend`, so a CUDA backend plugs in later without touching model code.
//
//   kernels/backend.hpp   this interface, Tensor (a non-owning view) and Arena
//   kernels/cpu/          CpuBackend<T>: the numerical reference, T = float (training)
//                         or double (finite-difference gradient checks in tests)
//   kernels/cuda/         the CUDA backend: memory, GEMM, one file per op family
//   kernels/<family>/     a mixer family's kernels, their own interface: linear/ (the one
//                         recurrence, CPU, and what the CUDA families share), delta_rule/,
//                         channel_rule/, carve/, ccq/, hedgehog/, ssm/, attention/ (CPU
//                         reference, CUDA kernels, decode, supports.hpp, tests beside)
//
// Conventions, for every op below:
// - Tensors are row-major and contiguous. Shapes are written [B,T,H,D]; a "2-D view" of
//   a tensor is [numel/last, last].
// - Floating tensors have the backend's dtype (`Backend::dtype()`); ids are i32.
// - Weight matrices are stored [out_features, in_features] (PyTorch's nn.Linear), so a
//   projection is  y = x·Wᵀ  = gemm(x, false, W, true, y).
// - "accumulate" outputs (dx += …, dW += …) are noted per op. Parameter gradients are
//   always accumulated, so one zeroing of the flat gradient buffer per step suffices.
// - Ops are deterministic: the same inputs give the same bits for a fixed thread count
//   (fixed partitioning, reductions in a fixed order, no atomics).
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

namespace lar::kernels {

// bf16: reduced-precision activation storage of the CUDA backend (Backend::act_dtype()).
enum class DType : uint8_t { f32, f64, i32, bf16 };
std::size_t dtype_size(DType t);
std::string to_string(DType t);

enum class Device : uint8_t { cpu, cuda };

// A non-owning view of device memory: pointer + shape + dtype (up to 4 dims).
struct Tensor {
  void* data = nullptr;
  DType dtype = DType::f32;
  int ndim = 0;
  std::array<int64_t, 4> dims{0, 0, 0, 0};

  Tensor() = default;
  Tensor(void* d, DType t, std::initializer_list<int64_t> shape);
  Tensor(void* d, DType t, const std::vector<int64_t>& shape);

  bool empty() const { return data == nullptr; }
  int64_t size(int i) const { return dims[i < 0 ? ndim + i : i]; }
  int64_t numel() const;
  std::size_t bytes() const { return numel() * dtype_size(dtype); }
  int64_t last() const { return ndim ? dims[ndim - 1] : 1; }
  int64_t rows() const { return ndim ? numel() / last() : 1; }  // of the 2-D view
  std::vector<int64_t> shape() const { return {dims.begin(), dims.begin() + ndim}; }
  std::string shape_str() const;  // "[2,16,64]"

  template <class T> T* ptr() const { return static_cast<T*>(data); }
  // Same memory, another shape of the same numel (throws on mismatch).
  Tensor view(std::initializer_list<int64_t> shape) const;
  // The 2-D view [numel/cols, cols] (e.g. q [B,T,H,D] as a GEMM operand: q.matrix(H·D)).
  Tensor matrix(int64_t cols) const;
  // Rows [begin, begin+count) along dim 0.
  Tensor slice0(int64_t begin, int64_t count) const;
};

class Backend;

// Bump allocator for activations and scratch. Tensors stay valid until `reset()` (or
// `release(mark)` below them). After a step that overflowed the first block, `reset()`
// coalesces into one block of the peak size, so steady-state steps never allocate.
class Arena {
 public:
  explicit Arena(Backend& be) : be_(be) {}
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  Tensor alloc(DType t, std::initializer_list<int64_t> shape);
  Tensor alloc(DType t, const std::vector<int64_t>& shape);
  Tensor zeros(DType t, std::initializer_list<int64_t> shape);  // alloc + backend zero

  struct Mark { std::size_t block = 0, offset = 0; };
  Mark mark() const { return {blocks_.size(), used_}; }
  void release(Mark m);   // free everything allocated after m (same block only; else no-op)
  void reset();           // free everything
  std::size_t peak_bytes() const { return peak_; }
  Backend& backend() const { return be_; }

 private:
  void* take(std::size_t bytes);
  struct Block { void* ptr = nullptr; std::size_t size = 0; };
  Backend& be_;
  std::vector<Block> blocks_;  // the last one is the current block
  std::size_t used_ = 0;       // bytes used in the current block
  std::size_t total_used_ = 0, peak_ = 0, full_blocks_used_ = 0;
};

// Every tensor op the model needs. Abstract: CpuBackend<T> (kernels/cpu/cpu_backend.hpp)
// and the CUDA backend implement it.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;
  virtual DType dtype() const = 0;       // floating dtype of activations, params, grads
  virtual std::string name() const = 0;  // "cpu-f32 (2 threads)"
  virtual int threads() const { return 1; }

  // ---- memory ----
  virtual void* alloc_bytes(std::size_t bytes) = 0;  // aligned to 64 bytes
  virtual void free_bytes(void* p) = 0;
  // Growable blocks (the Arena's): alloc_growable backs `bytes` and may reserve address
  // space beyond; grow_bytes extends such a block in place to `bytes` (the pointer stays
  // valid) and returns false where it cannot (then the Arena opens another block). The
  // defaults: a plain alloc_bytes that never grows. free_bytes frees either kind.
  virtual void* alloc_growable(std::size_t bytes) { return alloc_bytes(bytes); }
  virtual bool grow_bytes(void* p, std::size_t bytes) {
    (void)p, (void)bytes;
    return false;
  }
  virtual void upload(const void* host, const Tensor& dst) = 0;  // dst.bytes() bytes
  virtual void download(const Tensor& src, void* host) = 0;
  virtual void zero(const Tensor& t) = 0;
  virtual void fill(const Tensor& t, double value) = 0;
  virtual void copy(const Tensor& src, const Tensor& dst) = 0;  // same numel and dtype

  // ---- dense algebra ----
  // C = alpha·op(A)·op(B) + beta·C on the 2-D views [numel/last, last] (pass
  // t.matrix(cols) for multi-head tensors). op(X) = Xᵀ when the flag is set.
  // A: [M,K] (or [K,M] when ta), B: [K,N] (or [N,K] when tb), C: [M,N].
  virtual void gemm(const Tensor& A, bool ta, const Tensor& B, bool tb, const Tensor& C,
                    double alpha = 1.0, double beta = 0.0) = 0;
  // Batched: A [nb,M,K], B [nb,K,N], C [nb,M,N] (with the same transposes per batch).
  virtual void gemm_batched(const Tensor& A, bool ta, const Tensor& B, bool tb, const Tensor& C,
                            int64_t batches, double alpha = 1.0, double beta = 0.0) = 0;
  // y += alpha·x (the residual add when alpha = 1).
  virtual void axpy(double alpha, const Tensor& x, const Tensor& y) = 0;
  // Σ x² over the whole tensor, in double (grad norms). Deterministic order. x in dtype()
  // (the GPU also takes bf16 activations).
  virtual double sum_squares(const Tensor& x) = 0;
  // True when every element is finite (dtypes as sum_squares).
  virtual bool all_finite(const Tensor& x) = 0;
  // Blocked Σ x² (the gradient norm's blocks, trainer/optim/optimizer.hpp kNormBlock): each
  // range [offset, offset + n) of the flat f32 buffer x is cut into blocks of `block`
  // elements (the last one shorter), and block k of range i gets its Σ x² in double at
  // out[ranges[i].out + k] (out: f64 in backend memory; other entries are left as they
  // are). Every block is added in a fixed order (deterministic). The default runs
  // sum_squares per block: on the CPU backends that is element order, the host
  // optim::block_sum_squares bit for bit; the GPU does all blocks in one launch.
  struct SumRange {
    int64_t offset = 0, n = 0, out = 0;
  };
  virtual void block_sum_squares(const Tensor& x, const std::vector<SumRange>& ranges, int64_t block,
                                 const Tensor& out);

  // ---- embedding ----
  // out[n,:] = table[ids[n],:]. ids: i32 [N], table [V,d], out [N,d].
  virtual void embedding_fwd(const Tensor& ids, const Tensor& table, const Tensor& out) = 0;
  // dtable[ids[n],:] += dout[n,:] (accumulate).
  virtual void embedding_bwd(const Tensor& ids, const Tensor& dout, const Tensor& dtable) = 0;

  // ---- RMSNorm over the last dim ----
  // y = x · rstd · w, rstd[n] = 1/sqrt(mean(x²) + eps). x,y [N,d], w [d], rstd [N].
  virtual void rmsnorm_fwd(const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& rstd,
                           double eps) = 0;
  // dx += ∂L/∂x (accumulate: the residual stream's gradient), dw += ∂L/∂w (accumulate).
  virtual void rmsnorm_bwd(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                           const Tensor& dx, const Tensor& dw) = 0;

  // ---- SwiGLU ----
  // gu [N,2F] = [gate | up] (one GEMM with the contiguous W_gate;W_up), h [N,F] = silu(gate)·up.
  virtual void swiglu_fwd(const Tensor& gu, const Tensor& h) = 0;
  // dgu [N,2F] = [dgate | dup] (overwrite).
  virtual void swiglu_bwd(const Tensor& gu, const Tensor& dh, const Tensor& dgu) = 0;

  // ---- RoPE (rotate-half convention, pairs (i, i+D/2)) ----
  // In place on x [B,T,H,D]; position of token t is pos0 + t; θ_i = base^(−2i/D).
  virtual void rope_fwd(const Tensor& x, double base, int64_t pos0 = 0) = 0;
  // The transpose (rotation by −θ), in place on the gradient.
  virtual void rope_bwd(const Tensor& dx, double base, int64_t pos0 = 0) = 0;

  // ---- causal softmax attention (GQA, optional sliding window) ----
  // q [B,T,Hq,D], k [B,S,Hkv,D], v [B,S,Hkv,Dv], o [B,T,Hq,Dv], lse [B,Hq,T] (log-sum-exp
  // of each row, saved for backward). Hq % Hkv == 0; query head h uses kv head h/(Hq/Hkv).
  // Query t sits at absolute position t + (S − T) (so S > T is a KV cache) and sees keys
  // j ≤ pos with pos − j < window (window ≤ 0: unlimited). scale multiplies q·k.
  virtual void attention_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                             const Tensor& lse, double scale, int64_t window) = 0;
  // dq, dk, dv overwritten.
  virtual void attention_bwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                             const Tensor& lse, const Tensor& dout, const Tensor& dq,
                             const Tensor& dk, const Tensor& dv, double scale, int64_t window) = 0;

  // ---- cross-entropy with a loss mask ----
  // logits [N,V], targets i32 [N], mask [N] (weights; 0 = ignored). losses[n] =
  // mask[n]·(logsumexp(logits[n]) − logits[n,targets[n]]), and argmax[n] (i32; optional,
  // pass an empty tensor to skip). Returns Σ losses.
  virtual double cross_entropy_fwd(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                                   const Tensor& losses, const Tensor& argmax) = 0;
  // dlogits = grad_scale·mask[n]·(softmax(logits[n]) − onehot(targets[n])) (overwrite;
  // dlogits may alias logits).
  virtual void cross_entropy_bwd(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                                 double grad_scale, const Tensor& dlogits) = 0;

  // ---- optimiser updates (trainer/optim/device_optimizer.hpp) ----
  // fp32 master weights, gradients and state in backend memory; every op is elementwise
  // (or per row/column) and evaluates exactly the float expressions of the host
  // Optimizer (trainer/optim/optimizer.cpp), without FMA contraction, so the same inputs
  // give the same bits on every backend.
  struct AdamWStep {
    float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
    float step_size = 0;     // lr / (1 − β1^t)
    float inv_sqrt_bc2 = 1;  // 1 / sqrt(1 − β2^t)
    float decay = 1;         // 1 − lr·wd
    // The gradient-norm clip's factor, applied to g as it is read (g itself is left as is):
    // g ← g·grad_scale rounded to f32 — the bits a separate scale(g, grad_scale) pass would
    // leave — so the clip costs no pass of its own over the gradients. 1: no clip.
    float grad_scale = 1;
  };
  // g ← g·grad_scale (when ≠ 1; not stored); m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g·g;
  // w ← w·decay − step_size·(m / (sqrt(v)·inv_sqrt_bc2 + eps)). All f32, same numel.
  virtual void adamw_step(const Tensor& w, const Tensor& g, const Tensor& m, const Tensor& v,
                          const AdamWStep& s) = 0;
  // adamw_step over many slices of whole f32 buffers w, g (same layout), m and v: segment i
  // updates w/g [offset, offset+n), m [m_offset, …), v [v_offset, …) with its own scalars.
  // The same bits as one adamw_step per segment (the default); the GPU runs all of them in
  // one launch (one pass over the parameters instead of one launch per tensor).
  struct AdamWSegment {
    int64_t offset = 0, m_offset = 0, v_offset = 0, n = 0;
    AdamWStep step;
  };
  virtual void adamw_step_multi(const Tensor& w, const Tensor& g, const Tensor& m, const Tensor& v,
                                const std::vector<AdamWSegment>& segments) {
    auto at = [](const Tensor& t, int64_t off, int64_t n) {
      return Tensor(static_cast<char*>(t.data) + off * static_cast<int64_t>(dtype_size(t.dtype)), t.dtype, {n});
    };
    for (const AdamWSegment& s : segments)
      adamw_step(at(w, s.offset, s.n), at(g, s.offset, s.n), at(m, s.m_offset, s.n), at(v, s.v_offset, s.n), s.step);
  }
  // Muon momentum: buf ← μ·buf + (1−μ)·g;  u = nesterov ? (1−μ)·g + μ·buf : buf.
  virtual void momentum_step(const Tensor& g, const Tensor& buf, const Tensor& u, double mu, bool nesterov) = 0;
  // x ← alpha·x (gradient clipping).
  virtual void scale(const Tensor& x, double alpha) = 0;
  // dst [c,r] = alpha·srcᵀ for src [r,c] (2-D views).
  virtual void transpose(const Tensor& src, const Tensor& dst, double alpha) = 0;
  // NorMuon on o [rows, cols]: one second moment per row when rows ≥ cols (else per
  // column), V ← β2·V + (1−β2)·mean(o²) over the other dim; o ← o / (sqrt(V) + eps), then
  // rescaled to its former Frobenius norm. V [max(rows, cols)].
  virtual void normuon_normalize(const Tensor& o, const Tensor& V, double beta2, double eps) = 0;
  // w ← w·decay − step·o (Muon's decoupled decay and update).
  virtual void decayed_update(const Tensor& w, const Tensor& o, double decay, double step) = 0;
  // Newton–Schulz's start: dst = src / (‖src‖_F + eps), or its transpose (dst [c,r] for src
  // [r,c]) when `transposed`. The factor is float(1 / (sqrt(sum_squares(src)) + eps)), as this
  // default computes it; the GPU keeps the norm on the device instead of a host round trip
  // per matrix (which stalled the queue once per Muon matrix per step).
  virtual void frobenius_normalize(const Tensor& src, const Tensor& dst, bool transposed, double eps) {
    const double inv = static_cast<float>(1.0 / (std::sqrt(sum_squares(src)) + eps));
    if (transposed) {
      transpose(src, dst, inv);
    } else {
      copy(src, dst);
      scale(dst, inv);
    }
  }

  // ---- reduced-precision activations (additive; CPU backends keep dtype() everywhere) ----
  // The dtype in which the model and mixers may keep tensors that live inside an op or are
  // saved for backward (GEMM operands and outputs, SwiGLU gate/up/hidden, attention
  // q/k/v/o/dO/dq/dk/dv, dlogits): bf16 on the CUDA backend in mixed precision, dtype()
  // elsewhere. Ops that accept such tensors (either dtype): gemm (A, B and C each),
  // rmsnorm_fwd's y, rmsnorm_bwd's dy, swiglu_fwd/bwd, rope_fwd/bwd, attention_fwd/bwd (all
  // but lse), cross_entropy_fwd/bwd/fwd_bwd's logits and dlogits, add_rmsnorm_fwd's r and y,
  // rmsnorm_bwd_convert's dy and dx_act, add_rmsnorm_bwd_convert's r, dy and dx_act,
  // swiglu_bwd_fwd, convert.
  virtual DType act_dtype() const { return dtype(); }
  // dst = src with dst's dtype (same numel). The default handles equal dtypes (a copy).
  virtual void convert(const Tensor& src, const Tensor& dst);
  // h = x + r, then y = RMSNorm(h) (as rmsnorm_fwd): the residual add fused with the next
  // norm. x, r, h [N,d] (h may alias x), y [N,d], w [d], rstd [N]. The default runs
  // copy + axpy + rmsnorm_fwd.
  virtual void add_rmsnorm_fwd(const Tensor& x, const Tensor& r, const Tensor& h, const Tensor& w, const Tensor& y,
                               const Tensor& rstd, double eps);
  // rmsnorm_bwd, then dx_act = dx (the updated residual gradient) in dx_act's dtype: the
  // next GEMMs' operand, written by the same pass on the GPU instead of a conversion pass.
  // The default runs rmsnorm_bwd + convert.
  virtual void rmsnorm_bwd_convert(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                                   const Tensor& dx, const Tensor& dw, const Tensor& dx_act) {
    rmsnorm_bwd(x, w, rstd, dy, dx, dw);
    convert(dx, dx_act);
  }
  // rmsnorm_bwd_convert (dx_act empty: rmsnorm_bwd) of x = x0 + r, the residual sum of
  // add_rmsnorm_fwd formed again with the same float add (the same bits as passing the stored
  // sum): the model keeps a block's mixer output r (act_dtype(), half the bytes on the GPU)
  // for backward instead of the fp32 stream after it. x0, dx [N,d] in dtype(), r [N,d].
  // The default forms the sum in a temporary buffer (copy + axpy, as add_rmsnorm_fwd's).
  virtual void add_rmsnorm_bwd_convert(const Tensor& x0, const Tensor& r, const Tensor& w, const Tensor& rstd,
                                       const Tensor& dy, const Tensor& dx, const Tensor& dw, const Tensor& dx_act) {
    const Tensor x(alloc_bytes(x0.bytes()), x0.dtype, x0.shape());
    try {
      copy(x0, x);
      axpy(1.0, r, x);
      if (dx_act.empty()) rmsnorm_bwd(x, w, rstd, dy, dx, dw);
      else rmsnorm_bwd_convert(x, w, rstd, dy, dx, dw, dx_act);
    } catch (...) {
      free_bytes(x.data);
      throw;
    }
    free_bytes(x.data);
  }
  // swiglu_bwd, and h = silu(gate)·up (swiglu_fwd's output, recomputed in the backward where
  // it was not stored) from the same read of gu. The default runs swiglu_fwd + swiglu_bwd.
  virtual void swiglu_bwd_fwd(const Tensor& gu, const Tensor& dh, const Tensor& dgu, const Tensor& h) {
    swiglu_fwd(gu, h);
    swiglu_bwd(gu, dh, dgu);
  }
  // cross_entropy_fwd (no argmax) and cross_entropy_bwd in one pass over the logits
  // (training); returns Σ losses. dlogits may be act_dtype() and may alias the logits (same
  // dtype). The default calls the two.
  virtual double cross_entropy_fwd_bwd(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                                       const Tensor& losses, double grad_scale, const Tensor& dlogits);
  // One GEMM for the q, k and v projections: qkv [B,T,Hq+2·Hkv,D] holds each token's
  // [q heads | k heads | v heads]. rope_split_qkv writes q [B,T,Hq,D] = RoPE(q heads),
  // k [B,T,Hkv,D] = RoPE(k heads) and v [B,T,Hkv,D] = the v heads (as rope_fwd);
  // rope_merge_qkv is its transpose, dqkv = [RoPE⁻¹(dq) | RoPE⁻¹(dk) | dv] (overwrite).
  // Both accept act_dtype() tensors (all of one dtype).
  virtual void rope_split_qkv(const Tensor& qkv, const Tensor& q, const Tensor& k, const Tensor& v, double base,
                              int64_t pos0) = 0;
  virtual void rope_merge_qkv(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dqkv, double base,
                              int64_t pos0) = 0;
  // The flat parameter buffer (trainer/params.hpp). A backend may keep a bf16 mirror of it
  // for its GEMMs, refreshed lazily after any op wrote into the region (optimiser steps,
  // uploads). Called once by the model after allocation; the default ignores it.
  virtual void register_weights(const Tensor& flat) { (void)flat; }

  // ---- run options ----
  // Set once, right after construction (make_backend). CPU backends are deterministic
  // and fp32/fp64 throughout, so they ignore both.
  struct Options {
    bool deterministic = false;  // bit-identical results for the same inputs
    // "fp32": every op in fp32 (the GPU reference); "mixed": bf16 tensor-core GEMMs with
    // fp32 accumulation and bf16 flash attention over fp32 storage (the fast path);
    // "tf32": the same with TF32 GEMMs; "auto": mixed on GPUs.
    std::string precision = "auto";
    // Which CUDA kernels run: the run's `cuda` keys (core/config_schema.cpp documents each
    // value); the CUDA backend refuses a value it does not know, naming the key.
    struct Cuda {
      std::string attention = "auto";    // auto | cudnn | flash
      std::string gemm = "heuristic";    // heuristic | tune | cublas
      std::string linear_path = "auto";  // auto | fused | chunked
      std::string linear_keep = "all";   // all | p | og
      std::string ccq_fwd = "auto";      // auto | par | ws
      std::string ccq_bwd = "auto";      // auto | par | ws
      int ccq_group = 0;                 // 0: per shape; 1..64
    } cuda;
  };
  virtual void set_options(const Options& o) { options_ = o; }
  const Options& options() const { return options_; }
  // Bytes of device memory in use at the high-water mark (0 on the CPU: see peak RSS).
  virtual std::size_t device_peak_bytes() const { return 0; }

 protected:
  Options options_;
};

// Backends register themselves by name ("cpu" in kernels/cpu/, "cuda" in kernels/cuda/):
//   static lar::kernels::BackendRegistration reg{"cuda", [](int threads, DType t) {...}};
using BackendFactory = std::function<std::unique_ptr<Backend>(int threads, DType dtype)>;
// `usable` (optional) says whether this machine can run the backend now (e.g. a GPU is
// present); `auto` only picks a backend that is registered and usable.
struct BackendRegistration {
  BackendRegistration(const std::string& name, BackendFactory factory, std::function<bool()> usable = {});
};
bool backend_available(const std::string& name);
bool backend_usable(const std::string& name);  // registered, and its `usable` says yes

// The backend a run config asks for: kind "cpu" | "cuda" | "auto" (cuda when registered,
// else cpu); threads 0 = all cores. Throws lar::UserError for a backend this build
// does not have.
std::unique_ptr<Backend> make_backend(const std::string& kind, int threads, DType dtype = DType::f32,
                                      const Backend::Options& options = {});
// The backend `make_backend(kind, …)` would build on this machine ("auto" resolved).
std::string resolve_backend(const std::string& kind);

}  // namespace lar::kernels
