#include "trainer/optim/newton_schulz.hpp"

#include <cblas.h>

#include <cmath>
#include <cstddef>
#include <cstring>

namespace lar::optim {
namespace {

// C = alpha·op(A)·op(B) + beta·C, row-major, for float and double.
void gemm(bool ta, bool tb, int m, int n, int k, double alpha, const float* a, int lda,
          const float* b, int ldb, double beta, float* c, int ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n,
              k, static_cast<float>(alpha), a, lda, b, ldb, static_cast<float>(beta), c, ldc);
}
void gemm(bool ta, bool tb, int m, int n, int k, double alpha, const double* a, int lda,
          const double* b, int ldb, double beta, double* c, int ldc) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n,
              k, alpha, a, lda, b, ldb, beta, c, ldc);
}
// Upper triangle of C = alpha·A·Aᵀ + beta·C (A is n × k): half the work of a GEMM.
void syrk(int n, int k, double alpha, const float* a, int lda, double beta, float* c, int ldc) {
  cblas_ssyrk(CblasRowMajor, CblasUpper, CblasNoTrans, n, k, static_cast<float>(alpha), a, lda,
              static_cast<float>(beta), c, ldc);
}
void syrk(int n, int k, double alpha, const double* a, int lda, double beta, double* c, int ldc) {
  cblas_dsyrk(CblasRowMajor, CblasUpper, CblasNoTrans, n, k, alpha, a, lda, beta, c, ldc);
}
// Copy the upper triangle of the n × n matrix c into its lower triangle.
template <typename T>
void mirror_upper(T* c, int n) {
  for (int i = 1; i < n; ++i)
    for (int j = 0; j < i; ++j) c[static_cast<std::size_t>(i) * n + j] = c[static_cast<std::size_t>(j) * n + i];
}

// One quintic step on the wide r × c matrix x (r ≤ c) into out; A and B are r × r.
// A = X Xᵀ and B = b·A + c·A² = b·A + c·A·Aᵀ are symmetric, so both come from SYRK.
template <typename T>
void iterate(const T* x, T* out, int r, int c, const std::array<double, 3>& abc, T* A, T* B) {
  const auto [a, b, cc] = abc;
  syrk(r, c, 1.0, x, c, 0.0, A, r);  // A = X Xᵀ (upper)
  mirror_upper(A, r);
  std::memcpy(B, A, sizeof(T) * static_cast<std::size_t>(r) * r);
  syrk(r, r, cc, A, r, b, B, r);  // B = b·A + c·A·Aᵀ (upper)
  mirror_upper(B, r);
  std::memcpy(out, x, sizeof(T) * static_cast<std::size_t>(r) * c);
  gemm(false, false, r, c, r, 1.0, B, r, x, c, a, out, c);  // X' = a·X + B·X
}

}  // namespace

template <typename T>
void newton_schulz_iteration(const T* x, T* out, int rows, int cols,
                             const std::array<double, 3>& abc, std::vector<T>& work) {
  const std::size_t rr = static_cast<std::size_t>(rows) * rows;
  work.resize(2 * rr);
  iterate(x, out, rows, cols, abc, work.data(), work.data() + rr);
}

template <typename T>
void newton_schulz(const T* g, T* out, int rows, int cols, int steps,
                   const std::array<double, 3>& abc, std::vector<T>& work) {
  // Work on the wide form: the Gram matrix X Xᵀ is then the small min(rows, cols)² one.
  const bool tall = rows > cols;
  const int r = tall ? cols : rows, c = tall ? rows : cols;
  const std::size_t n = static_cast<std::size_t>(rows) * cols;
  const std::size_t rr = static_cast<std::size_t>(r) * r;
  work.resize(2 * n + 2 * rr);
  T* x = work.data();
  T* y = x + n;
  T* A = y + n;
  T* B = A + rr;

  double ss = 0;
  for (std::size_t i = 0; i < n; ++i) ss += static_cast<double>(g[i]) * g[i];
  const T inv = static_cast<T>(1.0 / (std::sqrt(ss) + kNewtonSchulzEps));
  if (tall) {
    for (int i = 0; i < rows; ++i)
      for (int j = 0; j < cols; ++j)
        x[static_cast<std::size_t>(j) * rows + i] = g[static_cast<std::size_t>(i) * cols + j] * inv;
  } else {
    for (std::size_t i = 0; i < n; ++i) x[i] = g[i] * inv;
  }
  for (int s = 0; s < steps; ++s) {
    iterate(x, y, r, c, abc, A, B);
    std::swap(x, y);
  }
  if (tall) {
    for (int i = 0; i < r; ++i)
      for (int j = 0; j < c; ++j)
        out[static_cast<std::size_t>(j) * r + i] = x[static_cast<std::size_t>(i) * c + j];
  } else {
    std::memcpy(out, x, sizeof(T) * n);
  }
}

template void newton_schulz<float>(const float*, float*, int, int, int, const std::array<double, 3>&,
                                   std::vector<float>&);
template void newton_schulz<double>(const double*, double*, int, int, int,
                                    const std::array<double, 3>&, std::vector<double>&);
template void newton_schulz_iteration<float>(const float*, float*, int, int,
                                             const std::array<double, 3>&, std::vector<float>&);
template void newton_schulz_iteration<double>(const double*, double*, int, int,
                                              const std::array<double, 3>&, std::vector<double>&);

}  // namespace lar::optim
