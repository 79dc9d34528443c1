// Shared by the layer-level GPU tests of the state-space and feature-map mixers (Mamba-2,
// Mamba-3, GLA-Hedgehog): one forward + backward of a single mixer on a backend, from host
// fp32 parameters, input and output gradient, and the relative RMS error of one parameter's
// slice of the flat gradient.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kernels/backend.hpp"
#include "tests/gpu/host_helpers.hpp"
#include "trainer/mixer.hpp"
#include "trainer/params.hpp"

namespace lar::gpu_test {

struct LayerOut {
  std::vector<float> y, dx, grads;
  std::vector<std::pair<std::string, std::pair<int64_t, int64_t>>> table;  // name → (offset, numel)
};

// One forward + backward of a single layer on `be` with the given parameters, input and
// output gradient (host fp32; on a backend with bf16 activations rounded to bf16 on the device).
inline LayerOut run_layer(kernels::Backend& be, const trainer::MixerConfig& mc, const std::vector<float>& params,
                          const std::vector<float>& x, const std::vector<float>& dy, int B, int T) {
  auto mixer = trainer::make_mixer(mc);
  trainer::ParamStore ps(be);
  for (const auto& s : mixer->params()) ps.add(s, "", 0);
  ps.allocate();
  be.upload(params.data(), ps.params());
  ps.zero_grads();
  std::vector<kernels::Tensor> pv, gv;
  LayerOut out;
  for (int i = 0; i < (int)ps.table().size(); ++i) {
    pv.push_back(ps.param(i));
    gv.push_back(ps.grad(i));
    out.table.push_back({ps.table()[i].name, {ps.table()[i].offset, ps.table()[i].numel}});
  }
  mixer->bind(pv, gv);
  kernels::Arena ar(be);
  const kernels::DType at = be.act_dtype();
  const int64_t d = mc.d_model;
  auto in = [&](const std::vector<float>& h) {
    kernels::Tensor f = ar.alloc(kernels::DType::f32, {B, T, d});
    be.upload(h.data(), f);
    if (at == kernels::DType::f32) return f;
    kernels::Tensor a = ar.alloc(at, {B, T, d});
    be.convert(f, a);
    return a;
  };
  auto get = [&](const kernels::Tensor& t) {
    kernels::Tensor f = t;
    if (t.dtype != kernels::DType::f32) {
      f = ar.alloc(kernels::DType::f32, t.shape());
      be.convert(t, f);
    }
    std::vector<float> h(f.numel());
    be.download(f, h.data());
    return h;
  };
  const kernels::Tensor X = in(x), dY = in(dy);
  const kernels::Tensor Y = ar.alloc(at, {B, T, d}), dX = ar.alloc(at, {B, T, d});
  trainer::ForwardContext ctx{be, ar, true};
  trainer::Routing route;
  mixer->forward(ctx, X, Y, route);
  mixer->backward(ctx, dY, dX, route);
  out.y = get(Y);
  out.dx = get(dX);
  out.grads.resize(ps.numel());
  be.download(ps.grads(), out.grads.data());
  return out;
}

inline double rel(const std::vector<float>& a, const std::vector<float>& ref, int64_t off, int64_t n) {
  return rel_rms(std::vector<float>(a.begin() + off, a.begin() + off + n),
                 std::vector<float>(ref.begin() + off, ref.begin() + off + n));
}

}  // namespace lar::gpu_test
