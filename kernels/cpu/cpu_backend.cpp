#include "kernels/cpu/cpu_backend.hpp"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "core/error.hpp"

namespace lar::kernels::cpu {

namespace {

// OpenBLAS's own thread pool would fight ours for the two cores: keep it at one thread.
extern "C" void openblas_set_num_threads(int);

void check_dtype(const Tensor& t, DType want, const char* what) {
  if (t.dtype != want)
    throw RuntimeError(std::string("cpu backend: ") + what + " has dtype " + to_string(t.dtype) +
                       ", expected " + to_string(want));
}

// [begin, end) of part `i` of `parts` over n items.
inline void part_range(int64_t n, int parts, int i, int64_t& b, int64_t& e) {
  b = n * i / parts;
  e = n * (i + 1) / parts;
}

// Adds the lifetime of the object to a seconds counter.
struct Timer {
  double& acc;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  explicit Timer(double& a) : acc(a) {}
  ~Timer() { acc += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); }
};

}  // namespace

// exp for fp32 in a form the compiler vectorises (Cody–Waite range reduction + the
// Cephes degree-6 polynomial, ≈1 ulp on [−87, 88]; inputs below −87 give ≈0). The fp64
// path keeps std::exp: it is the reference that the gradient checks use.
float fast_expf(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  // Round to nearest by the 1.5·2²³ trick (SSE2-vectorisable, unlike floor).
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, 4);
  return y * scale;
}

namespace {

// x[j] = exp(x[j] − shift) for j in [0, n).
inline void exp_shifted(float* x, int64_t n, float shift) {
  for (int64_t j = 0; j < n; ++j) x[j] = fast_expf(x[j] - shift);
}
inline void exp_shifted(double* x, int64_t n, double shift) {
  for (int64_t j = 0; j < n; ++j) x[j] = std::exp(x[j] - shift);
}
inline float exp_t(float x) { return fast_expf(x); }
inline double exp_t(double x) { return std::exp(x); }

template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::f32; }
template <> constexpr DType dtype_of<double>() { return DType::f64; }

}  // namespace

template <>
void gemm_raw<float>(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda,
                     const float* B, int ldb, float beta, float* C, int ldc) {
  if (M <= 0 || N <= 0) return;
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, alpha,
              A, lda, B, ldb, beta, C, ldc);
}

template <>
void gemm_raw<double>(bool ta, bool tb, int M, int N, int K, double alpha, const double* A, int lda,
                      const double* B, int ldb, double beta, double* C, int ldc) {
  if (M <= 0 || N <= 0) return;
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, alpha,
              A, lda, B, ldb, beta, C, ldc);
}

template <class T>
CpuBackend<T>::CpuBackend(int threads) : threads_(std::max(1, threads)) {
  openblas_set_num_threads(1);
}

template <class T>
DType CpuBackend<T>::dtype() const { return dtype_of<T>(); }

template <class T>
std::string CpuBackend<T>::name() const {
  return std::string("cpu-") + to_string(dtype()) + " (" + std::to_string(threads_) + " threads)";
}

template <class T>
void* CpuBackend<T>::alloc_bytes(std::size_t bytes) {
  std::size_t n = (std::max<std::size_t>(bytes, 1) + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, n);
  if (!p) throw RuntimeError("out of memory allocating " + std::to_string(bytes) + " bytes");
  return p;
}

template <class T>
void CpuBackend<T>::free_bytes(void* p) { std::free(p); }

template <class T>
void CpuBackend<T>::upload(const void* host, const Tensor& dst) { std::memcpy(dst.data, host, dst.bytes()); }

template <class T>
void CpuBackend<T>::download(const Tensor& src, void* host) { std::memcpy(host, src.data, src.bytes()); }

template <class T>
void CpuBackend<T>::zero(const Tensor& t) { std::memset(t.data, 0, t.bytes()); }

template <class T>
void CpuBackend<T>::fill(const Tensor& t, double value) {
  check_dtype(t, dtype(), "fill");
  std::fill_n(t.ptr<T>(), t.numel(), static_cast<T>(value));
}

template <class T>
void CpuBackend<T>::copy(const Tensor& src, const Tensor& dst) {
  if (src.numel() != dst.numel() || src.dtype != dst.dtype)
    throw RuntimeError("copy: " + src.shape_str() + " → " + dst.shape_str());
  std::memcpy(dst.data, src.data, src.bytes());
}

// ---- GEMM ----

template <class T>
void CpuBackend<T>::gemm(const Tensor& A, bool ta, const Tensor& B, bool tb, const Tensor& C, double alpha,
                         double beta) {
  check_dtype(A, dtype(), "gemm A");
  check_dtype(B, dtype(), "gemm B");
  check_dtype(C, dtype(), "gemm C");
  const int64_t ar = A.rows(), ac = A.last(), br = B.rows(), bc = B.last();
  const int M = static_cast<int>(ta ? ac : ar), K = static_cast<int>(ta ? ar : ac);
  const int N = static_cast<int>(tb ? br : bc), KB = static_cast<int>(tb ? bc : br);
  if (K != KB || C.rows() != M || C.last() != N)
    throw RuntimeError("gemm: shapes " + A.shape_str() + (ta ? "ᵀ" : "") + " · " + B.shape_str() +
                       (tb ? "ᵀ" : "") + " → " + C.shape_str());
  auto t0 = std::chrono::steady_clock::now();
  const T* a = A.ptr<T>();
  const T* b = B.ptr<T>();
  T* c = C.ptr<T>();
  const int lda = static_cast<int>(ac), ldb = static_cast<int>(bc);
  // Split the larger output dimension across threads (each part is one BLAS call).
  const int parts = (static_cast<int64_t>(M) * N * K < (1 << 18)) ? 1 : threads_;
  const bool split_m = M >= N;
#pragma omp parallel for num_threads(parts) schedule(static, 1) if (parts > 1)
  for (int p = 0; p < parts; ++p) {
    int64_t s, e;
    if (split_m) {
      part_range(M, parts, p, s, e);
      const T* ap = ta ? a + s : a + s * lda;
      gemm_raw<T>(ta, tb, static_cast<int>(e - s), N, K, T(alpha), ap, lda, b, ldb, T(beta), c + s * N, N);
    } else {
      part_range(N, parts, p, s, e);
      const T* bp = tb ? b + s * ldb : b + s;
      gemm_raw<T>(ta, tb, M, static_cast<int>(e - s), K, T(alpha), a, lda, bp, ldb, T(beta), c + s, N);
    }
  }
  gemm_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

template <class T>
void CpuBackend<T>::gemm_batched(const Tensor& A, bool ta, const Tensor& B, bool tb, const Tensor& C,
                                 int64_t batches, double alpha, double beta) {
  check_dtype(A, dtype(), "gemm_batched A");
  check_dtype(B, dtype(), "gemm_batched B");
  check_dtype(C, dtype(), "gemm_batched C");
  if (batches <= 0 || A.numel() % batches || B.numel() % batches || C.numel() % batches)
    throw RuntimeError("gemm_batched: bad batch count");
  const int64_t ac = A.last(), ar = A.numel() / batches / ac;
  const int64_t bc = B.last(), br = B.numel() / batches / bc;
  const int M = static_cast<int>(ta ? ac : ar), K = static_cast<int>(ta ? ar : ac);
  const int N = static_cast<int>(tb ? br : bc);
  if ((tb ? bc : br) != K || C.last() != N || C.numel() / batches != static_cast<int64_t>(M) * N)
    throw RuntimeError("gemm_batched: shapes " + A.shape_str() + " · " + B.shape_str() + " → " + C.shape_str());
  auto t0 = std::chrono::steady_clock::now();
  const int64_t sa = ar * ac, sb = br * bc, sc = static_cast<int64_t>(M) * N;
#pragma omp parallel for num_threads(nt(int64_t(batches * M * N * K))) schedule(static)
  for (int64_t i = 0; i < batches; ++i)
    gemm_raw<T>(ta, tb, M, N, K, T(alpha), A.ptr<T>() + i * sa, static_cast<int>(ac), B.ptr<T>() + i * sb,
                static_cast<int>(bc), T(beta), C.ptr<T>() + i * sc, N);
  gemm_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

template <class T>
void CpuBackend<T>::axpy(double alpha, const Tensor& x, const Tensor& y) {
  if (x.numel() != y.numel()) throw RuntimeError("axpy: " + x.shape_str() + " vs " + y.shape_str());
  const T* xp = x.ptr<T>();
  T* yp = y.ptr<T>();
  const T a = static_cast<T>(alpha);
  const int64_t n = x.numel();
#pragma omp parallel for num_threads(nt(n)) schedule(static)
  for (int64_t i = 0; i < n; ++i) yp[i] += a * xp[i];
}

template <class T>
double CpuBackend<T>::sum_squares(const Tensor& x) {
  // Fixed blocks, partial sums in double, summed in block order: independent of threads.
  const T* p = x.ptr<T>();
  const int64_t n = x.numel(), blk = 1 << 16, nb = (n + blk - 1) / blk;
  std::vector<double> part(nb, 0.0);
#pragma omp parallel for num_threads(nt(int64_t(n))) schedule(static)
  for (int64_t b = 0; b < nb; ++b) {
    double s = 0;
    for (int64_t i = b * blk, e = std::min(n, (b + 1) * blk); i < e; ++i) s += double(p[i]) * double(p[i]);
    part[b] = s;
  }
  double s = 0;
  for (double v : part) s += v;
  return s;
}

template <class T>
bool CpuBackend<T>::all_finite(const Tensor& x) {
  const T* p = x.ptr<T>();
  const int64_t n = x.numel();
  int bad = 0;
#pragma omp parallel for num_threads(nt(int64_t(n))) schedule(static) reduction(| : bad)
  for (int64_t i = 0; i < n; ++i) bad |= !std::isfinite(p[i]);
  return !bad;
}

// ---- embedding ----

template <class T>
void CpuBackend<T>::embedding_fwd(const Tensor& ids, const Tensor& table, const Tensor& out) {
  check_dtype(ids, DType::i32, "embedding ids");
  const int64_t n = ids.numel(), d = table.last(), V = table.rows();
  const int32_t* id = ids.ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i)
    if (id[i] < 0 || id[i] >= V)
      throw RuntimeError("token id " + std::to_string(id[i]) + " outside the vocabulary (" + std::to_string(V) + ")");
  const T* tp = table.ptr<T>();
  T* op = out.ptr<T>();
#pragma omp parallel for num_threads(nt(int64_t(n * d))) schedule(static)
  for (int64_t i = 0; i < n; ++i) std::memcpy(op + i * d, tp + int64_t(id[i]) * d, d * sizeof(T));
}

template <class T>
void CpuBackend<T>::embedding_bwd(const Tensor& ids, const Tensor& dout, const Tensor& dtable) {
  // Rows can repeat, so split the columns: each thread owns a column range of all rows.
  const int64_t n = ids.numel(), d = dtable.last();
  const int32_t* id = ids.ptr<int32_t>();
  const T* gp = dout.ptr<T>();
  T* tp = dtable.ptr<T>();
#pragma omp parallel num_threads(nt(int64_t(n * d)))
  {
    int64_t c0, c1;
    part_range(d, omp_get_num_threads(), omp_get_thread_num(), c0, c1);
    for (int64_t i = 0; i < n; ++i) {
      T* row = tp + int64_t(id[i]) * d;
      const T* g = gp + i * d;
      for (int64_t c = c0; c < c1; ++c) row[c] += g[c];
    }
  }
}

// ---- RMSNorm ----

template <class T>
void CpuBackend<T>::rmsnorm_fwd(const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& rstd,
                                double eps) {
  const int64_t n = x.rows(), d = x.last();
  const T* xp = x.ptr<T>();
  const T* wp = w.ptr<T>();
  T* yp = y.ptr<T>();
  T* rp = rstd.ptr<T>();
#pragma omp parallel for num_threads(nt(int64_t(n * d))) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const T* xr = xp + i * d;
    double ss = 0;
    for (int64_t c = 0; c < d; ++c) ss += double(xr[c]) * double(xr[c]);
    const T r = static_cast<T>(1.0 / std::sqrt(ss / double(d) + eps));
    rp[i] = r;
    T* yr = yp + i * d;
    for (int64_t c = 0; c < d; ++c) yr[c] = xr[c] * r * wp[c];
  }
}

template <class T>
void CpuBackend<T>::rmsnorm_bwd(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                                const Tensor& dx, const Tensor& dw) {
  // y = x·r·w, r = (mean x² + eps)^(-1/2):
  //   dx = r·(dy⊙w) − x·r³·mean((dy⊙w)⊙x);  dw = Σ_rows dy⊙x·r.
  // dw is reduced over a fixed number of row chunks, then summed in chunk order.
  const int64_t n = x.rows(), d = x.last();
  const T* xp = x.ptr<T>();
  const T* wp = w.ptr<T>();
  const T* rp = rstd.ptr<T>();
  const T* gp = dy.ptr<T>();
  T* dxp = dx.ptr<T>();
  const int chunks = static_cast<int>(std::min<int64_t>(n, 16));
  std::vector<T> dw_part(static_cast<std::size_t>(chunks) * d, T(0));
#pragma omp parallel for num_threads(nt(int64_t(n * d))) schedule(static)
  for (int ch = 0; ch < chunks; ++ch) {
    int64_t s, e;
    part_range(n, chunks, ch, s, e);
    T* dwp = dw_part.data() + int64_t(ch) * d;
    for (int64_t i = s; i < e; ++i) {
      const T* xr = xp + i * d;
      const T* gr = gp + i * d;
      const T r = rp[i];
      double dot = 0;
      for (int64_t c = 0; c < d; ++c) dot += double(gr[c]) * double(wp[c]) * double(xr[c]);
      const T k = static_cast<T>(dot / double(d)) * r * r * r;
      T* dr = dxp + i * d;
      for (int64_t c = 0; c < d; ++c) {
        dr[c] += r * gr[c] * wp[c] - xr[c] * k;
        dwp[c] += gr[c] * xr[c] * r;
      }
    }
  }
  T* dwo = dw.ptr<T>();
  for (int ch = 0; ch < chunks; ++ch)
    for (int64_t c = 0; c < d; ++c) dwo[c] += dw_part[int64_t(ch) * d + c];
}

// ---- SwiGLU ----

template <class T>
void CpuBackend<T>::swiglu_fwd(const Tensor& gu, const Tensor& h) {
  const int64_t n = h.rows(), F = h.last();
  if (gu.last() != 2 * F || gu.rows() != n) throw RuntimeError("swiglu: " + gu.shape_str() + " → " + h.shape_str());
  const T* g = gu.ptr<T>();
  T* hp = h.ptr<T>();
#pragma omp parallel for num_threads(nt(int64_t(n * F))) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const T* gr = g + i * 2 * F;
    const T* ur = gr + F;
    T* hr = hp + i * F;
    for (int64_t c = 0; c < F; ++c) {
      const T a = gr[c];
      hr[c] = a / (T(1) + exp_t(-a)) * ur[c];
    }
  }
}

template <class T>
void CpuBackend<T>::swiglu_bwd(const Tensor& gu, const Tensor& dh, const Tensor& dgu) {
  const int64_t n = dh.rows(), F = dh.last();
  const T* g = gu.ptr<T>();
  const T* dp = dh.ptr<T>();
  T* out = dgu.ptr<T>();
#pragma omp parallel for num_threads(nt(int64_t(n * F))) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const T* gr = g + i * 2 * F;
    const T* ur = gr + F;
    const T* dr = dp + i * F;
    T* og = out + i * 2 * F;
    T* ou = og + F;
    for (int64_t c = 0; c < F; ++c) {
      const T a = gr[c], u = ur[c];
      const T s = T(1) / (T(1) + exp_t(-a));
      const T silu = a * s;
      og[c] = dr[c] * u * s * (T(1) + a * (T(1) - s));
      ou[c] = dr[c] * silu;
    }
  }
}

// ---- RoPE ----

template <class T>
void CpuBackend<T>::rope(const Tensor& x, double base, int64_t pos0, double sign) {
  rope_heads(x.ptr<T>(), x.size(0), x.size(1), x.size(2), 0, x.size(2), x.size(3), base, pos0, sign);
}

template <class T>
void CpuBackend<T>::rope_heads(T* p, int64_t B, int64_t Tn, int64_t Htot, int64_t h0, int64_t nh, int64_t D,
                               double base, int64_t pos0, double sign) {
  const int64_t half = D / 2;
  if (D % 2) throw RuntimeError("rope: odd head dim " + std::to_string(D));
  std::vector<T> cs(Tn * half), sn(Tn * half);
  for (int64_t t = 0; t < Tn; ++t)
    for (int64_t i = 0; i < half; ++i) {
      const double ang = double(pos0 + t) * std::pow(base, -2.0 * double(i) / double(D));
      cs[t * half + i] = static_cast<T>(std::cos(ang));
      sn[t * half + i] = static_cast<T>(sign * std::sin(ang));
    }
#pragma omp parallel for num_threads(nt(int64_t(B * Tn * nh * D))) schedule(static)
  for (int64_t bt = 0; bt < B * Tn; ++bt) {
    const int64_t t = bt % Tn;
    const T* c = cs.data() + t * half;
    const T* s = sn.data() + t * half;
    for (int64_t h = h0; h < h0 + nh; ++h) {
      T* r = p + (bt * Htot + h) * D;
      for (int64_t i = 0; i < half; ++i) {
        const T a = r[i], b = r[i + half];
        r[i] = a * c[i] - b * s[i];
        r[i + half] = b * c[i] + a * s[i];
      }
    }
  }
}

namespace {
// Checks q [B,T,Hq,D], k and v [B,T,Hkv,D] against qkv [B,T,Hq+2·Hkv,D].
void check_qkv(const Tensor& qkv, const Tensor& q, const Tensor& k, const Tensor& v) {
  if (q.ndim != 4 || k.ndim != 4 || v.ndim != 4 || k.shape() != v.shape() || q.size(3) != k.size(3) ||
      q.size(0) != k.size(0) || q.size(1) != k.size(1) ||
      qkv.numel() != q.size(0) * q.size(1) * (q.size(2) + 2 * k.size(2)) * q.size(3))
    throw RuntimeError("rope qkv: qkv " + qkv.shape_str() + " does not hold q " + q.shape_str() + ", k " +
                       k.shape_str() + ", v " + v.shape_str());
}
}  // namespace

template <class T>
void CpuBackend<T>::rope_split_qkv(const Tensor& qkv, const Tensor& q, const Tensor& k, const Tensor& v,
                                   double base, int64_t pos0) {
  check_qkv(qkv, q, k, v);
  const int64_t N = q.size(0) * q.size(1), Hq = q.size(2), Hkv = k.size(2), D = q.size(3), H3 = Hq + 2 * Hkv;
  const T* src = qkv.ptr<T>();
  for (int64_t n = 0; n < N; ++n) {
    std::copy(src + n * H3 * D, src + (n * H3 + Hq) * D, q.ptr<T>() + n * Hq * D);
    std::copy(src + (n * H3 + Hq) * D, src + (n * H3 + Hq + Hkv) * D, k.ptr<T>() + n * Hkv * D);
    std::copy(src + (n * H3 + Hq + Hkv) * D, src + (n + 1) * H3 * D, v.ptr<T>() + n * Hkv * D);
  }
  rope(q, base, pos0, 1.0);
  rope(k, base, pos0, 1.0);
}

template <class T>
void CpuBackend<T>::rope_merge_qkv(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dqkv,
                                   double base, int64_t pos0) {
  check_qkv(dqkv, dq, dk, dv);
  const int64_t B = dq.size(0), Tn = dq.size(1), Hq = dq.size(2), Hkv = dk.size(2), D = dq.size(3);
  const int64_t N = B * Tn, H3 = Hq + 2 * Hkv;
  T* dst = dqkv.ptr<T>();
  for (int64_t n = 0; n < N; ++n) {
    std::copy(dq.ptr<T>() + n * Hq * D, dq.ptr<T>() + (n + 1) * Hq * D, dst + n * H3 * D);
    std::copy(dk.ptr<T>() + n * Hkv * D, dk.ptr<T>() + (n + 1) * Hkv * D, dst + (n * H3 + Hq) * D);
    std::copy(dv.ptr<T>() + n * Hkv * D, dv.ptr<T>() + (n + 1) * Hkv * D, dst + (n * H3 + Hq + Hkv) * D);
  }
  rope_heads(dst, B, Tn, H3, 0, Hq + Hkv, D, base, pos0, -1.0);
}

template <class T>
void CpuBackend<T>::rope_fwd(const Tensor& x, double base, int64_t pos0) { rope(x, base, pos0, 1.0); }

template <class T>
void CpuBackend<T>::rope_bwd(const Tensor& dx, double base, int64_t pos0) { rope(dx, base, pos0, -1.0); }

// ---- attention ----
// Blocked over queries (kBq rows at a time); each block sees only the keys its rows can
// reach (causal + window). Work is split over (batch, kv head) so that the q heads of a
// GQA group — which all write the same dk, dv — run in one thread, in order.

namespace {
constexpr int64_t kBq = 64;

struct AttnDims {
  int64_t B, T, S, Hq, Hkv, D, Dv, group, off;
};

AttnDims attn_dims(const Tensor& q, const Tensor& k, const Tensor& v) {
  AttnDims a{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), v.size(3), 0, 0};
  if (a.Hkv <= 0 || a.Hq % a.Hkv || k.size(3) != a.D || v.size(1) != a.S || v.size(2) != a.Hkv || a.S < a.T)
    throw RuntimeError("attention: q " + q.shape_str() + " k " + k.shape_str() + " v " + v.shape_str());
  a.group = a.Hq / a.Hkv;
  a.off = a.S - a.T;
  return a;
}

// Keys visible to queries [t0, t1): [j0, j1).
inline void key_range(const AttnDims& a, int64_t t0, int64_t t1, int64_t window, int64_t& j0, int64_t& j1) {
  j1 = t1 - 1 + a.off + 1;
  j0 = window > 0 ? std::max<int64_t>(0, t0 + a.off - window + 1) : 0;
}

// The keys j0+[lo, hi) that the query at absolute position pos sees: j ≤ pos and
// pos − j < window (window ≤ 0: unlimited). Never empty (a query sees itself).
inline void visible_range(int64_t pos, int64_t j0, int64_t nk, int64_t window, int64_t& lo, int64_t& hi) {
  hi = std::min(nk, pos - j0 + 1);
  lo = window > 0 ? std::max<int64_t>(0, pos - window + 1 - j0) : 0;
}
}  // namespace

template <class T>
void CpuBackend<T>::attention_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                                  const Tensor& lse, double scale, int64_t window) {
  const AttnDims a = attn_dims(q, k, v);
  Timer timer(attention_seconds_);
  const T* qp = q.ptr<T>();
  const T* kp = k.ptr<T>();
  const T* vp = v.ptr<T>();
  T* op = o.ptr<T>();
  T* lp = lse.ptr<T>();
  const int ldq = static_cast<int>(a.Hq * a.D), ldk = static_cast<int>(a.Hkv * a.D);
  const int ldv = static_cast<int>(a.Hkv * a.Dv), ldo = static_cast<int>(a.Hq * a.Dv);
#pragma omp parallel num_threads(nt(int64_t(a.B * a.Hq * a.T * a.S * a.D)))
  {
    std::vector<T> S(kBq * a.S);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < a.B * a.Hkv; ++task) {
      const int64_t b = task / a.Hkv, kh = task % a.Hkv;
      for (int64_t h = kh * a.group; h < (kh + 1) * a.group; ++h) {
        for (int64_t t0 = 0; t0 < a.T; t0 += kBq) {
          const int64_t t1 = std::min(a.T, t0 + kBq), bq = t1 - t0;
          int64_t j0, j1;
          key_range(a, t0, t1, window, j0, j1);
          const int64_t nk = j1 - j0;
          const T* qb = qp + ((b * a.T + t0) * a.Hq + h) * a.D;
          const T* kb = kp + ((b * a.S + j0) * a.Hkv + kh) * a.D;
          const T* vb = vp + ((b * a.S + j0) * a.Hkv + kh) * a.Dv;
          gemm_raw<T>(false, true, int(bq), int(nk), int(a.D), T(scale), qb, ldq, kb, ldk, T(0), S.data(), int(nk));
          for (int64_t i = 0; i < bq; ++i) {
            T* row = S.data() + i * nk;
            const int64_t pos = t0 + i + a.off;
            int64_t lo, hi;
            visible_range(pos, j0, nk, window, lo, hi);
            T mx = row[lo];
            for (int64_t j = lo + 1; j < hi; ++j) mx = std::max(mx, row[j]);
            std::fill(row, row + lo, T(0));
            std::fill(row + hi, row + nk, T(0));
            exp_shifted(row + lo, hi - lo, mx);
            double sum = 0;
            for (int64_t j = lo; j < hi; ++j) sum += row[j];
            const T inv = static_cast<T>(1.0 / sum);
            for (int64_t j = lo; j < hi; ++j) row[j] *= inv;
            lp[(b * a.Hq + h) * a.T + t0 + i] = static_cast<T>(double(mx) + std::log(sum));
          }
          T* ob = op + ((b * a.T + t0) * a.Hq + h) * a.Dv;
          gemm_raw<T>(false, false, int(bq), int(a.Dv), int(nk), T(1), S.data(), int(nk), vb, ldv, T(0), ob, ldo);
        }
      }
    }
  }
}

template <class T>
void CpuBackend<T>::attention_bwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                                  const Tensor& lse, const Tensor& dout, const Tensor& dq, const Tensor& dk,
                                  const Tensor& dv, double scale, int64_t window) {
  const AttnDims a = attn_dims(q, k, v);
  Timer timer(attention_seconds_);
  const T* qp = q.ptr<T>();
  const T* kp = k.ptr<T>();
  const T* vp = v.ptr<T>();
  const T* op = o.ptr<T>();
  const T* lp = lse.ptr<T>();
  const T* gp = dout.ptr<T>();
  T* dqp = dq.ptr<T>();
  T* dkp = dk.ptr<T>();
  T* dvp = dv.ptr<T>();
  zero(dk);
  zero(dv);
  const int ldq = static_cast<int>(a.Hq * a.D), ldk = static_cast<int>(a.Hkv * a.D);
  const int ldv = static_cast<int>(a.Hkv * a.Dv), ldo = static_cast<int>(a.Hq * a.Dv);
#pragma omp parallel num_threads(nt(int64_t(a.B * a.Hq * a.T * a.S * a.D)))
  {
    std::vector<T> P(kBq * a.S), dP(kBq * a.S), Di(kBq);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < a.B * a.Hkv; ++task) {
      const int64_t b = task / a.Hkv, kh = task % a.Hkv;
      for (int64_t h = kh * a.group; h < (kh + 1) * a.group; ++h) {
        for (int64_t t0 = 0; t0 < a.T; t0 += kBq) {
          const int64_t t1 = std::min(a.T, t0 + kBq), bq = t1 - t0;
          int64_t j0, j1;
          key_range(a, t0, t1, window, j0, j1);
          const int64_t nk = j1 - j0;
          const T* qb = qp + ((b * a.T + t0) * a.Hq + h) * a.D;
          const T* kb = kp + ((b * a.S + j0) * a.Hkv + kh) * a.D;
          const T* vb = vp + ((b * a.S + j0) * a.Hkv + kh) * a.Dv;
          const T* ob = op + ((b * a.T + t0) * a.Hq + h) * a.Dv;
          const T* gb = gp + ((b * a.T + t0) * a.Hq + h) * a.Dv;
          T* dqb = dqp + ((b * a.T + t0) * a.Hq + h) * a.D;
          T* dkb = dkp + ((b * a.S + j0) * a.Hkv + kh) * a.D;
          T* dvb = dvp + ((b * a.S + j0) * a.Hkv + kh) * a.Dv;
          // P = exp(scale·QKᵀ − lse), masked.
          gemm_raw<T>(false, true, int(bq), int(nk), int(a.D), T(scale), qb, ldq, kb, ldk, T(0), P.data(), int(nk));
          for (int64_t i = 0; i < bq; ++i) {
            T* row = P.data() + i * nk;
            const int64_t pos = t0 + i + a.off;
            const T l = lp[(b * a.Hq + h) * a.T + t0 + i];
            int64_t lo, hi;
            visible_range(pos, j0, nk, window, lo, hi);
            std::fill(row, row + lo, T(0));
            std::fill(row + hi, row + nk, T(0));
            exp_shifted(row + lo, hi - lo, l);
            double di = 0;
            for (int64_t c = 0; c < a.Dv; ++c) di += double(gb[i * ldo + c]) * double(ob[i * ldo + c]);
            Di[i] = static_cast<T>(di);
          }
          // dV += Pᵀ·dO ; dP = dO·Vᵀ
          gemm_raw<T>(true, false, int(nk), int(a.Dv), int(bq), T(1), P.data(), int(nk), gb, ldo, T(1), dvb, ldv);
          gemm_raw<T>(false, true, int(bq), int(nk), int(a.Dv), T(1), gb, ldo, vb, ldv, T(0), dP.data(), int(nk));
          // dS = P ⊙ (dP − D)   (stored in dP)
          for (int64_t i = 0; i < bq; ++i) {
            T* pr = P.data() + i * nk;
            T* dr = dP.data() + i * nk;
            for (int64_t j = 0; j < nk; ++j) dr[j] = pr[j] * (dr[j] - Di[i]);
          }
          // dQ = scale·dS·K ; dK += scale·dSᵀ·Q
          gemm_raw<T>(false, false, int(bq), int(a.D), int(nk), T(scale), dP.data(), int(nk), kb, ldk, T(0), dqb, ldq);
          gemm_raw<T>(true, false, int(nk), int(a.D), int(bq), T(scale), dP.data(), int(nk), qb, ldq, T(1), dkb, ldk);
        }
      }
    }
  }
}

// ---- cross-entropy ----

template <class T>
double CpuBackend<T>::cross_entropy_fwd(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                                        const Tensor& losses, const Tensor& argmax) {
  check_dtype(targets, DType::i32, "cross_entropy targets");
  const int64_t n = logits.rows(), V = logits.last();
  const T* lp = logits.ptr<T>();
  const int32_t* tp = targets.ptr<int32_t>();
  const T* mp = mask.ptr<T>();
  T* out = losses.ptr<T>();
  int32_t* am = argmax.empty() ? nullptr : argmax.ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i)
    if (tp[i] < 0 || tp[i] >= V)
      throw RuntimeError("target id " + std::to_string(tp[i]) + " outside the vocabulary (" + std::to_string(V) + ")");
#pragma omp parallel for num_threads(nt(int64_t(n * V))) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const T* r = lp + i * V;
    int64_t best = 0;
    for (int64_t j = 1; j < V; ++j)
      if (r[j] > r[best]) best = j;
    if (am) am[i] = static_cast<int32_t>(best);
    if (mp[i] == T(0)) {
      out[i] = 0;
      continue;
    }
    const double mx = r[best];
    double s = 0;
    for (int64_t j = 0; j < V; ++j) s += std::exp(double(r[j]) - mx);
    out[i] = static_cast<T>(double(mp[i]) * (mx + std::log(s) - double(r[tp[i]])));
  }
  double total = 0;
  for (int64_t i = 0; i < n; ++i) total += out[i];
  return total;
}

template <class T>
void CpuBackend<T>::cross_entropy_bwd(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                                      double grad_scale, const Tensor& dlogits) {
  const int64_t n = logits.rows(), V = logits.last();
  const T* lp = logits.ptr<T>();
  const int32_t* tp = targets.ptr<int32_t>();
  const T* mp = mask.ptr<T>();
  T* dp = dlogits.ptr<T>();
#pragma omp parallel for num_threads(nt(int64_t(n * V))) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const T* r = lp + i * V;
    T* d = dp + i * V;
    const T w = static_cast<T>(grad_scale * double(mp[i]));
    if (w == T(0)) {
      std::fill_n(d, V, T(0));
      continue;
    }
    T mx = r[0];
    for (int64_t j = 1; j < V; ++j) mx = std::max(mx, r[j]);
    double s = 0;
    for (int64_t j = 0; j < V; ++j) {
      const T e = exp_t(r[j] - mx);
      d[j] = e;  // d may alias r: r[j] is not read again after this
      s += e;
    }
    const T inv = static_cast<T>(1.0 / s);
    for (int64_t j = 0; j < V; ++j) d[j] *= inv * w;
    d[tp[i]] -= w;
  }
}

// ---- optimiser updates: the host Optimizer's loops (trainer/optim/optimizer.cpp), float
// for float, so a device optimiser on this backend reproduces it bit for bit.

template <class T>
void CpuBackend<T>::adamw_step(const Tensor& w, const Tensor& g, const Tensor& m, const Tensor& v,
                               const AdamWStep& s) {
  const int64_t n = w.numel();
  if (g.numel() != n || m.numel() != n || v.numel() != n) throw RuntimeError("adamw_step: sizes differ");
  T* __restrict wp = w.ptr<T>();
  const T* __restrict gp = g.ptr<T>();
  T* __restrict mp = m.ptr<T>();
  T* __restrict vp = v.ptr<T>();
  const T b1 = s.beta1, b2 = s.beta2, step_size = s.step_size, isb = s.inv_sqrt_bc2, eps = s.eps, decay = s.decay;
  const T gs = s.grad_scale;
  const bool clip = s.grad_scale != 1.0f;
  for (int64_t i = 0; i < n; ++i) {
    const T g = clip ? gp[i] * gs : gp[i];  // as scale(g, grad_scale) would have left it
    mp[i] = b1 * mp[i] + (T(1) - b1) * g;
    vp[i] = b2 * vp[i] + (T(1) - b2) * g * g;
    const T denom = std::sqrt(vp[i]) * isb + eps;
    wp[i] = wp[i] * decay - step_size * (mp[i] / denom);
  }
}

template <class T>
void CpuBackend<T>::momentum_step(const Tensor& g, const Tensor& buf, const Tensor& u, double mu, bool nesterov) {
  const int64_t n = g.numel();
  if (buf.numel() != n || u.numel() != n) throw RuntimeError("momentum_step: sizes differ");
  const T* gp = g.ptr<T>();
  T* bp = buf.ptr<T>();
  T* up = u.ptr<T>();
  const T m = static_cast<T>(static_cast<float>(mu));
  for (int64_t i = 0; i < n; ++i) {
    bp[i] = m * bp[i] + (T(1) - m) * gp[i];
    up[i] = nesterov ? (T(1) - m) * gp[i] + m * bp[i] : bp[i];
  }
}

template <class T>
void CpuBackend<T>::scale(const Tensor& x, double alpha) {
  T* p = x.ptr<T>();
  const T a = static_cast<T>(static_cast<float>(alpha));
  for (int64_t i = 0; i < x.numel(); ++i) p[i] *= a;
}

template <class T>
void CpuBackend<T>::transpose(const Tensor& src, const Tensor& dst, double alpha) {
  const int64_t r = src.rows(), c = src.last();
  if (dst.numel() != r * c) throw RuntimeError("transpose: " + src.shape_str() + " → " + dst.shape_str());
  const T* s = src.ptr<T>();
  T* d = dst.ptr<T>();
  const T a = static_cast<T>(alpha);
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < c; ++j) d[j * r + i] = s[i * c + j] * a;
}

template <class T>
void CpuBackend<T>::normuon_normalize(const Tensor& o, const Tensor& V, double beta2, double eps) {
  const int64_t rows = o.rows(), cols = o.last();
  const bool per_row = rows >= cols;
  const int64_t len = per_row ? rows : cols, other = per_row ? cols : rows;
  if (V.numel() != len) throw RuntimeError("normuon_normalize: V has " + V.shape_str());
  T* x = o.ptr<T>();
  T* v = V.ptr<T>();
  std::vector<double> mean(static_cast<std::size_t>(len), 0.0);
  double before = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const double e = x[r * cols + c];
      mean[per_row ? r : c] += e * e;
      before += e * e;
    }
  std::vector<T> inv(static_cast<std::size_t>(len));
  for (int64_t k = 0; k < len; ++k) {
    v[k] = static_cast<T>(beta2 * v[k] + (1.0 - beta2) * (mean[k] / other));
    inv[k] = static_cast<T>(1.0 / (std::sqrt(static_cast<double>(v[k])) + eps));
  }
  double after = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      T& e = x[r * cols + c];
      e *= inv[per_row ? r : c];
      after += static_cast<double>(e) * e;
    }
  const T rescale = after > 0 ? static_cast<T>(std::sqrt(before / after)) : T(0);
  for (int64_t i = 0; i < rows * cols; ++i) x[i] *= rescale;
}

template <class T>
void CpuBackend<T>::decayed_update(const Tensor& w, const Tensor& o, double decay, double step) {
  if (w.numel() != o.numel()) throw RuntimeError("decayed_update: sizes differ");
  T* wp = w.ptr<T>();
  const T* op = o.ptr<T>();
  const T d = static_cast<T>(decay), st = static_cast<T>(step);
  for (int64_t i = 0; i < w.numel(); ++i) wp[i] = wp[i] * d - st * op[i];
}

template class CpuBackend<float>;
template class CpuBackend<double>;

static BackendRegistration reg_cpu{"cpu", [](int threads, DType t) -> std::unique_ptr<Backend> {
                                     if (t == DType::f64) return std::make_unique<CpuBackend<double>>(threads);
                                     return std::make_unique<CpuBackend<float>>(threads);
                                   }};

}  // namespace lar::kernels::cpu
