// CARVE's single-token decode (carve_cuda.hpp's carve_decode): the channel rule's decode kernel
// (kernels/channel_rule/channel_decode.cuh) in its CARVE mode.
#include <cuda_bf16.h>

#include <string>

#include "kernels/carve/carve_cuda.hpp"
#include "kernels/channel_rule/channel_decode.cuh"

namespace lar::kernels::cuda::linear {

void carve_decode(const DeltaShape& s, const CarveInputs& in, int pos, float* S, float* content, __nv_bfloat16* o,
                  cudaStream_t stream) {
  DecParams p = make_dec(s, "carve_decode");
  if (!in.q || !in.k || !in.v || !in.g || !in.bx || !in.w || !in.U1 || !in.U2 || !S || !content || !o)
    throw RuntimeError("carve_decode: q, k, v, g, bx, w, U1, U2, S, content and o are required");
  if (in.rank < 1 || in.rank > 32)
    throw RuntimeError("carve_decode: content rank " + std::to_string(in.rank) + " (supported: 1..32)");
  if (pos < 0 || pos > 63) throw RuntimeError("carve_decode: pos " + std::to_string(pos) + " (0..63)");
  p.q = in.q, p.k = in.k, p.v = in.v, p.g = in.g, p.bx = in.bx, p.wsc = in.w, p.U1 = in.U1, p.U2 = in.U2;
  p.rank = in.rank, p.pos = pos, p.S = S, p.content = content, p.o = o;
  cdecode_kernel<dCarve><<<dim3(static_cast<unsigned>(s.H), static_cast<unsigned>(s.B)), NT, 0, stream>>>(p);
  LAR_CUDA_LAUNCHED();
}

}  // namespace lar::kernels::cuda::linear
