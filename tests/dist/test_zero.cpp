// ZeRO-1 (trainer/optim/zero.hpp) on the CPU: N in-process ranks (tests/dist/fake_group.hpp)
// against the unsharded Optimizer given the same summed gradients, bit for bit; the plan;
// checkpoints resumed on another world size; optimiser-state bytes per rank; the config key.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <set>

#include "core/config_schema.hpp"
#include "core/error.hpp"
#include "tests/dist/fake_group.hpp"
#include "trainer/optim/optimizer.hpp"
#include "trainer/optim/zero.hpp"

extern "C" void openblas_set_num_threads(int);

namespace lar::optim {
namespace {

using testing::FakeGroup;

// The ranks are threads: one BLAS thread each (Newton–Schulz), not a pool per rank.
const bool kOneBlasThread = [] {
  openblas_set_num_threads(1);
  return true;
}();

// A small model's table: an embedding and a head larger than a norm block (so that AdamW
// cuts fall inside them), hidden matrices of several shapes (tall, wide, square, repeated,
// none divisible by 2, 3 or 4 throughout), norms, biases, scalars. Laid out with gaps.
std::vector<ParamView> small_table(std::size_t* total) {
  std::vector<ParamView> t;
  std::size_t off = 0;
  auto add = [&](const char* name, int rows, int cols, ParamKind kind) {
    ParamView v;
    v.name = name, v.offset = off, v.rows = rows, v.cols = cols, v.kind = kind;
    off += v.size() + 3;  // a gap the optimiser must not touch
    t.push_back(v);
  };
  add("embed", 1201, 97, ParamKind::embedding);  // 116497: 8 norm blocks
  add("l0.norm", 1, 97, ParamKind::norm);
  add("l0.q", 97, 97, ParamKind::matrix_hidden);
  add("l0.up", 97, 61, ParamKind::matrix_hidden);
  add("l0.down", 61, 97, ParamKind::matrix_hidden);
  add("l0.bias", 1, 61, ParamKind::bias);
  add("l0.gate", 1, 1, ParamKind::scalar);
  add("l1.norm", 1, 97, ParamKind::norm);
  add("l1.q", 97, 97, ParamKind::matrix_hidden);
  add("l1.up", 97, 61, ParamKind::matrix_hidden);
  add("l1.down", 61, 97, ParamKind::matrix_hidden);
  add("l1.route", 13, 97, ParamKind::matrix_hidden);
  add("final.norm", 1, 97, ParamKind::norm);
  add("head", 353, 97, ParamKind::head);  // 34241: three blocks
  *total = off;
  return t;
}

OptimizerConfig config_for(OptimizerName name) {
  OptimizerConfig c;
  c.name = name;
  c.lr = 2e-2;
  c.weight_decay = 0.1;
  c.grad_clip = 1.0;
  if (name != OptimizerName::adamw) {
    c.scalar_lr = 3e-2;  // the AdamW group's own lr
    c.scalar_weight_decay = 0.05;
  }
  return c;
}

// Rank r's local gradients at step s: deterministic; scale so that some steps clip and some do not.
std::vector<float> local_grads(std::size_t total, int rank, int step, int world) {
  std::mt19937 gen(static_cast<unsigned>(1000 * step + 17 * rank + 7 * world));
  std::normal_distribution<float> d(0.0f, step % 2 ? 1e-4f : 5e-3f);
  std::vector<float> g(total);
  for (float& x : g) x = d(gen);
  return g;
}

std::vector<float> initial_params(std::size_t total) {
  std::mt19937 gen(42);
  std::normal_distribution<float> d(0.0f, 0.02f);
  std::vector<float> p(total);
  for (float& x : p) x = d(gen);
  return p;
}

// The fake group's reduction: rank 0's value, + rank 1's, + ... per element.
std::vector<float> summed(std::size_t total, int step, int world) {
  std::vector<float> s = local_grads(total, 0, step, world);
  for (int r = 1; r < world; ++r) {
    const std::vector<float> g = local_grads(total, r, step, world);
    for (std::size_t i = 0; i < total; ++i) s[i] += g[i];
  }
  return s;
}

double lr_at(int step) { return 1.0 - 0.1 * step; }
double scalar_at(int step) { return std::min(1.0, 0.5 + 0.25 * step); }

struct Reference {
  std::vector<float> params;
  std::vector<double> norms;
  std::string state;
};

// The unsharded optimiser for steps [from, to) on the summed gradients of `worlds[step]` ranks.
Reference run_unsharded(const OptimizerConfig& cfg, const std::vector<ParamView>& table, std::size_t total,
                        const std::vector<int>& worlds, int to) {
  Reference ref;
  ref.params = initial_params(total);
  Optimizer opt(cfg, table, total);
  for (int s = 0; s < to; ++s) {
    std::vector<float> g = summed(total, s, worlds[static_cast<std::size_t>(s)]);
    ref.norms.push_back(opt.clip_gradients(g.data()));
    opt.step(ref.params.data(), g.data(), lr_at(s), scalar_at(s));
  }
  ref.state = opt.save_state();
  return ref;
}

struct RankResult {
  std::vector<float> params;
  std::vector<double> norms;
  std::string state;
  std::size_t state_bytes = 0;
};

// ZeRO-1 on `world` ranks for steps [from, to), from `params` and optional state blob.
std::vector<RankResult> run_zero(const OptimizerConfig& cfg, const std::vector<ParamView>& table, std::size_t total,
                                 int world, int from, int to, const std::vector<float>& params0,
                                 const std::string& state0) {
  std::vector<RankResult> out(static_cast<std::size_t>(world));
  FakeGroup group(world);
  group.run([&](int rank, Communicator& comm) {
    RankResult& res = out[static_cast<std::size_t>(rank)];
    res.params = params0;
    ZeroOptimizer zero(cfg, table, total, comm);
    if (!state0.empty()) zero.load_state(state0);
    for (int s = from; s < to; ++s) {
      std::vector<float> g = local_grads(total, rank, s, world);
      zero.reduce_gradients(g.data());
      res.norms.push_back(zero.clip_gradients(g.data()));
      zero.step(res.params.data(), g.data(), lr_at(s), scalar_at(s));
    }
    res.state = zero.save_state();
    res.state_bytes = zero.state_bytes();
  });
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(float) * a.size()) == 0;
}

std::size_t first_difference(const std::vector<float>& a, const std::vector<float>& b) {
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) return i;
  return a.size() == b.size() ? a.size() : std::min(a.size(), b.size());
}

const char* name_of(OptimizerName n) {
  return n == OptimizerName::adamw ? "adamw" : n == OptimizerName::muon ? "muon" : "normuon";
}

TEST(ZeroPlan, CoversEveryElementOnceOnBlockBoundariesAndKeepsMatricesWhole) {
  std::size_t total = 0;
  const std::vector<ParamView> table = small_table(&total);
  for (OptimizerName n : {OptimizerName::adamw, OptimizerName::muon, OptimizerName::normuon})
    for (int world : {1, 2, 3, 4, 7}) {
      SCOPED_TRACE(std::string(name_of(n)) + " world " + std::to_string(world));
      const OptimizerConfig cfg = config_for(n);
      const ZeroPlan plan = plan_zero(cfg, table, world);
      EXPECT_EQ(plan.world, world);
      std::vector<int> owner(total, -1);
      for (const ZeroPiece& k : plan.pieces) {
        const ParamView& p = table[k.param];
        ASSERT_LT(k.lo, k.hi);
        ASSERT_LE(k.hi, p.size());
        ASSERT_GE(k.owner, 0);
        ASSERT_LT(k.owner, world);
        EXPECT_EQ(k.lo % kNormBlock, 0u) << p.name;
        EXPECT_TRUE(k.hi == p.size() || k.hi % kNormBlock == 0) << p.name;
        const bool muon = n != OptimizerName::adamw && p.kind == ParamKind::matrix_hidden;
        EXPECT_EQ(k.muon, muon) << p.name;
        if (muon) {
          EXPECT_TRUE(k.lo == 0 && k.hi == p.size()) << p.name;
        }
        for (std::size_t i = k.lo; i < k.hi; ++i) {
          EXPECT_EQ(owner[p.offset + i], -1) << p.name << " element " << i << " has two owners";
          owner[p.offset + i] = k.owner;
        }
      }
      for (const ParamView& p : table)
        for (std::size_t i = 0; i < p.size(); ++i) ASSERT_NE(owner[p.offset + i], -1) << p.name << " " << i;
      // The segments are the pieces' flat ranges.
      std::size_t covered = 0;
      for (const Segment& s : plan.segments(table)) {
        for (std::size_t i = s.offset; i < s.offset + s.count; ++i) ASSERT_EQ(owner[i], s.owner);
        covered += s.count;
      }
      std::size_t numel = 0;
      for (const ParamView& p : table) numel += p.size();
      EXPECT_EQ(covered, numel);
      // Deterministic: the same table gives the same plan.
      const ZeroPlan again = plan_zero(cfg, table, world);
      ASSERT_EQ(again.pieces.size(), plan.pieces.size());
      for (std::size_t i = 0; i < plan.pieces.size(); ++i) {
        EXPECT_EQ(again.pieces[i].lo, plan.pieces[i].lo);
        EXPECT_EQ(again.pieces[i].owner, plan.pieces[i].owner);
      }
    }
  // A cut falls inside a tensor (on a block boundary) at every world size the bit tests use.
  for (OptimizerName n : {OptimizerName::adamw, OptimizerName::normuon})
    for (int world : {2, 3, 4}) {
      bool split = false;
      for (const ZeroPiece& k : plan_zero(config_for(n), table, world).pieces) split = split || (k.lo > 0);
      EXPECT_TRUE(split) << name_of(n) << " world " << world;
    }
  EXPECT_THROW(plan_zero(config_for(OptimizerName::adamw), table, 0), RuntimeError);
}

TEST(ZeroPlan, MuonMatricesGoLargestFirstToTheLeastLoadedRank) {
  std::vector<ParamView> t;
  std::size_t off = 0;
  for (int rows : {10, 40, 20, 30, 40}) {
    ParamView v;
    v.name = "m" + std::to_string(t.size()), v.offset = off, v.rows = rows, v.cols = 10;
    off += v.size();
    t.push_back(v);
  }
  const ZeroPlan plan = plan_zero(config_for(OptimizerName::muon), t, 2);
  // Largest first (ties: table order): m1 (400) → 0, m4 (400) → 1, m3 (300) → 0, m2 (200) → 1, m0 (100) → 1.
  std::vector<int> owner(t.size(), -1);
  for (const ZeroPiece& k : plan.pieces) owner[k.param] = k.owner;
  EXPECT_EQ(owner, (std::vector<int>{1, 0, 1, 0, 1}));
}

class ZeroBitIdentical : public ::testing::TestWithParam<std::tuple<OptimizerName, int>> {};

TEST_P(ZeroBitIdentical, SameParametersAsTheUnshardedOptimiser) {
  const auto [name, world] = GetParam();
  std::size_t total = 0;
  const std::vector<ParamView> table = small_table(&total);
  const OptimizerConfig cfg = config_for(name);
  constexpr int kSteps = 4;
  const Reference ref = run_unsharded(cfg, table, total, std::vector<int>(kSteps, world), kSteps);
  // The test must be able to fail: clipping acts on some steps and not on others.
  int clipped = 0;
  for (double n : ref.norms) clipped += n > cfg.grad_clip;
  EXPECT_GT(clipped, 0);
  EXPECT_LT(clipped, kSteps);
  const std::vector<RankResult> ranks = run_zero(cfg, table, total, world, 0, kSteps, initial_params(total), "");
  for (int r = 0; r < world; ++r) {
    const RankResult& res = ranks[static_cast<std::size_t>(r)];
    EXPECT_TRUE(same_bits(res.params, ref.params))
        << "rank " << r << ": first difference at float " << first_difference(res.params, ref.params);
    ASSERT_EQ(res.norms.size(), ref.norms.size());
    for (int s = 0; s < kSteps; ++s)
      EXPECT_EQ(std::memcmp(&res.norms[s], &ref.norms[s], sizeof(double)), 0)
          << "rank " << r << " step " << s << ": " << res.norms[s] << " vs " << ref.norms[s];
    // The gathered state is the unsharded optimiser's, byte for byte.
    EXPECT_TRUE(res.state == ref.state) << "rank " << r;
  }
  // The parameters moved (the comparison is not of untouched buffers).
  EXPECT_FALSE(same_bits(ref.params, initial_params(total)));
}

INSTANTIATE_TEST_SUITE_P(Zero, ZeroBitIdentical,
                         ::testing::Combine(::testing::Values(OptimizerName::adamw, OptimizerName::muon,
                                                              OptimizerName::normuon),
                                            ::testing::Values(1, 2, 3, 4)),
                         [](const auto& info) {
                           return std::string(name_of(std::get<0>(info.param))) + "_world" +
                                  std::to_string(std::get<1>(info.param));
                         });

class ZeroResume : public ::testing::TestWithParam<OptimizerName> {};

// 3 steps at 2 ranks, checkpoint, 2 more at 3 ranks and at 1 (ZeRO-1 and unsharded): the parameters and state of an
// uninterrupted unsharded run on the same summed gradients, bit for bit.
TEST_P(ZeroResume, OnAnotherWorldSize) {
  const OptimizerName name = GetParam();
  std::size_t total = 0;
  const std::vector<ParamView> table = small_table(&total);
  const OptimizerConfig cfg = config_for(name);
  const std::vector<RankResult> first = run_zero(cfg, table, total, 2, 0, 3, initial_params(total), "");
  ASSERT_TRUE(first[0].state == first[1].state);
  ASSERT_TRUE(same_bits(first[0].params, first[1].params));
  for (int world : {3, 1}) {
    SCOPED_TRACE("resumed on " + std::to_string(world) + " rank(s)");
    const Reference ref = run_unsharded(cfg, table, total, {2, 2, 2, world, world}, 5);
    const std::vector<RankResult> second = run_zero(cfg, table, total, world, 3, 5, first[0].params, first[0].state);
    for (int r = 0; r < world; ++r) {
      const RankResult& res = second[static_cast<std::size_t>(r)];
      EXPECT_TRUE(same_bits(res.params, ref.params))
          << "rank " << r << ": first difference at float " << first_difference(res.params, ref.params);
      EXPECT_TRUE(res.state == ref.state) << "rank " << r;
    }
    // An unsharded optimiser resumes from the sharded checkpoint too.
    Optimizer plain(cfg, table, total);
    plain.load_state(first[0].state);
    std::vector<float> p = first[0].params;
    for (int s = 3; s < 5; ++s) {
      std::vector<float> g = summed(total, s, world);
      plain.clip_gradients(g.data());
      plain.step(p.data(), g.data(), lr_at(s), scalar_at(s));
    }
    EXPECT_TRUE(same_bits(p, ref.params));
  }
}

INSTANTIATE_TEST_SUITE_P(Zero, ZeroResume,
                         ::testing::Values(OptimizerName::adamw, OptimizerName::muon, OptimizerName::normuon),
                         [](const auto& info) { return std::string(name_of(info.param)); });

TEST(ZeroState, LoadRejectsAnotherTable) {
  std::size_t total = 0;
  std::vector<ParamView> table = small_table(&total);
  const OptimizerConfig cfg = config_for(OptimizerName::adamw);
  Optimizer other(cfg, std::vector<ParamView>(table.begin(), table.end() - 1), total);
  const std::string blob = other.save_state();
  FakeGroup group(2);
  int threw = 0;
  std::mutex mu;
  group.run([&](int, Communicator& comm) {
    ZeroOptimizer zero(cfg, table, total, comm);
    try {
      zero.load_state(blob);
    } catch (const RuntimeError&) {
      std::lock_guard<std::mutex> lock(mu);
      ++threw;
    }
  });
  EXPECT_EQ(threw, 2);
}

// A 12-layer d=768 model's table (planning only, nothing allocated but the plan).
std::vector<ParamView> large_table() {
  std::vector<ParamView> t;
  std::size_t off = 0;
  auto add = [&](std::string name, int rows, int cols, ParamKind kind) {
    ParamView v;
    v.name = std::move(name), v.offset = off, v.rows = rows, v.cols = cols, v.kind = kind;
    off += v.size();
    t.push_back(v);
  };
  add("embed", 32000, 768, ParamKind::embedding);
  for (int l = 0; l < 12; ++l) {
    const std::string p = "l" + std::to_string(l) + ".";
    add(p + "norm1", 1, 768, ParamKind::norm);
    for (const char* m : {"q", "k", "v", "o"}) add(p + m, 768, 768, ParamKind::matrix_hidden);
    add(p + "norm2", 1, 768, ParamKind::norm);
    add(p + "gate", 2048, 768, ParamKind::matrix_hidden);
    add(p + "up", 2048, 768, ParamKind::matrix_hidden);
    add(p + "down", 768, 2048, ParamKind::matrix_hidden);
  }
  add("final.norm", 1, 768, ParamKind::norm);
  add("head", 32000, 768, ParamKind::head);
  return t;
}

TEST(ZeroState, BytesPerRankAreAboutFullOverWorld) {
  const std::vector<ParamView> table = large_table();
  std::size_t total = 0;
  for (const ParamView& p : table) total = std::max(total, p.offset + p.size());
  for (OptimizerName n : {OptimizerName::adamw, OptimizerName::muon, OptimizerName::normuon}) {
    const OptimizerConfig cfg = config_for(n);
    std::size_t largest = 0;  // the largest Muon matrix's state
    for (const ParamView& p : table)
      if (n != OptimizerName::adamw && p.kind == ParamKind::matrix_hidden)
        largest = std::max(largest, sizeof(float) * (p.size() + std::max(p.rows, p.cols)));
    for (int world : {1, 2, 3, 4, 8}) {
      SCOPED_TRACE(std::string(name_of(n)) + " world " + std::to_string(world));
      const StateBytes b = optimizer_state_bytes(cfg, table, world);
      ASSERT_EQ(b.per_rank.size(), static_cast<std::size_t>(world));
      std::size_t sum = 0;
      for (std::size_t x : b.per_rank) {
        sum += x;
        // AdamW's cuts move down by less than a block (2 floats per element); Muon's
        // assignment is off by at most the largest matrix.
        EXPECT_LE(x, b.full / world + largest + 2 * sizeof(float) * kNormBlock + sizeof(float) * world);
        EXPECT_GE(x + largest + 2 * sizeof(float) * kNormBlock * static_cast<std::size_t>(world), b.full / world);
      }
      EXPECT_EQ(sum, b.full);
      if (world == 1) {
        EXPECT_EQ(b.per_rank[0], b.full);
      }
    }
  }
  // The accounting matches what the optimisers allocate (the small table, every world size).
  std::size_t small_total = 0;
  const std::vector<ParamView> small = small_table(&small_total);
  for (OptimizerName n : {OptimizerName::adamw, OptimizerName::normuon}) {
    const OptimizerConfig cfg = config_for(n);
    Optimizer full(cfg, small, small_total);
    for (int world : {1, 3}) {
      const StateBytes b = optimizer_state_bytes(cfg, small, world);
      EXPECT_EQ(b.full, sizeof(float) * full.state_floats());
      std::vector<std::size_t> actual(static_cast<std::size_t>(world));
      FakeGroup group(world);
      group.run([&](int rank, Communicator& comm) {
        ZeroOptimizer zero(cfg, small, small_total, comm);
        actual[static_cast<std::size_t>(rank)] = zero.state_bytes();
      });
      EXPECT_EQ(actual, b.per_rank) << name_of(n) << " world " << world;
    }
  }
}

TEST(ZeroConfig, StageKeyIsValidated) {
  auto with_stage = [](json v) {
    json c = json::object();
    c["optimizer"]["zero_stage"] = std::move(v);
    return c;
  };
  EXPECT_EQ(OptimizerConfig::from_json(json::object()).zero_stage, 0);  // the default
  EXPECT_EQ(OptimizerConfig::from_json(with_stage(0)).zero_stage, 0);
  EXPECT_EQ(OptimizerConfig::from_json(with_stage(1)).zero_stage, 1);
  // Stages 2 and 3 are named as not implemented; -1 and 4 are no stage at all.
  for (int bad : {2, 3, -1, 4}) {
    try {
      OptimizerConfig::from_json(with_stage(bad));
      ADD_FAILURE() << "zero_stage " << bad << " accepted";
    } catch (const UserError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("optimizer.zero_stage"), std::string::npos) << m;
      EXPECT_NE(m.find(std::to_string(bad)), std::string::npos) << m;
      if (bad == 2 || bad == 3) {
        EXPECT_NE(m.find("not implemented"), std::string::npos) << m;
      }
    }
  }
  // Not an integer: the schema says so.
  EXPECT_FALSE(validate_config(with_stage("one")).empty());
  EXPECT_FALSE(validate_config(with_stage(1.5)).empty());
  EXPECT_TRUE(validate_config(with_stage(1)).empty());
  // At the default the key changes nothing: a config without it equals one with 0.
  EXPECT_EQ(with_defaults(json::object()), with_defaults(with_stage(0)));
}

}  // namespace
}  // namespace lar::optim
