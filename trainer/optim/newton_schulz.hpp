#pragma once
// Quintic Newton–Schulz orthogonalisation (Muon's "zeroth power" of a matrix).
//
//   X₀ = G / (‖G‖_F + 1e-7)            (G transposed first when rows > cols, so X is wide)
//   A = X Xᵀ;  B = b·A + c·A·A;  X ← a·X + B·X      (repeated `steps` times)
//   result = X (transposed back when G was tall)
//
// With the default (a, b, c) = (3.4445, −4.7750, 2.0315) the singular values of the result
// land in roughly [0.7, 1.2] instead of exactly 1 (a deliberately steep polynomial that
// converges in 5 steps). GEMMs go through OpenBLAS (cblas_sgemm / cblas_dgemm).
#include <array>
#include <vector>

namespace lar::optim {

constexpr double kNewtonSchulzEps = 1e-7;

// out (rows × cols, row-major) = NS(g). `work` is resized as needed and may be reused
// across calls to avoid allocations. g and out may not alias.
template <typename T>
void newton_schulz(const T* g, T* out, int rows, int cols, int steps,
                   const std::array<double, 3>& abc, std::vector<T>& work);

// The same without Frobenius pre-normalisation and without transposition: exactly one
// iteration X ← a·X + (b·XXᵀ + c·(XXᵀ)²)·X on a wide or square X (tests check it by hand).
template <typename T>
void newton_schulz_iteration(const T* x, T* out, int rows, int cols,
                             const std::array<double, 3>& abc, std::vector<T>& work);

}  // namespace lar::optim
