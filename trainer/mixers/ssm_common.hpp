#pragma once
// Internal to trainer/mixers: what the state-space style mixers (mamba2_mixer.cpp,
// mamba3_mixer.cpp, hedgehog_mixer.cpp) share — host helpers of their CPU layers (layouts
// token-major [N = B·T, C]; per-(batch, head) sequences are gathered by the callers) and the
// Mixer interface over their CPU and CUDA layers (DtypeMixer).
#include <cmath>
#include <cstddef>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "kernels/backend.hpp"
#include "trainer/mixer.hpp"

namespace lar::trainer::mixers {

// The recurrent decode (init_state/step) of the mamba2, mamba3 and gla_hedgehog mixers on the
// CUDA backend (cuda_layers/{mamba2,mamba3,hedgehog}_layer_cuda.cpp: the forward's projections
// and conv over a window of the last W projection rows, the per-token kernels on the device
// state): verified on the H200 by `test_ssm_decode_cuda` (each layer against the CPU layer and
// its own forward, whole models against the CPU decoder). While false the CUDA backend refuses
// it (ssm_decode_cuda_gate); UnverifiedDecodeIsAClearError expects either value.
constexpr bool kSsmDecodeCudaVerified = true;

// Tests only: tests/gpu/test_ssm_decode_cuda.cpp runs the unverified CUDA decode.
inline bool& ssm_decode_cuda_unverified_allowed() {
  static bool allowed = false;
  return allowed;
}

// "" when the CUDA decode of mixer `kind` may run, else the refusal (the key and value named).
inline std::string ssm_decode_cuda_gate(const std::string& kind, const std::string& backend) {
  if (kSsmDecodeCudaVerified || ssm_decode_cuda_unverified_allowed()) return "";
  return "model.architecture: '" + kind + "' decode (step) on backend " + backend +
         " has a CUDA path that is not yet verified on a GPU (tests/gpu/test_ssm_decode_cuda.cpp); decode with "
         "backend: cpu";
}

}  // namespace lar::trainer::mixers

namespace lar::trainer::mixers::ssm {

template <class T>
inline T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}
template <class T>
inline T softplus(T x) {
  return x > T(20) ? x : std::log1p(std::exp(x));
}
template <class T>
inline T silu(T x) {
  return x * sigmoid(x);
}
template <class T>
inline T silu_grad(T x) {
  const T s = sigmoid(x);
  return s * (T(1) + x * (T(1) - s));
}
// softplus⁻¹(y) = log(expm1(y)): dt_bias starts so that softplus(dt_bias) is log-uniform in
// [1e-3, 1e-1] (Mamba's dt initialisation).
inline double softplus_inv(double y) { return std::log(std::expm1(y)); }

template <class T>
kernels::DType dtype_of() {
  return sizeof(T) == 4 ? kernels::DType::f32 : kernels::DType::f64;
}
template <class T>
kernels::Tensor tv(std::vector<T>& v, std::initializer_list<int64_t> shape) {
  return kernels::Tensor(v.data(), dtype_of<T>(), shape);
}
template <class T>
kernels::Tensor tv(const std::vector<T>& v, std::initializer_list<int64_t> shape) {
  return kernels::Tensor(const_cast<T*>(v.data()), dtype_of<T>(), shape);
}

// Causal depthwise conv (width W, optional bias) + SiLU over [B, len, C]:
//   s[t,c] = bias[c] + Σ_i w[c,i]·p[t−W+1+i, c];  a = silu(s)
// Positions before t = 0 come from `tail` ([B, W−1, C], decode) or are zero; `tail` is then
// advanced to the last W−1 inputs. `pre` keeps s for the backward.
template <class T>
void conv_silu_fwd(const std::vector<T>& p, std::vector<T>& pre, std::vector<T>& a, const T* w, const T* bias, int W,
                   int C, int B, int len, std::vector<T>* tail) {
  pre.resize(p.size());
  a.resize(p.size());
  for (int b = 0; b < B; ++b) {
    const T* pb = &p[(size_t)b * len * C];
    const T* tb = tail ? &(*tail)[(size_t)b * (W - 1) * C] : nullptr;
    for (int t = 0; t < len; ++t)
      for (int c = 0; c < C; ++c) {
        T s = bias ? bias[c] : T(0);
        for (int i = 0; i < W; ++i) {
          const int src = t - W + 1 + i;
          const T x = src >= 0 ? pb[(size_t)src * C + c] : (tb ? tb[(size_t)(W - 1 + src) * C + c] : T(0));
          s += w[(size_t)c * W + i] * x;
        }
        pre[((size_t)b * len + t) * C + c] = s;
        a[((size_t)b * len + t) * C + c] = silu(s);
      }
    if (tail && W > 1) {
      std::vector<T> ext((size_t)(W - 1 + len) * C);
      std::copy_n(tb, (size_t)(W - 1) * C, ext.begin());
      std::copy_n(pb, (size_t)len * C, ext.begin() + (std::ptrdiff_t)(W - 1) * C);
      std::copy(ext.end() - (std::ptrdiff_t)(W - 1) * C, ext.end(), &(*tail)[(size_t)b * (W - 1) * C]);
    }
  }
}

// From da (on the conv output) to dp (on its input, overwritten); dw, dbias accumulated.
template <class T>
void conv_silu_bwd(const std::vector<T>& p, const std::vector<T>& pre, const std::vector<T>& da, std::vector<T>& dp,
                   const T* w, T* dw, T* dbias, int W, int C, int B, int len) {
  dp.assign(p.size(), T(0));
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < len; ++t)
      for (int c = 0; c < C; ++c) {
        const size_t n = ((size_t)b * len + t) * C + c;
        const T g = da[n] * silu_grad(pre[n]);
        if (dbias) dbias[c] += g;
        for (int i = 0; i < W; ++i) {
          const int src = t - W + 1 + i;
          if (src < 0) continue;
          const size_t m = ((size_t)b * len + src) * C + c;
          dw[(size_t)c * W + i] += g * p[m];
          dp[m] += g * w[(size_t)c * W + i];
        }
      }
}

// RMSNorm over groups of `g` consecutive channels of rows of width C, weight w [C]:
//   y = x·rstd·w,  rstd = 1/sqrt(mean_group(x²) + eps);  rstd [rows·C/g].
template <class T>
void group_rmsnorm_fwd(const T* x, const T* w, T* y, T* rstd, size_t rows, int C, int g, double eps) {
  const int ng = C / g;
  for (size_t r = 0; r < rows; ++r)
    for (int j = 0; j < ng; ++j) {
      const T* xr = x + r * C + (size_t)j * g;
      T ss = 0;
      for (int i = 0; i < g; ++i) ss += xr[i] * xr[i];
      const T rs = T(1) / std::sqrt(ss / T(g) + T(eps));
      rstd[r * ng + j] = rs;
      for (int i = 0; i < g; ++i) y[r * C + (size_t)j * g + i] = xr[i] * rs * w[(size_t)j * g + i];
    }
}
// dx overwritten, dw accumulated.
template <class T>
void group_rmsnorm_bwd(const T* x, const T* w, const T* rstd, const T* dy, T* dx, T* dw, size_t rows, int C, int g) {
  const int ng = C / g;
  for (size_t r = 0; r < rows; ++r)
    for (int j = 0; j < ng; ++j) {
      const size_t o = r * C + (size_t)j * g;
      const T rs = rstd[r * ng + j];
      T dot = 0;
      for (int i = 0; i < g; ++i) {
        dot += dy[o + i] * w[(size_t)j * g + i] * x[o + i];
        if (dw) dw[(size_t)j * g + i] += dy[o + i] * x[o + i] * rs;
      }
      for (int i = 0; i < g; ++i)
        dx[o + i] = rs * dy[o + i] * w[(size_t)j * g + i] - x[o + i] * rs * rs * rs * dot / T(g);
    }
}

// Parameter bookkeeping shared by the mixers: declaration, binding and typed access.
class ParamTable {
 public:
  int add(ParamSpec s) {
    specs_.push_back(std::move(s));
    return (int)specs_.size() - 1;
  }
  const std::vector<ParamSpec>& specs() const { return specs_; }
  void bind(const char* who, std::vector<kernels::Tensor> p, std::vector<kernels::Tensor> g) {
    if (p.size() != specs_.size() || g.size() != specs_.size())
      throw RuntimeError(std::string(who) + ": bind() got " + std::to_string(p.size()) + " tensors for " +
                         std::to_string(specs_.size()) + " parameters");
    P = std::move(p);
    G = std::move(g);
  }
  bool bound() const { return !P.empty(); }
  template <class T>
  const T* par(int slot) const {
    return P[slot].template ptr<T>();
  }
  template <class T>
  T* grad(int slot) const {
    return G[slot].template ptr<T>();
  }
  std::vector<kernels::Tensor> P, G;

 private:
  std::vector<ParamSpec> specs_;
};

// Decode runs on the CPU backend; these mixers have no CUDA implementation yet.
inline void check_cpu(const kernels::Backend& be, const std::string& kind) {
  if (be.device() != kernels::Device::cpu)
    throw UserError("model.architecture: '" + kind + "' has no CUDA implementation in this build yet (backend " +
                    be.name() + "; use backend: cpu or auto)");
}

// The Mixer interface of a routing-free mixer over its CPU Impl<T>, one per dtype (f32 in
// training, f64 in gradient checks), and its CUDA layer (the interface Cuda, made by the layer's
// factory in cuda_layers/), each built on first use after bind(); the backend's device picks
// one. `Derived` provides
//   template <class T> std::unique_ptr<Impl<T>> make_impl() const;
//   std::string cuda_refusal(const kernels::Backend&) const;  // "" or why the CUDA layer cannot run it
//   std::unique_ptr<Cuda> make_cuda() const;                  // null in a build without CUDA
// and Impl<T> provides forward(be, x, y, B, len, State<T>* or nullptr), backward(be, dy, dx)
// and make_state(batch) (a State<T>, which derives from MixerState).
template <class Derived, template <class> class Impl, template <class> class State, class Cuda>
class DtypeMixer : public Mixer {
 public:
  explicit DtypeMixer(const MixerConfig& cfg) : cfg_(cfg) {}

  std::string kind() const override { return cfg_.kind; }
  std::vector<ParamSpec> params() const override { return pt_.specs(); }
  void bind(std::vector<kernels::Tensor> params, std::vector<kernels::Tensor> grads) override {
    pt_.bind(who().c_str(), std::move(params), std::move(grads));
    f32_.reset();
    f64_.reset();
    cuda_.reset();
  }
  void forward(ForwardContext& ctx, const kernels::Tensor& x, const kernels::Tensor& y, Routing&) override {
    if (ctx.be.device() == kernels::Device::cuda) return cuda(ctx.be).forward(ctx, x, y);
    check_cpu(ctx.be, cfg_.kind);
    const int B = (int)x.size(0), len = (int)x.size(1);
    if (ctx.be.dtype() == kernels::DType::f32)
      impl<float>().forward(ctx.be, x.ptr<float>(), y.ptr<float>(), B, len, nullptr);
    else
      impl<double>().forward(ctx.be, x.ptr<double>(), y.ptr<double>(), B, len, nullptr);
  }
  void backward(ForwardContext& ctx, const kernels::Tensor& dy, const kernels::Tensor& dx, Routing&) override {
    if (ctx.be.device() == kernels::Device::cuda) return cuda(ctx.be).backward(ctx, dy, dx);
    check_cpu(ctx.be, cfg_.kind);
    if (ctx.be.dtype() == kernels::DType::f32)
      impl<float>().backward(ctx.be, dy.ptr<float>(), dx.ptr<float>());
    else
      impl<double>().backward(ctx.be, dy.ptr<double>(), dx.ptr<double>());
  }
  // Decode: on CUDA the device implementation (while ssm_decode_cuda_gate allows it).
  std::unique_ptr<MixerState> init_state(kernels::Backend& be, int batch, int) const override {
    auto* self = const_cast<DtypeMixer*>(this);
    if (be.device() == kernels::Device::cuda) return self->cuda_decode(be).init_state(be, batch);
    check_cpu(be, cfg_.kind);
    if (be.dtype() == kernels::DType::f32) return self->template impl<float>().make_state(batch);
    return self->template impl<double>().make_state(batch);
  }
  void step(ForwardContext& ctx, const kernels::Tensor& x, const kernels::Tensor& y, MixerState& state,
            Routing&) override {
    if (ctx.be.device() == kernels::Device::cuda) return cuda_decode(ctx.be).step(ctx, x, y, state);
    check_cpu(ctx.be, cfg_.kind);
    if (ctx.be.dtype() == kernels::DType::f32)
      step_as<float>(ctx, x, y, state);
    else
      step_as<double>(ctx, x, y, state);
  }

 protected:
  MixerConfig cfg_;
  ParamTable pt_;

 private:
  std::string who() const { return cfg_.kind + " mixer"; }
  template <class T>
  void step_as(ForwardContext& ctx, const kernels::Tensor& x, const kernels::Tensor& y, MixerState& state) {
    auto* st = dynamic_cast<State<T>*>(&state);
    if (!st) throw RuntimeError(who() + ": step() with a foreign state");
    impl<T>().forward(ctx.be, x.ptr<T>(), y.ptr<T>(), (int)x.size(0), 1, st);
  }
  template <class T>
  Impl<T>& impl() {
    if (!pt_.bound()) throw RuntimeError(who() + ": used before bind()");
    auto& slot = [&]() -> std::unique_ptr<Impl<T>>& {
      if constexpr (sizeof(T) == 4)
        return f32_;
      else
        return f64_;
    }();
    if (!slot) slot = static_cast<const Derived*>(this)->template make_impl<T>();
    return *slot;
  }
  Cuda& cuda_decode(const kernels::Backend& be) {
    if (const std::string why = ssm_decode_cuda_gate(cfg_.kind, be.name()); !why.empty()) throw UserError(why);
    return cuda(be);
  }
  Cuda& cuda(const kernels::Backend& be) {
    if (const std::string why = static_cast<const Derived*>(this)->cuda_refusal(be); !why.empty())
      throw UserError(why);
    if (!pt_.bound()) throw RuntimeError(who() + ": used before bind()");
    if (!cuda_) {
      cuda_ = static_cast<const Derived*>(this)->make_cuda();
      if (!cuda_) throw UserError(who() + ": this build has no CUDA support (backend " + be.name() + ")");
    }
    return *cuda_;
  }
  std::unique_ptr<Impl<float>> f32_;
  std::unique_ptr<Impl<double>> f64_;
  std::unique_ptr<Cuda> cuda_;
};

// These mixers publish no write residual: routing needs a delta-rule mixer.
inline void check_no_routing(const MixerConfig& cfg) {
  if (!cfg.routing.empty() && cfg.routing != "none")
    throw UserError("model.routing: '" + cfg.routing +
                    "' needs a delta-rule mixer (deltanet, gdn, kda, gdn2, carve); '" + cfg.kind +
                    "' has no write residual");
}

// p = x Wᵀ: dW += dpᵀ x, dx += dp W (dx accumulated).
template <class T>
void proj_bwd(kernels::Backend& be, const kernels::Tensor& X, const kernels::Tensor& dX, std::vector<T>& dp,
              const ParamTable& pt, int slot, int N, int C) {
  be.gemm(tv(dp, {N, C}), true, X, false, pt.G[slot], 1.0, 1.0);
  be.gemm(tv(dp, {N, C}), false, pt.P[slot], false, dX, 1.0, 1.0);
}

}  // namespace lar::trainer::mixers::ssm
