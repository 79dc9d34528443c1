// The CUDA backend's GEMMs: fp32 / TF32 through cuBLAS, bf16 through cuBLASLt plans cached
// per shape (the heuristic's first choice, a measured table on the H200, or timed candidates
// under cuda.gemm: tune), batched over strided matrices.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include "core/env.hpp"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_backend_internal.hpp"
#include "kernels/cuda/cuda_check.hpp"

namespace lar::kernels::cuda {

// Row-major C[M,N] = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: swap the operands.
void CudaBackend::gemm(const Tensor& A, bool ta, const Tensor& B, bool tb, const Tensor& C, double alpha,
                       double beta) {
  gemm_batched(A, ta, B, tb, C, 1, alpha, beta);
}

// ---- cuBLASLt plans of the bf16 GEMMs ----

namespace {
constexpr std::size_t kLtWorkspace = std::size_t(32) << 20;  // cuBLAS's own default on Hopper
constexpr int kGemmCandidates = 16;                           // heuristic results timed per shape
int64_t ptr_align(const void* p) {  // the pointer's alignment in bytes, capped at 256
  const auto u = reinterpret_cast<uintptr_t>(p);
  int64_t a = 256;
  while (a > 1 && u % static_cast<uintptr_t>(a) != 0) a /= 2;
  return a;
}
// "a<algo>t<tile>s<stages>k<split-K>r<reduction>c<cluster>w<swizzle>o<custom>i<inner shape>": a
// candidate's configuration (LAR_GEMM_LOG).
std::string algo_config(const cublasLtMatmulAlgo_t& algo) {
  auto get = [&](cublasLtMatmulAlgoConfigAttributes_t attr) -> long {
    uint64_t v = 0;  // every attribute fits; the size written says how many bytes
    std::size_t n = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, nullptr, 0, &n) != CUBLAS_STATUS_SUCCESS || n > sizeof v)
      return -1;
    if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, n, &n) != CUBLAS_STATUS_SUCCESS) return -1;
    return static_cast<long>(v);
  };
  char buf[128];
  std::snprintf(buf, sizeof buf, "a%ldt%lds%ldk%ldr%ldc%ldw%ldo%ldi%ld", get(CUBLASLT_ALGO_CONFIG_ID),
                get(CUBLASLT_ALGO_CONFIG_TILE_ID), get(CUBLASLT_ALGO_CONFIG_STAGES_ID),
                get(CUBLASLT_ALGO_CONFIG_SPLITK_NUM), get(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
                get(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID), get(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
                get(CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION), get(CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID));
  return buf;
}
}  // namespace

// Measured on the H200 (cuda.gemm: tune, LAR_GEMM_LOG=1, in the 344M GDN step at B·T = 32768;
// dev/perf-history.md, "Training step: GEMM choice, norms, memory"): shapes whose fastest heuristic candidate beat the
// first one by ≥ 2% (mean over the layers timed), and the prefix of that candidate's
// configuration (algo_config: algorithm, tile, stages, split-K, reduction, cluster). flags: 1 A
// transposed, 2 B transposed, 4 C bf16, 8 β ≠ 0. A fixed table instead of timing at run time
// keeps the choice — and the bits — the same in every process (resume and deterministic runs
// repeat them). The µs: first candidate → this one, per call (mean over layers). Elsewhere,
// and where the heuristic does not offer the configuration, its first choice runs. (The LM
// head's forward, 806 → 760 µs when timed alone, ran no faster in the step: left out.)
struct GemmPref {
  int64_t M, N, K;
  int64_t flags;
  const char* config;
};
constexpr GemmPref kH200Gemms[] = {
    {32768, 5632, 1024, 6, "a66t201s35k1r0c5"},   // FFN gate·up: 527 → 486
    {32768, 3072, 1024, 6, "a66t29s35k1r0c3"},    // q·k·v projection: 290 → 266
    {32768, 2816, 1024, 4, "a66t29s35k1r0c3"},    // FFN ∂hidden: 276 → 251
    {32768, 1024, 2816, 6, "a66t20s35k1r0c3"},    // FFN down: 265 → 258
    {32768, 1024, 1024, 6, "a66t201s35k1r0c5"},   // W_g, W_o forward: 103 → 96
    {32768, 1024, 1024, 4, "a66t29s35k1r0c3"},    // ∂x through W_g / W_o: 112 → 102
    {32768, 1024, 3072, 12, "a66t20s35k1r0c3"},   // ∂x += ∂P·W_qkv: 303 → 288
    {32768, 1024, 32, 12, "a66t33s35k1r0c5"},     // ∂x += ∂(β,a)·W_βa: 54 → 52
    {32768, 32, 1024, 2, "a66t14s35k1r0c5"},      // (β, a) projection: 23 → 21
    {32000, 1024, 8388, 9, "a66t24s35k1r0c5"},    // ∂W_head: 742 → 712
    {32000, 1024, 7604, 9, "a66t24s35k1r0c5"},    // ∂W_head, last chunk: 664 → 642
    {8388, 1024, 32000, 4, "a66t24s35k1r0c5"},    // ∂xn_f through the head: 676 → 647
};

const char* CudaBackend::gemm_mode() const {
  return gemm_mode_ == GemmMode::tune ? "tune" : gemm_mode_ == GemmMode::heuristic ? "heuristic" : "cublas";
}

void CudaBackend::gemm_lt(GemmPlan& plan, const void* lt_a, const void* lt_b, void* c, float alpha, float beta) {
  LAR_CUBLAS_CHECK(cublasLtMatmul(lt_, plan.desc, &alpha, lt_a, plan.la, lt_b, plan.lb, &beta, c, plan.lc, c, plan.lc,
                                  &plan.algo, lt_workspace_, plan.workspace, stream_));
}

// The plan of a GEMM given in cuBLAS's column-major terms (Lt's A = our B, Lt's B = our A;
// see gemm_batched). Built at the first use of its key: the heuristic's candidates for the
// operands' actual alignment, and in mode tune each of them timed (one warm-up and three
// runs on the real operands; output into C itself when β = 0, else into a scratch copy of
// C's size, freed after) and the fastest kept. Deterministic runs never time: the
// heuristic's first choice depends only on the shape, so a run repeats its bits.
CudaBackend::GemmPlan& CudaBackend::gemm_plan(const GemmKey& key, const void* a, const void* b, void* c,
                                              bool c_bf16, float alpha, float beta) {
  auto it = gemm_plans_.find(key);
  if (it != gemm_plans_.end()) return *it->second;
  const int64_t M = key[0], N = key[1], K = key[2], batches = key[3], flags = key[4];
  const bool ta = flags & 1, tb = flags & 2;
  const int64_t lda = key[5], ldb = key[6], ldc = key[7], sa = key[8], sb = key[9], sc = key[10];
  auto plan = std::make_unique<GemmPlan>();
  GemmPlan& p = *plan;
  gemm_plans_.emplace(key, std::move(plan));
  if (!lt_workspace_) {
    LAR_CUDA_CHECK(cudaMalloc(&lt_workspace_, kLtWorkspace));
    track_alloc(lt_workspace_, kLtWorkspace);
    // The legacy handle shares it (same stream, one GEMM at a time).
    LAR_CUBLAS_CHECK(cublasSetWorkspace(cublas_, lt_workspace_, kLtWorkspace));
  }
  const cublasOperation_t opa = tb ? CUBLAS_OP_T : CUBLAS_OP_N, opb = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  LAR_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  LAR_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)));
  LAR_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)));
  // Column-major: Lt's A is our B (N×K, or K×N stored when transposed), B is our A, C is Cᵀ.
  auto layout = [&](cublasLtMatrixLayout_t* l, cudaDataType_t t, int64_t rows, int64_t cols, int64_t ld,
                    int64_t stride) {
    LAR_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(l, t, static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), ld));
    if (batches > 1) {
      const int32_t nb = static_cast<int32_t>(batches);
      LAR_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &nb, sizeof(nb)));
      LAR_CUBLAS_CHECK(
          cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
    }
  };
  layout(&p.la, CUDA_R_16BF, tb ? K : N, tb ? N : K, ldb, sb);
  layout(&p.lb, CUDA_R_16BF, ta ? M : K, ta ? K : M, lda, sa);
  layout(&p.lc, c_bf16 ? CUDA_R_16BF : CUDA_R_32F, N, M, ldc, sc);
  cublasLtMatmulPreference_t pref = nullptr;
  LAR_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = kLtWorkspace;
  LAR_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  const uint32_t al_a = static_cast<uint32_t>(key[11]), al_b = static_cast<uint32_t>(key[12]),
                 al_c = static_cast<uint32_t>(key[13]);
  LAR_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a)));
  LAR_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b)));
  LAR_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c)));
  LAR_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof(al_c)));
  cublasLtMatmulHeuristicResult_t res[kGemmCandidates] = {};
  int found = 0;
  const cublasStatus_t hs =
      cublasLtMatmulAlgoGetHeuristic(lt_, p.desc, p.la, p.lb, p.lc, p.lc, pref, kGemmCandidates, res, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (hs != CUBLAS_STATUS_SUCCESS || found == 0 || res[0].state != CUBLAS_STATUS_SUCCESS) return p;  // legacy call
  struct Cand {
    cublasLtMatmulAlgo_t algo;
    std::size_t workspace;
    std::string config;
  };
  std::vector<Cand> cands;
  for (int i = 0; i < found; ++i)
    if (res[i].state == CUBLAS_STATUS_SUCCESS) cands.push_back({res[i].algo, res[i].workspaceSize, algo_config(res[i].algo)});
  // A configuration built directly (algorithm + attributes; mode tune), kept when cuBLASLt
  // accepts it for these operands (cublasLtMatmulAlgoCheck) and its workspace fits.
  auto build = [&](const std::string& config) -> bool {
    long a = 0, t = 0, st = 0, k = 0, r = 0, c = 0, w = 0, o = 0, in = 0;
    if (std::sscanf(config.c_str(), "a%ldt%lds%ldk%ldr%ldc%ldw%ldo%ldi%ld", &a, &t, &st, &k, &r, &c, &w, &o, &in) != 9)
      return false;
    for (const Cand& x : cands)
      if (x.config == config) return true;
    Cand x{};
    const cudaDataType_t ct = c_bf16 ? CUDA_R_16BF : CUDA_R_32F;
    if (cublasLtMatmulAlgoInit(lt_, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, ct, ct,
                               static_cast<int>(a), &x.algo) != CUBLAS_STATUS_SUCCESS)
      return false;
    const uint32_t tile = static_cast<uint32_t>(t), stages = static_cast<uint32_t>(st), red = static_cast<uint32_t>(r),
                   swz = static_cast<uint32_t>(w), custom = static_cast<uint32_t>(o);
    const int32_t split = static_cast<int32_t>(k);
    const uint16_t cluster = static_cast<uint16_t>(c), inner = static_cast<uint16_t>(in);
    auto set = [&](cublasLtMatmulAlgoConfigAttributes_t attr, const void* v, std::size_t n) {
      return cublasLtMatmulAlgoConfigSetAttribute(&x.algo, attr, v, n) == CUBLAS_STATUS_SUCCESS;
    };
    if (!set(CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile) || !set(CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof stages) ||
        !set(CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split, sizeof split) ||
        !set(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &red, sizeof red) ||
        !set(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swz, sizeof swz) ||
        !set(CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &custom, sizeof custom) ||
        !set(CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, &inner, sizeof inner) ||
        !set(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof cluster))
      return false;
    cublasLtMatmulHeuristicResult_t chk{};
    if (cublasLtMatmulAlgoCheck(lt_, p.desc, p.la, p.lb, p.lc, p.lc, &x.algo, &chk) != CUBLAS_STATUS_SUCCESS ||
        chk.state != CUBLAS_STATUS_SUCCESS || chk.workspaceSize > kLtWorkspace)
      return false;
    x.workspace = chk.workspaceSize;
    x.config = algo_config(x.algo);
    cands.push_back(x);
    return true;
  };
  std::size_t best = 0;
  if (gemm_mode_ == GemmMode::heuristic && h200_ && batches == 1) {
    // A measured preference for this shape (kH200Gemms): the heuristic's candidate with that
    // configuration, when it offers one for these operands; else its first choice.
    for (const GemmPref& g : kH200Gemms) {
      if (g.M != M || g.N != N || g.K != K || g.flags != (flags & 15)) continue;
      const std::string want = std::string(g.config) + "w";
      for (std::size_t i = cands.size(); i-- > 0;)
        if (cands[i].config.rfind(want, 0) == 0) best = i;
    }
  }
  if (gemm_mode_ == GemmMode::heuristic && env_flag("LAR_GEMM_LOG"))
    std::fprintf(stderr, "gemm plan %lldx%lldx%lld b%lld %c%c %s β%s: #%zu %s of %zu\n", static_cast<long long>(M),
                 static_cast<long long>(N), static_cast<long long>(K), static_cast<long long>(batches), ta ? 'T' : 'N',
                 tb ? 'T' : 'N', c_bf16 ? "bf16" : "f32", beta != 0.f ? "1" : "0", best, cands[best].config.c_str(),
                 cands.size());
  if (gemm_mode_ == GemmMode::tune) {
    // Beyond the heuristic's list: each of its tiles (with its stages, split-K, reduction) in
    // other thread-block-cluster shapes and with CTA swizzling on and off.
    const std::size_t heur = cands.size();
    for (std::size_t i = 0; i < heur; ++i) {
      long a = 0, t = 0, st = 0, k = 0, r = 0, c = 0, w = 0, o = 0, in = 0;
      std::sscanf(cands[i].config.c_str(), "a%ldt%lds%ldk%ldr%ldc%ldw%ldo%ldi%ld", &a, &t, &st, &k, &r, &c, &w, &o, &in);
      for (long cl : {2L, 3L, 5L, 6L, 4L, 8L})
        for (long sw : {0L, 1L}) {
          char cfg[128];
          std::snprintf(cfg, sizeof cfg, "a%ldt%lds%ldk%ldr%ldc%ldw%ldo%ldi%ld", a, t, st, k, r, cl, sw, o, in);
          build(cfg);
        }
    }
    // β ≠ 0 reads C: time into scratch of C's size so that C is not accumulated twice.
    const std::size_t c_bytes =
        static_cast<std::size_t>((batches > 1 ? sc * (batches - 1) : 0) + ldc * (M - 1) + N) * (c_bf16 ? 2 : 4);
    void* out = c;
    if (beta != 0.f) {
      LAR_CUDA_CHECK(cudaMalloc(&out, c_bytes));
      track_alloc(out, c_bytes);
    }
    cudaEvent_t e0, e1;
    LAR_CUDA_CHECK(cudaEventCreate(&e0));
    LAR_CUDA_CHECK(cudaEventCreate(&e1));
    std::vector<float> ms(cands.size(), -1.f);
    float best_ms = -1.f;
    for (std::size_t i = 0; i < cands.size(); ++i) {
      auto launch = [&] {
        return cublasLtMatmul(lt_, p.desc, &alpha, b, p.la, a, p.lb, &beta, out, p.lc, out, p.lc, &cands[i].algo,
                              lt_workspace_, cands[i].workspace, stream_);
      };
      if (launch() != CUBLAS_STATUS_SUCCESS) continue;
      LAR_CUDA_CHECK(cudaEventRecord(e0, stream_));
      for (int r = 0; r < 3; ++r) LAR_CUBLAS_CHECK(launch());
      LAR_CUDA_CHECK(cudaEventRecord(e1, stream_));
      LAR_CUDA_CHECK(cudaEventSynchronize(e1));
      LAR_CUDA_CHECK(cudaEventElapsedTime(&ms[i], e0, e1));
      ms[i] /= 3;
      if (best_ms < 0 || ms[i] < best_ms) best = i, best_ms = ms[i];
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    if (out != c) {
      synchronize();
      track_free(out);
      LAR_CUDA_CHECK(cudaFree(out));
    }
    if (best_ms < 0) best = 0;
    if (env_flag("LAR_GEMM_LOG")) {  // every candidate: its configuration and µs (#0 … heuristic's, then built)
      std::string all;
      for (std::size_t i = 0; i < cands.size(); ++i) {
        char t[32];
        std::snprintf(t, sizeof t, ":%.1f ", 1e3 * ms[i]);
        all += (i == heur ? "| " : "") + cands[i].config + t;
      }
      std::fprintf(stderr, "gemm tune %lldx%lldx%lld b%lld %c%c %s β%s: heuristic %.1f us, chosen #%zu %s %.1f us | %s\n",
                   static_cast<long long>(M), static_cast<long long>(N), static_cast<long long>(K),
                   static_cast<long long>(batches), ta ? 'T' : 'N', tb ? 'T' : 'N', c_bf16 ? "bf16" : "f32",
                   beta != 0.f ? "1" : "0", 1e3 * ms[0], best, cands[best].config.c_str(), 1e3 * ms[best], all.c_str());
    }
  }
  p.algo = cands[best].algo;
  p.workspace = cands[best].workspace;
  p.usable = true;
  return p;
}

void CudaBackend::gemm_batched(const Tensor& A, bool ta, const Tensor& B, bool tb, const Tensor& C,
                               int64_t batches, double alpha, double beta) {
  int64_t M = C.rows() / batches, N = C.last();
  int64_t K = ta ? A.rows() / batches : A.last();
  int64_t a_rows = A.rows() / batches, b_rows = B.rows() / batches;
  const char* prof_name = "gemm";
  if (profile_) {  // one profile row per shape and role
    char buf[160];
    std::snprintf(buf, sizeof buf, "gemm %lldx%lldx%lld%s %c%c β=%g →%s", static_cast<long long>(M),
                  static_cast<long long>(N), static_cast<long long>(K),
                  batches > 1 ? (" ×" + std::to_string(batches)).c_str() : "", ta ? 'T' : 'N', tb ? 'T' : 'N', beta,
                  is_bf16(C) ? "bf16" : "f32");
    prof_name = prof_names_.insert(buf).first->c_str();
    GemmStat& st = gemm_stats_[prof_name];
    st.calls += 1;
    st.flops += 2.0 * M * N * K * batches;
  }
  OpTimer timer(*this, prof_name);
  if ((ta ? A.last() : a_rows) != M || (tb ? b_rows : B.last()) != N || (tb ? B.last() : b_rows) != K)
    throw RuntimeError("cuda gemm: shapes " + A.shape_str() + (ta ? "ᵀ" : "") + " · " + B.shape_str() +
                       (tb ? "ᵀ" : "") + " → " + C.shape_str() + " do not match");
  touch(C);
  float fa = static_cast<float>(alpha), fb = static_cast<float>(beta);
  int lda = static_cast<int>(A.last()), ldb = static_cast<int>(B.last()), ldc = static_cast<int>(N);
  if (!mixed_ || !bf16_gemm_) {
    require_f32(A, "gemm A");
    require_f32(B, "gemm B");
    require_f32(C, "gemm C");
  }
  if (!mixed_) {
    LAR_CUBLAS_CHECK(cublasSgemmStridedBatched(
        cublas_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(N),
        static_cast<int>(M), static_cast<int>(K), &fa, B.ptr<float>(), ldb, b_rows * B.last(), A.ptr<float>(),
        lda, a_rows * A.last(), &fb, C.ptr<float>(), ldc, M * N, static_cast<int>(batches)));
    return;
  }
  if (bf16_gemm_) {
    // bf16 tensor-core products with fp32 accumulation; C in f32 or bf16. bf16 operands
    // are used as they are, weights through the bf16 mirror (refreshed once per
    // optimiser step), any other f32 operand is rounded into gemm scratch first.
    require_act(C, "gemm C");
    auto scratch_need = [&](const Tensor& t) -> std::size_t {
      if (t.dtype == DType::bf16) return 0;
      const char* p = static_cast<const char*>(t.data);
      if (mirror_ && p >= weights_ && p + t.bytes() <= weights_ + weights_bytes_) return 0;
      return (t.numel() * 2 + 255) / 256 * 256;
    };
    const std::size_t na = scratch_need(A), nb = scratch_need(B);
    if (na + nb > gemm_scratch_n_) {
      if (gemm_scratch_) {
        synchronize();
        track_free(gemm_scratch_);
        LAR_CUDA_CHECK(cudaFree(gemm_scratch_));
      }
      gemm_scratch_n_ = na + nb;
      LAR_CUDA_CHECK(cudaMalloc(&gemm_scratch_, gemm_scratch_n_));
      track_alloc(gemm_scratch_, gemm_scratch_n_);
    }
    const void* ab = gemm_operand(A, 0);
    const void* bb = gemm_operand(B, na);
    if (M > 0 && N > 0 && K > 0 && gemm_mode_ != GemmMode::cublas) {
      const bool one = batches == 1;
      const GemmKey key{M, N, K, batches, (ta ? 1 : 0) | (tb ? 2 : 0) | (is_bf16(C) ? 4 : 0) | (fb != 0.f ? 8 : 0),
                        lda, ldb, ldc, one ? 0 : a_rows * A.last(), one ? 0 : b_rows * B.last(), one ? 0 : M * N,
                        ptr_align(bb), ptr_align(ab), ptr_align(C.data)};
      GemmPlan& plan = gemm_plan(key, ab, bb, C.data, is_bf16(C), fa, fb);
      if (plan.usable) {
        gemm_lt(plan, bb, ab, C.data, fa, fb);
        return;
      }
    }
    LAR_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
        cublas_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(N),
        static_cast<int>(M), static_cast<int>(K), &fa, bb, CUDA_R_16BF, ldb, b_rows * B.last(), ab, CUDA_R_16BF,
        lda, a_rows * A.last(), &fb, C.data, is_bf16(C) ? CUDA_R_16BF : CUDA_R_32F, ldc, M * N,
        static_cast<int>(batches), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return;
  }
  // fp32 tensors, TF32 tensor-core products, fp32 accumulation and output.
  LAR_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      cublas_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(N),
      static_cast<int>(M), static_cast<int>(K), &fa, B.data, CUDA_R_32F, ldb, b_rows * B.last(), A.data, CUDA_R_32F,
      lda, a_rows * A.last(), &fb, C.data, CUDA_R_32F, ldc, M * N, static_cast<int>(batches),
      CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT));
}

}  // namespace lar::kernels::cuda
