// Newton–Schulz by hand and by its singular values; Muon and NorMuon steps against a slow,
// straightforward fp64 reference written here (no BLAS, no shared code with the library).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "trainer/optim/newton_schulz.hpp"
#include "trainer/optim/optimizer.hpp"

using namespace lar::optim;

namespace {

const std::array<double, 3> kAbc = {3.4445, -4.7750, 2.0315};
using Mat = std::vector<std::vector<double>>;

Mat zeros(int r, int c) { return Mat(r, std::vector<double>(c, 0.0)); }
Mat mul(const Mat& x, const Mat& y) {
  Mat z = zeros(static_cast<int>(x.size()), static_cast<int>(y[0].size()));
  for (std::size_t i = 0; i < x.size(); ++i)
    for (std::size_t j = 0; j < y[0].size(); ++j)
      for (std::size_t k = 0; k < y.size(); ++k) z[i][j] += x[i][k] * y[k][j];
  return z;
}
Mat transpose(const Mat& x) {
  Mat t = zeros(static_cast<int>(x[0].size()), static_cast<int>(x.size()));
  for (std::size_t i = 0; i < x.size(); ++i)
    for (std::size_t j = 0; j < x[0].size(); ++j) t[j][i] = x[i][j];
  return t;
}
Mat from_flat(const float* f, int r, int c) {
  Mat m = zeros(r, c);
  for (int i = 0; i < r; ++i)
    for (int j = 0; j < c; ++j) m[i][j] = f[i * c + j];
  return m;
}

// Eigenvalues of a symmetric matrix by cyclic Jacobi rotations (fp64, tiny sizes only).
std::vector<double> sym_eigenvalues(Mat a) {
  const int n = static_cast<int>(a.size());
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0;
    for (int p = 0; p < n; ++p)
      for (int q = p + 1; q < n; ++q) off += a[p][q] * a[p][q];
    if (off < 1e-24) break;
    for (int p = 0; p < n; ++p)
      for (int q = p + 1; q < n; ++q) {
        if (std::abs(a[p][q]) < 1e-300) continue;
        const double theta = (a[q][q] - a[p][p]) / (2 * a[p][q]);
        const double t = (theta >= 0 ? 1 : -1) / (std::abs(theta) + std::sqrt(theta * theta + 1));
        const double c = 1 / std::sqrt(t * t + 1), s = t * c;
        for (int k = 0; k < n; ++k) {  // A ← A·J
          const double akp = a[k][p], akq = a[k][q];
          a[k][p] = c * akp - s * akq;
          a[k][q] = s * akp + c * akq;
        }
        for (int k = 0; k < n; ++k) {  // A ← Jᵀ·A
          const double apk = a[p][k], aqk = a[q][k];
          a[p][k] = c * apk - s * aqk;
          a[q][k] = s * apk + c * aqk;
        }
      }
  }
  std::vector<double> ev(n);
  for (int i = 0; i < n; ++i) ev[i] = a[i][i];
  return ev;
}

std::vector<double> singular_values(const Mat& x) {
  const Mat gram = x.size() <= x[0].size() ? mul(x, transpose(x)) : mul(transpose(x), x);
  std::vector<double> sv;
  for (double e : sym_eigenvalues(gram)) sv.push_back(std::sqrt(std::max(0.0, e)));
  return sv;
}

// Reference Newton–Schulz: textbook loops in fp64, the tall case by transposing.
Mat ref_newton_schulz(Mat g, int steps, const std::array<double, 3>& abc) {
  const bool tall = g.size() > g[0].size();
  if (tall) g = transpose(g);
  double ss = 0;
  for (auto& row : g)
    for (double v : row) ss += v * v;
  const double norm = std::sqrt(ss) + 1e-7;
  for (auto& row : g)
    for (double& v : row) v /= norm;
  for (int s = 0; s < steps; ++s) {
    const Mat a = mul(g, transpose(g));
    const Mat a2 = mul(a, a);
    Mat b = a;
    for (std::size_t i = 0; i < a.size(); ++i)
      for (std::size_t j = 0; j < a.size(); ++j) b[i][j] = abc[1] * a[i][j] + abc[2] * a2[i][j];
    const Mat bg = mul(b, g);
    for (std::size_t i = 0; i < g.size(); ++i)
      for (std::size_t j = 0; j < g[0].size(); ++j) g[i][j] = abc[0] * g[i][j] + bg[i][j];
  }
  return tall ? transpose(g) : g;
}

// Reference Muon / NorMuon for one matrix, state kept here in fp64.
struct RefMuon {
  double lr, wd, mu, beta2, eps, scale;
  bool nesterov, normuon;
  Mat buf, p;
  std::vector<double> v;
  void step(const Mat& g) {
    const int r = static_cast<int>(p.size()), c = static_cast<int>(p[0].size());
    Mat u = zeros(r, c);
    for (int i = 0; i < r; ++i)
      for (int j = 0; j < c; ++j) {
        buf[i][j] = mu * buf[i][j] + (1 - mu) * g[i][j];
        u[i][j] = nesterov ? (1 - mu) * g[i][j] + mu * buf[i][j] : buf[i][j];
      }
    Mat o = ref_newton_schulz(u, 5, kAbc);
    if (normuon) {
      const bool per_row = r >= c;
      double before = 0, after = 0;
      for (auto& row : o)
        for (double x : row) before += x * x;
      for (std::size_t k = 0; k < v.size(); ++k) {
        double mean = 0;
        if (per_row) {
          for (int j = 0; j < c; ++j) mean += o[k][j] * o[k][j] / c;
        } else {
          for (int i = 0; i < r; ++i) mean += o[i][k] * o[i][k] / r;
        }
        v[k] = beta2 * v[k] + (1 - beta2) * mean;
      }
      for (int i = 0; i < r; ++i)
        for (int j = 0; j < c; ++j) {
          o[i][j] /= std::sqrt(v[per_row ? i : j]) + eps;
          after += o[i][j] * o[i][j];
        }
      for (auto& row : o)
        for (double& x : row) x *= std::sqrt(before / after);
    }
    for (int i = 0; i < r; ++i)
      for (int j = 0; j < c; ++j) p[i][j] = p[i][j] * (1 - lr * wd) - lr * scale * o[i][j];
  }
};

}  // namespace

// X = [[1,2,0],[0,1,1]]: A = XXᵀ = [[5,2],[2,2]], A² = [[29,14],[14,8]],
// B = −4.775·A + 2.0315·A² = [[35.0385, 18.891],[18.891, 6.702]],
// X' = 3.4445·X + B·X = [[38.483, 95.857, 18.891],[18.891, 47.9285, 10.1465]].
TEST(NewtonSchulz, OneIterationMatchesHandComputation) {
  const std::vector<double> x = {1, 2, 0, 0, 1, 1};
  std::vector<double> out(6), work;
  newton_schulz_iteration(x.data(), out.data(), 2, 3, kAbc, work);
  const double want[6] = {38.483, 95.857, 18.891, 18.891, 47.9285, 10.1465};
  for (int i = 0; i < 6; ++i) EXPECT_NEAR(out[i], want[i], 1e-9) << i;

  const std::vector<float> xf = {1, 2, 0, 0, 1, 1};
  std::vector<float> outf(6), workf;
  newton_schulz_iteration(xf.data(), outf.data(), 2, 3, kAbc, workf);
  for (int i = 0; i < 6; ++i) EXPECT_NEAR(outf[i], want[i], 1e-4) << i;
}

TEST(NewtonSchulz, FiveStepsGiveSingularValuesInTheQuinticBand) {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  for (auto [r, c] : {std::pair{12, 30}, std::pair{30, 12}, std::pair{16, 16}}) {
    std::vector<float> g(static_cast<std::size_t>(r) * c), o(g.size()), work;
    for (float& v : g) v = nd(rng);
    newton_schulz(g.data(), o.data(), r, c, 5, kAbc, work);
    const std::vector<double> sv = singular_values(from_flat(o.data(), r, c));
    ASSERT_EQ(static_cast<int>(sv.size()), std::min(r, c));
    for (double s : sv) {
      EXPECT_GT(s, 0.68) << r << "x" << c;
      EXPECT_LT(s, 1.2) << r << "x" << c;
    }
    // The input's singular values are spread far wider than that band.
    const std::vector<double> sg = singular_values(from_flat(g.data(), r, c));
    EXPECT_GT(*std::max_element(sg.begin(), sg.end()) / *std::min_element(sg.begin(), sg.end()), 3.0);
  }
}

TEST(NewtonSchulz, TallInputIsTheTransposeOfTheWideResult) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  const int r = 9, c = 4;
  std::vector<float> tall(r * c), wide(r * c), ot(r * c), ow(r * c), work;
  for (float& v : tall) v = nd(rng);
  for (int i = 0; i < r; ++i)
    for (int j = 0; j < c; ++j) wide[j * r + i] = tall[i * c + j];
  newton_schulz(tall.data(), ot.data(), r, c, 5, kAbc, work);
  newton_schulz(wide.data(), ow.data(), c, r, 5, kAbc, work);
  for (int i = 0; i < r; ++i)
    for (int j = 0; j < c; ++j) EXPECT_EQ(ot[i * c + j], ow[j * r + i]);
}

TEST(NewtonSchulz, MatchesFp64ReferenceInFloatAndDouble) {
  std::mt19937 rng(11);
  std::normal_distribution<double> nd;
  const int r = 7, c = 5;
  std::vector<double> g(r * c), o(r * c), work;
  std::vector<float> gf(r * c), of(r * c), workf;
  for (int i = 0; i < r * c; ++i) gf[i] = static_cast<float>(g[i] = nd(rng));
  newton_schulz(g.data(), o.data(), r, c, 5, kAbc, work);
  newton_schulz(gf.data(), of.data(), r, c, 5, kAbc, workf);
  Mat gm = zeros(r, c);
  for (int i = 0; i < r; ++i)
    for (int j = 0; j < c; ++j) gm[i][j] = g[i * c + j];
  const Mat ref = ref_newton_schulz(gm, 5, kAbc);
  for (int i = 0; i < r; ++i)
    for (int j = 0; j < c; ++j) {
      EXPECT_NEAR(o[i * c + j], ref[i][j], 1e-12);
      EXPECT_NEAR(of[i * c + j], ref[i][j], 2e-5);
    }
}

struct MuonCase {
  OptimizerName name;
  ScaleMode scale;
  bool nesterov;
  int rows, cols;
};

class MuonVsReference : public ::testing::TestWithParam<MuonCase> {};

TEST_P(MuonVsReference, ThreeStepsAgreeWithFp64Reference) {
  const MuonCase mc = GetParam();
  OptimizerConfig c;
  c.name = mc.name;
  c.lr = 0.02;
  c.weight_decay = 0.1;
  c.momentum = 0.95;
  c.nesterov = mc.nesterov;
  c.scale_mode = mc.scale;
  const int r = mc.rows, cl = mc.cols, n = r * cl;
  Optimizer opt(c, {{"w", 0, r, cl, ParamKind::matrix_hidden}}, n);
  const double scale = mc.scale == ScaleMode::spectral ? std::sqrt(double(std::max(r, cl)))
                                                       : std::sqrt(std::max(1.0, double(r) / cl));
  EXPECT_DOUBLE_EQ(opt.muon_scale(r, cl), scale);

  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  std::vector<float> p(n), g(n);
  for (float& v : p) v = 0.1f * nd(rng);
  RefMuon ref{0.02, 0.1, 0.95, 0.95, 1e-8, scale, mc.nesterov, mc.name == OptimizerName::normuon,
              zeros(r, cl), from_flat(p.data(), r, cl), std::vector<double>(std::max(r, cl), 0.0)};
  const double factors[3] = {1.0, 0.8, 0.3};
  for (double f : factors) {
    for (float& v : g) v = nd(rng);
    opt.step(p.data(), g.data(), f, f);
    ref.lr = 0.02 * f;
    ref.step(from_flat(g.data(), r, cl));
  }
  double max_err = 0, max_abs = 0;
  for (int i = 0; i < r; ++i)
    for (int j = 0; j < cl; ++j) {
      max_err = std::max(max_err, std::abs(p[i * cl + j] - ref.p[i][j]));
      max_abs = std::max(max_abs, std::abs(ref.p[i][j]));
    }
  EXPECT_LT(max_err, 2e-6 * std::max(1.0, scale)) << "max |p| " << max_abs;
  EXPECT_GT(max_abs, 0.01);  // the reference did move the weights
}

INSTANTIATE_TEST_SUITE_P(
    Cases, MuonVsReference,
    ::testing::Values(MuonCase{OptimizerName::muon, ScaleMode::default_, true, 6, 10},
                      MuonCase{OptimizerName::muon, ScaleMode::default_, true, 10, 6},
                      MuonCase{OptimizerName::muon, ScaleMode::spectral, false, 8, 5},
                      MuonCase{OptimizerName::normuon, ScaleMode::default_, true, 9, 4},
                      MuonCase{OptimizerName::normuon, ScaleMode::default_, true, 4, 9},
                      MuonCase{OptimizerName::normuon, ScaleMode::spectral, true, 7, 7}),
    [](const ::testing::TestParamInfo<MuonCase>& info) {
      const MuonCase& m = info.param;
      return std::string(m.name == OptimizerName::muon ? "muon" : "normuon") +
             (m.scale == ScaleMode::spectral ? "_spectral" : "_default") + (m.nesterov ? "_nesterov_" : "_plain_") +
             std::to_string(m.rows) + "x" + std::to_string(m.cols);
    });

// NorMuon's normalisation keeps the Frobenius norm of the orthogonalised update, so its
// update has the same size as Muon's on the first step while its direction differs.
TEST(NorMuon, FirstUpdateHasMuonsFrobeniusNorm) {
  std::mt19937 rng(9);
  std::normal_distribution<float> nd;
  const int r = 12, cl = 5, n = r * cl;
  std::vector<float> g(n);
  for (float& v : g) v = nd(rng) * (1.0f + 0.5f * static_cast<float>(&v - g.data()) / cl);  // uneven rows
  auto update = [&](OptimizerName name) {
    OptimizerConfig c;
    c.name = name;
    c.lr = 1.0;
    c.weight_decay = 0.0;
    Optimizer opt(c, {{"w", 0, r, cl, ParamKind::matrix_hidden}}, n);
    std::vector<float> p(n, 0.0f);
    opt.step(p.data(), g.data(), 1.0, 1.0);
    return p;
  };
  const std::vector<float> mu = update(OptimizerName::muon), nm = update(OptimizerName::normuon);
  EXPECT_NEAR(global_norm(nm.data(), n), global_norm(mu.data(), n), 1e-4);
  double diff = 0;
  for (int i = 0; i < n; ++i) diff += std::abs(mu[i] - nm[i]);
  EXPECT_GT(diff, 1e-3);
}
