// Claims: parsing and validation of a spec's `claims:` block (file:line:col errors), and
// the audit over matched pairs with values worked out by hand.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "core/error.hpp"
#include "experiments/cell.hpp"
#include "registry/report/claims.hpp"
#include "registry/report/render.hpp"
#include "registry/report/report.hpp"
#include "tests/report/fixtures.hpp"

using namespace lar;
using namespace lar::report;
using experiments::Claim;
namespace fs = std::filesystem;

namespace {

// A 2 × 2 spec (optimizer with an lr that follows it, stack) plus a claims block.
std::string spec_text(const std::string& claims) {
  return "name: claims-test\n"
         "base: {budget: {steps: 10}, model: {architecture: gdn}}\n"
         "matrix:\n"
         "  optimizer: [adamw, normuon]\n"
         "  lr: {by: optimizer, adamw: [1.0e-3], normuon: [3.6e-4]}\n"
         "  stack: [hybrid, pure]\n"
         "  seed: [0]\n"
         "reference:\n"
         "  metrics: [final_loss, tok_s]\n"
         "claims:\n" +
         claims;
}

experiments::Plan load(const std::string& claims) {
  const fs::path dir = fs::temp_directory_path() / ("lar_claims_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path p = dir / "spec.yaml";
  std::ofstream(p) << spec_text(claims);
  return experiments::load_plan(p, "");
}

std::string error_of(const std::string& claims) {
  try {
    load(claims);
  } catch (const UserError& e) {
    return e.what();
  }
  return "(no error)";
}

Row row(const std::string& id, std::vector<std::pair<std::string, json>> axes, std::vector<double> values,
        std::optional<double> pub = std::nullopt, const std::string& metric = "final_loss") {
  Row r;
  r.id = id;
  r.axes = std::move(axes);
  MetricValue mv;
  mv.values = values;
  for (size_t i = 0; i < values.size(); ++i) {
    r.cell_ids.push_back(id + ".s" + std::to_string(i));
    mv.cell_ids.push_back(r.cell_ids.back());
  }
  mv.stats = sample_stats(values);
  r.ours[metric] = mv;
  if (pub) r.published[metric] = *pub;
  return r;
}

Claim pairwise(Claim::Kind kind, experiments::Selector a, experiments::Selector b) {
  Claim c;
  c.name = "test";
  c.kind = kind;
  c.sides = {std::move(a), std::move(b)};
  c.metric = "final_loss";
  return c;
}

}  // namespace

TEST(ClaimsParse, ShapesAndDefaults) {
  auto plan = load(
      "  - {name: muon, better: {optimizer: normuon}, than: {optimizer: adamw}, metric: final_loss}\n"
      "  - {name: fast, highest: {optimizer: adamw, stack: pure}, metric: tok_s, source: 'Table 2, p. 12'}\n"
      "  - {name: chain, order: [{stack: hybrid}, {stack: pure}], metric: final_loss, alpha: 0.01}\n"
      "  - {name: none, no_gain: {stack: hybrid}, than: {stack: pure}, where: {optimizer: adamw}, metric: final_loss}\n");
  ASSERT_EQ(plan.claims.size(), 4u);
  EXPECT_EQ(plan.claims[0].kind, Claim::Kind::better);
  EXPECT_TRUE(plan.claims[0].lower_is_better);
  EXPECT_EQ(plan.claims[0].sides[0][0].first, "optimizer");
  EXPECT_EQ(plan.claims[0].sides[1][0].second, "adamw");
  EXPECT_EQ(plan.claims[1].kind, Claim::Kind::highest);
  EXPECT_FALSE(plan.claims[1].lower_is_better);  // tokens per second: higher is better
  EXPECT_EQ(plan.claims[1].source, "Table 2, p. 12");
  EXPECT_EQ(plan.claims[2].sides.size(), 2u);
  EXPECT_EQ(plan.claims[2].alpha, 0.01);
  EXPECT_EQ(plan.claims[3].where.size(), 1u);
}

TEST(ClaimsParse, ErrorsNameFileLineColumn) {
  auto has = [](const std::string& msg, const std::string& part) {
    return msg.find(part) != std::string::npos;
  };
  std::string e = error_of("  - {name: x, better: {optimiser: normuon}, than: {optimizer: adamw}, metric: final_loss}\n");
  EXPECT_TRUE(has(e, "spec.yaml:11:")) << e;
  EXPECT_TRUE(has(e, "'optimiser' is not an axis of the matrix")) << e;
  EXPECT_TRUE(has(e, "did you mean 'optimizer'")) << e;
  e = error_of("  - {name: x, better: {optimizer: muon}, than: {optimizer: adamw}, metric: final_loss}\n");
  EXPECT_TRUE(has(e, "spec.yaml:11:35: error:")) << e;
  EXPECT_TRUE(has(e, "is not a value of axis 'optimizer' (values: adamw, normuon)")) << e;
  e = error_of("  - {name: x, better: {optimizer: normuon}, metric: final_loss}\n");
  EXPECT_TRUE(has(e, "'better' needs 'than'")) << e;
  e = error_of("  - {name: x, better: {optimizer: normuon}, than: {optimizer: adamw}, metric: final_los}\n");
  EXPECT_TRUE(has(e, "'final_los' is not a metric of this table")) << e;
  EXPECT_TRUE(has(e, "did you mean 'final_loss'")) << e;
  e = error_of("  - {name: x, better: {optimizer: normuon}, than: {stack: pure}, metric: final_loss}\n");
  EXPECT_TRUE(has(e, "must give different values to a common axis")) << e;
  e = error_of("  - {name: x, lowest: {stack: pure}, highest: {stack: pure}, metric: final_loss}\n");
  EXPECT_TRUE(has(e, "one claim per entry")) << e;
  e = error_of("  - {name: x, lowest: {stack: pure}, metric: final_loss, direction: down}\n");
  EXPECT_TRUE(has(e, "expected lower or higher")) << e;
  e = error_of("  - {name: x, lowest: {stack: pure}, metric: final_loss, colour: red}\n");
  EXPECT_TRUE(has(e, "unknown key 'colour'")) << e;
  e = error_of("  - {name: x, lowest: {seed: 0}, metric: final_loss}\n");
  EXPECT_TRUE(has(e, "'seed' cannot select rows")) << e;
  e = error_of("  - {name: x, grows_least: {stack: pure}, along: stack, metric: final_loss}\n");
  EXPECT_TRUE(has(e, "needs at least two numeric values")) << e;
  e = error_of("  - {name: x, lowest: {stack: pure}, metric: final_loss}\n  - {name: x, lowest: {stack: pure}, metric: final_loss}\n");
  EXPECT_TRUE(has(e, "spec.yaml:12:") && has(e, "used twice")) << e;
  e = error_of("  {name: x}\n");
  EXPECT_TRUE(has(e, "claims: expected a list")) << e;
}

TEST(ClaimsAudit, BetterOverMatchedPairsWithSeeds) {
  // Two pairs (pure, hybrid) with three seeds each; lr follows the optimizer, so it is
  // implied by the claim's axis and does not break the pairing.
  Report rep;
  rep.rows = {row("adamw.hybrid", {{"optimizer", "adamw"}, {"lr", 1e-3}, {"stack", "hybrid"}}, {3.0, 3.1, 3.2}, 2.4),
              row("normuon.hybrid", {{"optimizer", "normuon"}, {"lr", 3.6e-4}, {"stack", "hybrid"}}, {2.8, 2.9, 3.0}, 2.3),
              row("adamw.pure", {{"optimizer", "adamw"}, {"lr", 1e-3}, {"stack", "pure"}}, {3.5, 3.6, 3.7}, 2.5),
              row("normuon.pure", {{"optimizer", "normuon"}, {"lr", 3.6e-4}, {"stack", "pure"}}, {3.1, 3.2, 3.3}, 2.4)};
  auto res = audit_claims(rep, {pairwise(Claim::Kind::better, {{"optimizer", "normuon"}}, {{"optimizer", "adamw"}})});
  ASSERT_EQ(res.size(), 1u);
  const ClaimResult& r = res[0];
  ASSERT_EQ(r.pairs.size(), 2u);
  EXPECT_EQ(r.pairs[0].a, "normuon.hybrid");
  EXPECT_EQ(r.pairs[0].b, "adamw.hybrid");
  EXPECT_NEAR(*r.pairs[0].delta, -0.2, 1e-12);
  EXPECT_NEAR(*r.pairs[1].delta, -0.4, 1e-12);
  // Per pair: Welch with var 0.01 a side: se = sqrt(0.02 / 3), t = −0.2 / se, df = 4.
  EXPECT_NEAR(r.pairs[0].test->se, std::sqrt(0.02 / 3), 1e-12);
  EXPECT_NEAR(r.pairs[0].test->df, 4, 1e-12);
  const PairSummary& s = r.links[0];
  EXPECT_EQ(s.measured, 2);
  EXPECT_EQ(s.agree, 2);
  EXPECT_NEAR(*s.mean_delta, -0.3, 1e-12);
  // Mean of two differences: se² = (1/4) · 4 · 0.01 / 3, df = (0.01/3)² / (4 · (0.0025/3)² / 2) = 8.
  EXPECT_NEAR(*s.se, std::sqrt(0.01 / 3), 1e-12);
  EXPECT_NEAR(*s.df, 8, 1e-9);
  // t = −0.3 / 0.057735 = −5.196 on 8 df: two-sided p = 8.2628e-4 (Simpson integration of the t density).
  EXPECT_NEAR(*s.p, 8.262751660e-4, 1e-9);
  ASSERT_TRUE(s.ci.has_value());
  EXPECT_LT(s.ci->hi, 0);
  EXPECT_GE(s.ci->lo, -0.5 - 1e-12);  // the most extreme resample: −(0.4 + 0.6) / 2
  EXPECT_EQ(r.verdict, verdict::holds);
  EXPECT_EQ(s.published, 2);
  EXPECT_EQ(s.published_agree, 2);
  EXPECT_EQ(r.paper_consistent, std::optional<bool>(true));
  // Deterministic: the same audit twice gives the same interval.
  auto again = audit_claims(rep, {pairwise(Claim::Kind::better, {{"optimizer", "normuon"}}, {{"optimizer", "adamw"}})});
  EXPECT_EQ(again[0].links[0].ci->lo, s.ci->lo);
  EXPECT_EQ(again[0].links[0].ci->hi, s.ci->hi);
  // The reverse claim fails (significant the other way).
  auto rev = audit_claims(rep, {pairwise(Claim::Kind::better, {{"optimizer", "adamw"}}, {{"optimizer", "normuon"}})});
  EXPECT_EQ(rev[0].verdict, verdict::fails);
  EXPECT_EQ(rev[0].paper_consistent, std::optional<bool>(false));
}

TEST(ClaimsAudit, SingleSeedUsesTheSignTest) {
  Report rep;
  for (int i = 0; i < 8; ++i) {
    const std::string a = "a" + std::to_string(i);
    rep.rows.push_back(row("x." + a, {{"opt", "x"}, {"arch", a}}, {2.0}));
    rep.rows.push_back(row("y." + a, {{"opt", "y"}, {"arch", a}}, {2.1 + (i == 7 ? -0.2 : 0)}));
  }
  auto r = audit_claims(rep, {pairwise(Claim::Kind::better, {{"opt", "x"}}, {{"opt", "y"}})})[0];
  EXPECT_EQ(r.links[0].measured, 8);
  EXPECT_EQ(r.links[0].agree, 7);
  EXPECT_NEAR(r.links[0].sign_p, 18.0 / 256, 1e-15);
  EXPECT_FALSE(r.links[0].p.has_value());
  EXPECT_TRUE(r.links[0].se_across_pairs);
  EXPECT_EQ(r.verdict, verdict::inconclusive);  // 7 of 8: p = 0.07
  rep.rows.back().ours["final_loss"].values = {2.1};
  r = audit_claims(rep, {pairwise(Claim::Kind::better, {{"opt", "x"}}, {{"opt", "y"}})})[0];
  EXPECT_EQ(r.verdict, verdict::holds);  // 8 of 8: p = 2/256
  EXPECT_NE(r.why.find("8 of 8 pairs agree, sign test p = 0.00781"), std::string::npos) << r.why;
}

TEST(ClaimsAudit, NoGainOrderLowestGrowsLeast) {
  Report rep;
  // Mixed signs: no reliable gain holds.
  rep.rows = {row("g.none", {{"arch", "g"}, {"routing", "none"}}, {2.83}, 2.8319),
              row("g.cler", {{"arch", "g"}, {"routing", "cler"}}, {2.84}, 2.8333),
              row("d.none", {{"arch", "d"}, {"routing", "none"}}, {2.85}, 2.8511),
              row("d.cler", {{"arch", "d"}, {"routing", "cler"}}, {2.845}, 2.8507)};
  auto r = audit_claims(rep, {pairwise(Claim::Kind::no_gain, {{"routing", "cler"}}, {{"routing", "none"}})})[0];
  EXPECT_EQ(r.verdict, verdict::holds);
  EXPECT_EQ(r.paper_consistent, std::optional<bool>(true));
  // Every pair better on one seed: too few to tell.
  rep.rows[1].ours["final_loss"].values = {2.82};
  r = audit_claims(rep, {pairwise(Claim::Kind::no_gain, {{"routing", "cler"}}, {{"routing", "none"}})})[0];
  EXPECT_EQ(r.verdict, verdict::inconclusive);

  // Order: a < b < c on two tuples, one seed → sign test p = 0.5 per link: inconclusive;
  // one tuple out of order → that link fails? (1 of 2 agree: still inconclusive).
  Report ord;
  for (const char* h : {"g", "d"}) {
    ord.rows.push_back(row(std::string(h) + ".clvr", {{"arch", h}, {"routing", "clvr"}}, {2.0, 2.01, 2.02}));
    ord.rows.push_back(row(std::string(h) + ".clerh", {{"arch", h}, {"routing", "cler_h"}}, {2.1, 2.11, 2.12}));
    ord.rows.push_back(row(std::string(h) + ".none", {{"arch", h}, {"routing", "none"}}, {2.2, 2.21, 2.22}));
  }
  Claim oc;
  oc.name = "chain";
  oc.kind = Claim::Kind::order;
  oc.sides = {{{"routing", "clvr"}}, {{"routing", "cler_h"}}, {{"routing", "none"}}};
  oc.metric = "final_loss";
  r = audit_claims(ord, {oc})[0];
  ASSERT_EQ(r.links.size(), 2u);
  EXPECT_EQ(r.pairs.size(), 4u);
  EXPECT_NEAR(*r.links[0].mean_delta, -0.1, 1e-12);
  EXPECT_EQ(r.links[0].verdict, verdict::holds);
  EXPECT_EQ(r.links[1].verdict, verdict::holds);
  EXPECT_EQ(r.verdict, verdict::holds);
  EXPECT_NE(r.why.find("2 of 2 measured tuples fully ordered"), std::string::npos) << r.why;

  // Lowest: the target is best, ahead of the runner-up by 0.05 with 3 seeds.
  Report low;
  low.rows = {row("kda", {{"arch", "kda"}}, {2.27, 2.28, 2.29}, 2.273), row("gdn", {{"arch", "gdn"}}, {2.32, 2.33, 2.34}, 2.321),
              row("dn", {{"arch", "dn"}}, {2.40, 2.41, 2.42}, 2.299)};
  Claim lc;
  lc.name = "lowest";
  lc.kind = Claim::Kind::lowest;
  lc.sides = {{{"arch", "kda"}}};
  lc.metric = "final_loss";
  r = audit_claims(low, {lc})[0];
  EXPECT_EQ(*r.best, "kda");
  EXPECT_EQ(r.pairs[0].b, "gdn");
  EXPECT_NEAR(*r.pairs[0].delta, -0.05, 1e-12);
  EXPECT_EQ(r.verdict, verdict::holds);
  EXPECT_EQ(*r.published_best, "kda");
  EXPECT_EQ(r.paper_consistent, std::optional<bool>(true));
  ASSERT_TRUE(r.p_best.has_value());
  EXPECT_EQ(*r.p_best, 1.0);  // no resample of these seeds puts another row first
  lc.sides = {{{"arch", "dn"}}};
  r = audit_claims(low, {lc})[0];
  EXPECT_EQ(r.verdict, verdict::fails);
  EXPECT_EQ(r.paper_consistent, std::optional<bool>(false));

  // Grows least: pure 1.0 → 1.1 s (+10 %), hybrid 1.0 → 1.6 (+60 %), per seed.
  Report g;
  g.rows = {row("pure.4k", {{"stack", "pure"}, {"seq_len", 4096}}, {1.0}, std::nullopt, "sec_per_iter"),
            row("pure.32k", {{"stack", "pure"}, {"seq_len", 32768}}, {1.1}, std::nullopt, "sec_per_iter"),
            row("hybrid.4k", {{"stack", "hybrid"}, {"seq_len", 4096}}, {1.0}, std::nullopt, "sec_per_iter"),
            row("hybrid.32k", {{"stack", "hybrid"}, {"seq_len", 32768}}, {1.6}, std::nullopt, "sec_per_iter")};
  Claim gc;
  gc.name = "grows";
  gc.kind = Claim::Kind::grows_least;
  gc.sides = {{{"stack", "pure"}}};
  gc.along = "seq_len";
  gc.metric = "sec_per_iter";
  r = audit_claims(g, {gc})[0];
  ASSERT_EQ(r.ranking.size(), 2u);
  EXPECT_EQ(r.ranking[0].first, "pure");
  EXPECT_NEAR(r.ranking[0].second, 10, 1e-9);
  EXPECT_NEAR(r.ranking[1].second, 60, 1e-9);
  EXPECT_EQ(r.verdict, verdict::holds);
}

TEST(ClaimsAudit, NoRunsIsNotEnoughData) {
  Report rep;
  rep.rows = {row("x", {{"opt", "x"}}, {}), row("y", {{"opt", "y"}}, {})};
  auto r = audit_claims(rep, {pairwise(Claim::Kind::better, {{"opt", "x"}}, {{"opt", "y"}})})[0];
  EXPECT_EQ(r.verdict, verdict::no_data);
  EXPECT_NE(r.why.find("0 of 1"), std::string::npos);
}

TEST(ClaimsAudit, BuildReportAuditsTheInputsClaimsAndRendersThem) {
  using namespace lar::report::testing;
  TableInput in;
  in.experiment = "exp";
  in.metrics = {"final_loss"};
  for (const char* arch : {"gdn", "deltanet"})
    for (const char* routing : {"none", "cler"})
      for (int s = 0; s < 2; ++s)
        in.cells.push_back(cell(arch, routing, s, json{{"final_loss", std::string(routing) == "cler" ? 2.3 : 2.4}}));
  double t = 0;
  for (const auto& c : in.cells) {
    const bool cler = c.id.find("cler") != std::string::npos;
    const bool s1 = c.id.back() == '1';
    in.runs.push_back(completed_run(c, (cler ? 2.0 : 2.5) + (s1 ? 0.01 : 0), 1000, ++t));
  }
  in.claims = {pairwise(Claim::Kind::better, {{"routing", "cler"}}, {{"routing", "none"}})};
  in.claims[0].name = "cler beats none";
  Report rep = build_report(in);
  ASSERT_EQ(rep.claims.size(), 1u);
  EXPECT_EQ(rep.claims[0].links[0].measured, 2);
  EXPECT_NEAR(*rep.claims[0].links[0].mean_delta, -0.5, 1e-12);
  const std::string md = audit_markdown(rep);
  EXPECT_NE(md.find("### Claims"), std::string::npos);
  EXPECT_NE(md.find("| cler beats none | **holds** | 2/2 |"), std::string::npos) << md;
  EXPECT_NE(md.find("Kendall τ-b"), std::string::npos);
  const json j = audit_json(rep);
  EXPECT_EQ(j["claims"][0]["verdict"], "holds");
  EXPECT_EQ(j["claims"][0]["pairs"].size(), 2u);
}
