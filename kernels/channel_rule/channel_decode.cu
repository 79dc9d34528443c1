// The channel rule's single-token decode (channel_rule.hpp's channel_decode) on the decode
// kernel of channel_decode.cuh.
#include <cuda_bf16.h>

#include "kernels/channel_rule/channel_decode.cuh"
#include "kernels/channel_rule/channel_rule.hpp"

namespace lar::kernels::cuda::linear {

void channel_decode(ChannelMixer m, const DeltaShape& s, const ChannelInputs& in, float* S, __nv_bfloat16* o,
                    cudaStream_t stream) {
  DecParams p = make_dec(s, "channel_decode");
  if (!in.q || !in.k || !in.v || !in.g || !S || !o)
    throw RuntimeError("channel_decode: q, k, v, g, S and o are required");
  if (m == ChannelMixer::kda && !in.beta) throw RuntimeError("channel_decode: kda needs beta");
  if (m == ChannelMixer::gdn2 && (!in.b || !in.w)) throw RuntimeError("channel_decode: gdn2 needs b and w");
  p.q = in.q, p.k = in.k, p.v = in.v, p.g = in.g, p.beta = in.beta, p.bg = in.b, p.wg = in.w, p.S = S, p.o = o;
  const dim3 grid(static_cast<unsigned>(s.H), static_cast<unsigned>(s.B));
  switch (m) {
    case ChannelMixer::gla: cdecode_kernel<dGla><<<grid, NT, 0, stream>>>(p); break;
    case ChannelMixer::kda: cdecode_kernel<dKda><<<grid, NT, 0, stream>>>(p); break;
    case ChannelMixer::gdn2: cdecode_kernel<dGdn2><<<grid, NT, 0, stream>>>(p); break;
  }
  LAR_CUDA_LAUNCHED();
}

}  // namespace lar::kernels::cuda::linear
