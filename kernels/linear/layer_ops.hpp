#pragma once
// The elementwise and reduction parts of a linear-mixer layer on the GPU (docs/spec.md §2), around
// the chunkwise kernels of the linear families: short causal conv + SiLU, L2 norm and the
// packing of q, k, v into the kernels' bf16 [B,T,H,64] layout (one fused pass), the gate
// maps, the per-head output RMSNorm × SiLU gate, the cross-layer routing readouts, and
// deterministic column sums for the parameter gradients. Used by
// cuda_layers/linear_layer_cuda.cpp; tests: tests/gpu/test_linear_layer_cuda.cpp.
//
// Conventions: row-major, N = B·T token rows; key heads of 64 (q, k, the channel gates, the
// routing readouts: value heads of 64 too), value heads of any width for the output norm ×
// gate; every function launches on `stream` and throws lar::RuntimeError on a bad shape
// or a failed launch. No atomics: every output element is written by one thread and every
// reduction runs in a fixed order, so results are bit-reproducible.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/event_profile.hpp"

namespace lar::kernels::cuda::linear {

// ---- q, k, v: projections → conv + SiLU → (L2 norm) → bf16 kernel inputs ----
// P [N, ldp] holds the projections (fp32, or bf16 when p_bf16: the GEMM's output in the
// backend's act_dtype()): q in columns [0, Cq), k in [Cq, 2Cq), v in [2Cq, 2Cq+Cv) (one
// fused GEMM). ldp ≥ 2Cq+Cv, a multiple of 4: the columns after v are neither read nor
// written here (gdn's layer puts its gate pre-activations there, gdn_gates_* below). Conv
// weights [C, W] per part (W = 0: no conv, no SiLU).
struct QkvArgs {
  int64_t B = 0, T = 0;
  int Cq = 0, Cv = 0, W = 0;
  bool l2 = false;           // L2-normalise q and k per head: a / sqrt(Σa² + 1e-6)
  const void* P = nullptr;
  bool p_bf16 = false;       // P (and qkv_backward's dP) in bf16, else fp32
  int64_t ldp = 0;
  const float *wq = nullptr, *wk = nullptr, *wv = nullptr;
  const float* rin = nullptr;    // cler: ṽ = v + gamma·rin ([N, Cv]), nullable
  const float* gamma = nullptr;  // cler: Γ, one float in device memory (no host sync)
};
// Outputs q, k [N, Cq], v [N, Cv] in bf16; vout (nullable) gets ṽ in fp32. bf16 P with 16-byte
// rows and W ≤ 4 takes a kernel with 8 channels a lane, everything else one with 4; the two
// give the same values up to the L2 sums' order.
void qkv_forward(const QkvArgs& a, __nv_bfloat16* q, __nv_bfloat16* k, __nv_bfloat16* v, float* vout,
                 cudaStream_t stream);

// The backward of the whole qkv pass, from the kernels' dq, dk, dv (bf16) plus optional
// fp32 extras (routing readouts: ek on k, ev on ṽ, dvout on the published ṽ for clvr):
// dP [N, ldp] = ∂L/∂P (P's dtype; overwritten; through L2, SiLU and the conv's transpose, in
// one walk that recomputes the forward from P), and the conv weights' gradients accumulated into
// gwq/gwk/gwv [C, W] (W ≥ 1; scratch: qkv_backward_scratch_floats(a) floats). cler (rin
// set): d_in += gamma·dṽ (d_in nullable) and dgam_terms [N, Cv] = dṽ ⊙ rin (sum it for ∂L/∂gamma).
struct QkvGrads {
  const __nv_bfloat16 *dq = nullptr, *dk = nullptr, *dv = nullptr;
  const float *ek = nullptr, *ev = nullptr, *dvout = nullptr;
  float* d_in = nullptr;
  float* dgam_terms = nullptr;
};
std::size_t qkv_backward_scratch_floats(const QkvArgs& a);
void qkv_backward(const QkvArgs& a, const QkvGrads& g, void* dP, float* gwq, float* gwk, float* gwv, float* scratch,
                  cudaStream_t stream);

// ---- gates: pre-activations f [N, ld] → activated values ----
//   decay:    g = −exp(A_log[c / per_head])·softplus(f + bias[c])   (gdn: per_head 1; kda/gdn2: 64)
//   logsig16: g = logsigmoid(f + bias[c]) / 16                       (gla)
//   sigmoid:  σ(f), or σ(f + bias[c]) when bias is set               (β, gdn2's b and w, CARVE's w;
//                                                                     CCQ's λ with b_λ)
enum class GateMap { decay, logsig16, sigmoid };
struct GateArgs {
  GateMap map = GateMap::sigmoid;
  int64_t N = 0;
  int C = 0;
  const float* f = nullptr;
  int64_t ldf = 0;
  const float* bias = nullptr;   // decay, logsig16 (required); sigmoid (optional)
  const float* A_log = nullptr;  // decay
  int per_head = 64;             // decay: channels per A_log entry
};
// Output [N, C] contiguous, fp32 (out) or bf16 (outb): exactly one non-null.
void gate_forward(const GateArgs& a, float* out, __nv_bfloat16* outb, cudaStream_t stream);
// dy = dyf + dyb + extra (each [N, C], nullable) on the activated gate; df [N, C] (ld ldd)
// overwritten with ∂L/∂f; for decay, aterm [N, C] = dy·g (sum per head for ∂L/∂A_log).
void gate_backward(const GateArgs& a, const float* dyf, const __nv_bfloat16* dyb, const float* extra, float* df,
                   int64_t ldd, float* aterm, cudaStream_t stream);

// The channel gates' whole backward in one pass (kda, gdn2: decay with per_head 64; gla:
// logsig16), from dy = ∂L/∂g (fp32 [N, C]): df [N, C] contiguous = ∂L/∂f, in bf16 when
// df_bf16 (the GEMMs' operand dtype) else fp32; ∂L/∂bias accumulated into dbias [C] and,
// for decay, ∂L/∂A_log into dA_log [C / per_head] (fixed-order sums over row splits, in
// scratch: gate_backward_fused_scratch_floats(a) floats). Needs C, ldf % 4 = 0 and 16-byte
// aligned f, dy, df.
std::size_t gate_backward_fused_scratch_floats(const GateArgs& a);
void gate_backward_fused(const GateArgs& a, const float* dy, void* df, bool df_bf16, float* dbias, float* dA_log,
                         float* scratch, cudaStream_t stream);

// ---- gdn's gates from the fused projection ----
// gdn's layer computes its gate pre-activations in the q·k·v GEMM: P's columns [off, off+H)
// hold fβ and [off+H, off+2H) fa (off = 2Cq + Cv; row stride ldp; P's dtype), the columns
// [off+2H, width) are padding (zero weights; width 0: ldp; the layer keeps og after them).
// β = σ(fβ) and g = −exp(A_log[h])·softplus(fa + dt_bias[h]), each fp32 [N, H] — the sigmoid
// and decay maps of gate_forward.
struct GdnGateArgs {
  int64_t N = 0;
  int H = 0;
  const void* P = nullptr;
  bool p_bf16 = false;
  int64_t ldp = 0, off = 0, width = 0;
  const float* A_log = nullptr;    // [H]
  const float* dt_bias = nullptr;  // [H]
};
void gdn_gates_forward(const GdnGateArgs& a, float* beta, float* g, cudaStream_t stream);
// The backward from dbeta, dg (fp32 [N, H]): dP's columns [off, off+2H) = ∂L/∂(fβ, fa) in
// P's dtype and its padding columns [off+2H, width) zeroed (the fused GEMMs read them), the
// rest of dP untouched; ∂L/∂dt_bias and ∂L/∂A_log accumulated into ddt [H] and dA_log [H]
// (fixed-order sums over row splits in scratch: gdn_gates_backward_scratch_floats floats).
std::size_t gdn_gates_backward_scratch_floats(int64_t N, int H);
void gdn_gates_backward(const GdnGateArgs& a, const float* dbeta, const float* dg, void* dP, float* ddt, float* dA_log,
                        float* scratch, cudaStream_t stream);

// ---- the layer's packed projection weight and its gradient ----
// Up to kMaxPieces fp32 pieces laid end to end in a packed buffer: piece k has n[k] elements,
// copied from src[k] (pack; null: zeros) or added into dst[k] (scatter). One launch each for
// the layer's [Wq;Wk;Wv;(W_β;W_a;0);W_g] copy and its weight gradient's split (the pieces are
// not adjacent in the parameter buffer), 16-byte accesses where a piece allows them.
constexpr int kMaxPieces = 4;
struct Pieces {
  int count = 0;
  const float* src[kMaxPieces] = {};
  float* dst[kMaxPieces] = {};
  int64_t n[kMaxPieces] = {};
};
// packed = the pieces' src end to end, in bf16 (rounded to nearest, as the backend's weight
// mirror) when packed_bf16, else fp32.
void pack_pieces(const Pieces& p, void* packed, bool packed_bf16, cudaStream_t stream);
// dst[k][i] += packed[off_k + i] (packed fp32; off_k = n[0] + … + n[k−1]; dst[k] null: dropped).
void scatter_add_pieces(const Pieces& p, const float* packed, cudaStream_t stream);

// ---- deterministic column sums ----
// out[j] += Σ_n Σ_{c ∈ [j·group, (j+1)·group)} M[n, c]  (M [N, C] with row stride ld).
std::size_t colsum_scratch_floats(int64_t N, int C);
void colsum_accumulate(const float* M, int64_t N, int C, int64_t ld, int group, float* out, float* scratch,
                       cudaStream_t stream);

// ---- output: per-head RMSNorm (weight wn [width]) × SiLU(og) ----
// rows = N·H rows of `width` channels (a value head; 64 takes the tuned kernels, any other
// width up to 512 a warp per row): o bf16 (the kernel's output); og, ypre, dypre and dog all fp32, or
// all bf16 when act_bf16 (GEMM operands in the backend's act_dtype()); rstd [rows] fp32.
// og (and dog) contiguous [rows, width], or with og_ld > 0 the first og_heads·width columns of
// rows of og_ld elements, a token's og_heads heads each (the layer's GEMM output [P | og]).
void out_gate_forward(int64_t rows, const __nv_bfloat16* o, const void* og, const float* wn, float eps, void* ypre,
                      float* rstd, bool act_bf16, cudaStream_t stream, int og_heads = 0, int64_t og_ld = 0,
                      int width = 64);
// From dypre: dO (bf16, the kernels' dout), dog, and ∂L/∂wn accumulated into dwn [width]
// (per-block partials in scratch, out_gate_backward_scratch_floats(rows, width) floats, then a
// fixed-order sum: no [rows, 64] terms buffer). ypre (may be null): out_gate_forward's
// output again, bit for bit (rstd is the forward's), from the same reads of o and og — the
// backward's recompute of ypre without a pass of its own.
std::size_t out_gate_backward_scratch_floats(int64_t rows, int width = 64);
void out_gate_backward(int64_t rows, const __nv_bfloat16* o, const void* og, const float* wn, const float* rstd,
                       const void* dypre, __nv_bfloat16* dO, void* dog, void* ypre, float* dwn, float* scratch,
                       bool act_bf16, cudaStream_t stream, int og_heads = 0, int64_t og_ld = 0, int width = 64);

// ---- cross-layer routing: the write residual r_t = z_t − S_{t−1}(a_t ⊙ e_t) ----
// The chunk kernels read S_t after the update, so r comes from a second readout of the same
// recurrence with the query shifted one token: qr_s = a_{s+1} ⊙ e_{s+1} (a = exp(g), e = k,
// or b ⊙ k for gdn2; qr_{T−1} = 0) gives o2_s = scale·S_s qr_s, and r_t = z_t − o2_{t−1}/scale.
// Key heads of 64; value heads of dv = 64·m channels (the value side — v, w, o2, r and their
// gradients — is [N, H·dv], the key side — k, qr, b, a channel g — [N, H·64]).
// model.routing_signal: update (β mixers) publishes u_t = β_t·r_t: beta [N, H] set.
struct RouteArgs {
  int64_t B = 0, T = 0;
  int H = 0;
  int dv = 64;
  const __nv_bfloat16 *k = nullptr, *v = nullptr;
  const float* g = nullptr;        // nullable (deltanet)
  bool g_channel = false;          // g [N, H·64] (kda, gdn2) or [N, H] (gdn)
  const __nv_bfloat16 *b = nullptr, *w = nullptr;  // gdn2 (z = w ⊙ v, e = b ⊙ k)
  float scale = 0.125f;
  const float* beta = nullptr;  // nullable: publish β·r (route_residual), dr = β·du (the gradients)
};
void route_query(const RouteArgs& a, __nv_bfloat16* qr, cudaStream_t stream);
// Decode (one token of each sequence: T = 1): qr = a_t ⊙ e_t of the token itself, whose readout
// of the state before the token's update gives o2_{t−1} (r_t = route_residual's z_t − o2_{t−1}/scale).
void route_query_decode(const RouteArgs& a, __nv_bfloat16* qr, cudaStream_t stream);
// r [N, H·dv] fp32 from the second readout o2 (with a.beta: u = β·r, and r itself into
// r_raw when not null — route_backward's ∂L/∂β reads it).
void route_residual(const RouteArgs& a, const __nv_bfloat16* o2, float* r, cudaStream_t stream, float* r_raw = nullptr);
// do2 (bf16) from dr, the gradient on the published r (with a.beta: on u = β·r).
void route_readout_grad(const RouteArgs& a, const float* dr, __nv_bfloat16* do2, cudaStream_t stream);
// The second backward's gradients folded back: ek = dk2 + ∂qr/∂k, ev = dv2 + ∂r/∂ṽ
// (fp32 extras for qkv_backward); dg += dg2 + ∂qr/∂g; dbeta += dbeta2 (nullable);
// gdn2: eb = db2 + ∂qr/∂b, ew = dw2 + ∂r/∂w (fp32 extras for gate_backward). With a.beta,
// dr is on u = β·r: r's gradient is β·dr, and dbeta += Σ_c dr_c·r_c (r: route_residual's r_raw).
struct RouteGrads {
  const float* dr = nullptr;
  const float* r = nullptr;  // a.beta: the unscaled residual [N, H·dv]
  const __nv_bfloat16 *qr = nullptr, *dqr = nullptr, *dk2 = nullptr, *dv2 = nullptr;
  const float *dg2 = nullptr, *dbeta2 = nullptr;
  const __nv_bfloat16 *db2 = nullptr, *dw2 = nullptr;
  float *ek = nullptr, *ev = nullptr, *dg = nullptr, *dbeta = nullptr, *eb = nullptr, *ew = nullptr;
};
void route_backward(const RouteArgs& a, const RouteGrads& g, cudaStream_t stream);

// ---- profiling (LAR_CUDA_PROFILE=1) ----
// Brackets a region of layer work with CUDA events when profiling is on (one branch
// otherwise); layer_profile_report() returns device seconds per name since the last call.
class LayerTimer : public EventProfile::Scope {
 public:
  LayerTimer(const char* name, cudaStream_t stream);
};
std::vector<std::pair<std::string, double>> layer_profile_report();

}  // namespace lar::kernels::cuda::linear
