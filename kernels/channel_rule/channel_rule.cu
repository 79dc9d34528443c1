// The channel rule's entry points (channel_rule.hpp): gla, kda and gdn2 on the chunk kernels of
// channel_rule.cuh, and the choice between their fused and two-phase paths.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/channel_rule/channel_rule.cuh"
#include "kernels/channel_rule/channel_rule.hpp"

namespace lar::kernels::cuda::linear {
namespace {

// Which path runs a pass. The fused kernels take one CTA per (b, h) for the whole sequence, so
// with B·H below the SM count most of the GPU idles; the two-phase path spreads the chunks over
// the GPU but adds the prep kernel's solves and bytes and the sequential state pass. Fitted on
// the H200 (132 SMs; kda, gdn2 at B·H = 16, 32, 64, 128 with 512K tokens, H=16; dev/perf-history.md
// "Channel rule: two-phase path for B=1 T=32K"): fused 12–16 µs (fwd) / 24–30 µs (bwd) per chunk and wave of B·H
// CTAs; the two-phase chunk work is 1.29–1.39× the fused work per chunk, spread over all SMs;
// the state pass took 0.7 µs per chunk with one warp per 16 rows (≈ 0.3 expected with four).
// So the two-phase path wins below B·H ≈ 95 on 132 SMs (and between 1 and 1.4 waves above).
// DeltaShape::kernels.path (cuda.linear_path) forces one.
constexpr double kChunkedCost = 1.35, kStateUs = 0.3, kFusedChunkUs = 12.0;
bool use_two_phase(const CParams& p, PathChoice want) {
  if (want != PathChoice::automatic) return want == PathChoice::chunked;
  const int sms = sm_count();
  const double bh = static_cast<double>(p.B) * p.H;
  const double fused = std::ceil(bh / sms);  // waves, in units of one chunk's fused time
  const double chunked = kChunkedCost * bh / sms + kStateUs / kFusedChunkUs;
  return chunked < fused;
}

// The per-chunk terms both two-phase passes hand from the prep kernel on: M, U, W (kda, gdn2), E
// and the chunk's last decays.
template <int MODE>
void take_chunk_terms(CParams& p, Scratch& scratch, size_t chunks) {
  if (MODE != kGla) {
    p.Mc = scratch.get<bf16>(chunks * D * D);
    p.Uc = scratch.get<bf16>(chunks * D * D);
    p.Wc = scratch.get<bf16>(chunks * D * D);
  }
  p.Ec = scratch.get<float>(chunks * D * D);
  p.el = scratch.get<float>(chunks * C);
}

// The two-phase passes of gla, kda, gdn2 (scratch from the stream-ordered pool, freed after).
template <int MODE>
void fwd_two_phase(CParams p, cudaStream_t stream) {
  const size_t chunks = static_cast<size_t>(p.B) * p.H * p.nc;
  Scratch scratch(stream);
  take_chunk_terms<MODE>(p, scratch, chunks);
  if (!p.bound) p.bound = scratch.get<bf16>(chunks * D * D);  // the chunk kernel reads the states from here
  const dim3 per_chunk(p.nc, p.H, p.B), per_rows(4, p.H, p.B);
  launch(cprep_kernel<MODE, false>, kCPrepSmem, p, stream, per_chunk);
  launch(cstate_kernel<false, MODE != kGla>, kCStateSmem, p, stream, per_rows, kCStateThreads);
  launch(cfwd_main_kernel<MODE>, kCFwdMainSmem, p, stream, per_chunk);
}
template <int MODE>
void bwd_two_phase(CParams p, cudaStream_t stream) {
  const size_t chunks = static_cast<size_t>(p.B) * p.H * p.nc;
  Scratch scratch(stream);
  take_chunk_terms<MODE>(p, scratch, chunks);
  p.dSend = scratch.get<bf16>(chunks * D * D);
  const dim3 per_chunk(p.nc, p.H, p.B), per_rows(4, p.H, p.B);
  launch(cprep_kernel<MODE, true>, kCPrepSmem, p, stream, per_chunk);
  launch(cstate_kernel<true, MODE != kGla>, kCStateSmem, p, stream, per_rows, kCStateThreads);
  launch(cbwd_kernel<MODE, kBwdTwoPhase>, kCBwdSmem, p, stream, per_chunk);
}

void check_inputs(ChannelMixer m, const ChannelInputs& in, const char* what) {
  if (!in.q || !in.k || !in.v || !in.g) throw RuntimeError(std::string(what) + ": q, k, v and g are required");
  if (m == ChannelMixer::kda && !in.beta) throw RuntimeError(std::string(what) + ": kda needs beta");
  if (m == ChannelMixer::gdn2 && (!in.b || !in.w)) throw RuntimeError(std::string(what) + ": gdn2 needs b and w");
}

}  // namespace

const char* channel_mixer_name(ChannelMixer m) {
  switch (m) {
    case ChannelMixer::gla: return "gla";
    case ChannelMixer::kda: return "kda";
    case ChannelMixer::gdn2: return "gdn2";
  }
  return "?";
}

void channel_fwd(ChannelMixer m, const DeltaShape& s, const ChannelInputs& in, __nv_bfloat16* o, float* S_out,
                 __nv_bfloat16* boundary, cudaStream_t stream) {
  CParams p = make_cparams(s, "channel_fwd");
  check_inputs(m, in, "channel_fwd");
  if (!o) throw RuntimeError("channel_fwd: o is required");
  p.q = in.q, p.k = in.k, p.v = in.v, p.g = in.g, p.beta = in.beta, p.bg = in.b, p.wg = in.w, p.S0 = in.S0;
  p.o = o, p.S_out = S_out, p.bound = boundary;
  if (use_two_phase(p, s.kernels.path)) {
    switch (m) {
      case ChannelMixer::gla: fwd_two_phase<kGla>(p, stream); break;
      case ChannelMixer::kda: fwd_two_phase<kKda>(p, stream); break;
      case ChannelMixer::gdn2: fwd_two_phase<kGdn2>(p, stream); break;
    }
    return;
  }
  switch (m) {
    case ChannelMixer::gla: launch(cfwd_kernel<kGla>, kCFwdSmem, p, stream); break;
    case ChannelMixer::kda: launch(cfwd_kernel<kKda>, kCFwdSmem, p, stream); break;
    case ChannelMixer::gdn2: launch(cfwd_kernel<kGdn2>, kCFwdSmem, p, stream); break;
  }
}

void channel_bwd(ChannelMixer m, const DeltaShape& s, const ChannelInputs& in, const __nv_bfloat16* boundary,
                 const __nv_bfloat16* dout, const float* dST, const ChannelGrads& gr, cudaStream_t stream) {
  CParams p = make_cparams(s, "channel_bwd");
  check_inputs(m, in, "channel_bwd");
  if (!boundary || !dout || !gr.dq || !gr.dk || !gr.dv || !gr.dg)
    throw RuntimeError("channel_bwd: boundary, dout, dq, dk, dv and dg are required");
  if (m == ChannelMixer::kda && !gr.dbeta) throw RuntimeError("channel_bwd: kda needs dbeta");
  if (m == ChannelMixer::gdn2 && (!gr.db || !gr.dw)) throw RuntimeError("channel_bwd: gdn2 needs db and dw");
  p.q = in.q, p.k = in.k, p.v = in.v, p.g = in.g, p.beta = in.beta, p.bg = in.b, p.wg = in.w;
  p.bound_in = boundary, p.dout = dout, p.dST = dST;
  p.dq = gr.dq, p.dk = gr.dk, p.dv = gr.dv, p.dg = gr.dg, p.dbeta = gr.dbeta, p.dbg = gr.db, p.dwg = gr.dw;
  p.dS0 = gr.dS0;
  if (use_two_phase(p, s.kernels.path)) {
    switch (m) {
      case ChannelMixer::gla: bwd_two_phase<kGla>(p, stream); break;
      case ChannelMixer::kda: bwd_two_phase<kKda>(p, stream); break;
      case ChannelMixer::gdn2: bwd_two_phase<kGdn2>(p, stream); break;
    }
    return;
  }
  switch (m) {
    case ChannelMixer::gla: launch(cbwd_kernel<kGla, kBwdFused>, kCBwdSmem, p, stream); break;
    case ChannelMixer::kda: launch(cbwd_kernel<kKda, kBwdFused>, kCBwdSmem, p, stream); break;
    case ChannelMixer::gdn2: launch(cbwd_kernel<kGdn2, kBwdFused>, kCBwdSmem, p, stream); break;
  }
}

}  // namespace lar::kernels::cuda::linear
