// CARVE's chunk forward and backward (carve_cuda.hpp's carve_fwd / carve_bwd): the channel
// rule's chunk kernels (kernels/channel_rule/channel_rule.cuh) in their CARVE mode, and the
// choice between the fused backward and its split into a chain pass and chunk CTAs.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/carve/carve_cuda.hpp"
#include "kernels/channel_rule/channel_rule.cuh"

namespace lar::kernels::cuda::linear {
namespace {

// CARVE's split backward in one launch: blocks 0..B·H−1 walk the chain, the rest take one chunk
// each, latest chunks first (the order the chain reaches them), beside the chain on the other SMs.
// The chain CTAs come first in the grid, so they are resident before any chunk CTA waits.
__global__ void __launch_bounds__(NT, 1) cbwd_carve_split_kernel(const CParams p) {
  const int nbh = p.B * p.H, i = static_cast<int>(blockIdx.x);
  if (i < nbh) {
    cbwd_body<kCarve, kBwdCarveChain>(p, i % p.H, i / p.H, p.nc - 1);
  } else {
    const int j = i - nbh, bh = j % nbh;
    cbwd_body<kCarve, kBwdCarvePar>(p, bh % p.H, bh / p.H, p.nc - 1 - j / nbh);
  }
}

}  // namespace

std::size_t carve_content_bytes(const DeltaShape& s) {
  return static_cast<std::size_t>(s.B) * s.H * delta_num_chunks(s) * 64 * sizeof(float);
}

namespace {
void check_carve(const CarveInputs& in, const char* what) {
  if (!in.q || !in.k || !in.v || !in.g || !in.bx || !in.w || !in.U1 || !in.U2)
    throw RuntimeError(std::string(what) + ": q, k, v, g, bx, w, U1 and U2 are required");
  if (in.rank < 1 || in.rank > 32)
    throw RuntimeError(std::string(what) + ": content rank " + std::to_string(in.rank) + " (supported: 1..32)");
}

// CARVE's backward, split (chain pass + chunk pass) or fused. The content gradient chains the
// chunks in reverse (dm of chunk c enters chunk c − 1's dO), so no chunk's gradients can be made
// before the later chunks' have been walked; what can wait is everything the chain does not
// need (dq, dk, dv, dg, dbx, dw: the dP product, the dq and dk products, the gate scans and most
// global writes). The chain pass does the rest in one CTA per (b, h) and hands each chunk's
// dS_end and dm on; the chunk CTAs recompute their chunk from them on the other SMs while the
// chain goes on (one launch, cbwd_carve_split_kernel). Fitted on the H200 (T·B = 32K, H = 16;
// dev/perf-history.md, "Channel rule: CARVE at B=1 T=32K"), in units of the fused kernel's time: split / fused
// = 0.86, 0.90, 0.96 at B·H = 16, 32, 64 (the chain pass ≈ 0.86–0.9 of the fused walk; the chunk
// CTAs, one chunk step each, share the SMs the chains leave) and 1.73 at B·H = 128. So the split
// while max(kChainCost, kParCost · B·H / (SMs − B·H)) stays below the fused kernel's waves.
// DeltaShape::kernels.path (cuda.linear_path) forces one.
constexpr double kChainCost = 0.9, kParCost = 1.0;
bool use_carve_split(const CParams& p, PathChoice want) {
  if (want != PathChoice::automatic) return want == PathChoice::chunked;
  const int sms = sm_count();
  const double bh = static_cast<double>(p.B) * p.H;
  if (bh >= 0.75 * sms) return false;
  return std::max(kChainCost, kParCost * bh / (sms - bh)) < 0.97 * std::ceil(bh / sms);
}
}  // namespace

void carve_fwd(const DeltaShape& s, const CarveInputs& in, __nv_bfloat16* o, float* S_out,
               __nv_bfloat16* boundary, float* content, cudaStream_t stream) {
  CParams p = make_cparams(s, "carve_fwd");
  check_carve(in, "carve_fwd");
  if (!o || !content) throw RuntimeError("carve_fwd: o and content are required");
  p.q = in.q, p.k = in.k, p.v = in.v, p.g = in.g, p.bx = in.bx, p.wsc = in.w, p.U1 = in.U1, p.U2 = in.U2;
  p.rank = in.rank, p.S0 = in.S0;
  p.o = o, p.S_out = S_out, p.bound = boundary, p.cm = content;
  launch(cfwd_kernel<kCarve>, kCFwdSmem, p, stream);
}

void carve_bwd(const DeltaShape& s, const CarveInputs& in, const __nv_bfloat16* boundary, const float* content,
               const __nv_bfloat16* dout, const float* dST, const CarveGrads& gr, cudaStream_t stream) {
  CParams p = make_cparams(s, "carve_bwd");
  check_carve(in, "carve_bwd");
  if (!boundary || !content || !dout || !gr.dq || !gr.dk || !gr.dv || !gr.dg || !gr.dbx || !gr.dw || !gr.dU1 ||
      !gr.dU2)
    throw RuntimeError("carve_bwd: boundary, content, dout, dq, dk, dv, dg, dbx, dw, dU1 and dU2 are required");
  p.q = in.q, p.k = in.k, p.v = in.v, p.g = in.g, p.bx = in.bx, p.wsc = in.w, p.U1 = in.U1, p.U2 = in.U2;
  p.rank = in.rank, p.cgrad = in.content_grad ? 1 : 0;
  p.bound_in = boundary, p.cm = const_cast<float*>(content), p.dout = dout, p.dST = dST;
  p.dq = gr.dq, p.dk = gr.dk, p.dv = gr.dv, p.dg = gr.dg, p.dbx = gr.dbx, p.dwsc = gr.dw, p.dU1 = gr.dU1,
  p.dU2 = gr.dU2, p.dS0 = gr.dS0;
  const size_t nu = static_cast<size_t>(s.H) * in.rank * 64 * sizeof(float);
  LAR_CUDA_CHECK(cudaMemsetAsync(gr.dU1, 0, nu, stream));
  LAR_CUDA_CHECK(cudaMemsetAsync(gr.dU2, 0, nu, stream));
  if (!use_carve_split(p, s.kernels.path)) {
    launch(cbwd_kernel<kCarve, kBwdFused>, kCBwdSmem, p, stream);
    return;
  }
  const size_t chunks = static_cast<size_t>(p.B) * p.H * p.nc;
  Scratch scratch(stream);
  p.dSend = scratch.get<bf16>(chunks * D * D);
  p.dmc = scratch.get<float>(chunks * C);
  p.flags = scratch.get<unsigned>(chunks);
  LAR_CUDA_CHECK(cudaMemsetAsync(p.flags, 0, chunks * sizeof(unsigned), stream));
  if (chunks + static_cast<size_t>(p.B) * p.H > 0x7fffffffu) throw RuntimeError("carve_bwd: too many chunks");
  launch(cbwd_carve_split_kernel, kCBwdSmem, p, stream, dim3(static_cast<unsigned>(chunks + static_cast<size_t>(p.B) * p.H)));
}

}  // namespace lar::kernels::cuda::linear
