// The scorers of eval/ against the model itself: log-likelihoods equal a direct
// mask-weighted forward pass, batching and padding change nothing, the recurrent decoder
// (mixers' step()) gives the full forward's log-probabilities position by position, greedy
// generation follows the decoder's argmax chain; task-file and length parsing errors.
#include <gtest/gtest.h>

#include <cmath>

#include "core/error.hpp"
#include "eval/decoder.hpp"
#include "eval/long_context.hpp"
#include "eval/loglik.hpp"
#include "eval/task_files.hpp"
#include "registry/report/figure.hpp"
#include "registry/report/report.hpp"
#include "tests/temp_dir.hpp"
#include "trainer/data/rng.hpp"
#include "trainer/train.hpp"

using namespace lar;

namespace {

constexpr int kVocab = 64;

json tiny_config(const std::string& arch, const json& model_extra = json::object()) {
  json m = {{"architecture", arch}, {"n_layers", 2}, {"d_model", 32}, {"n_heads", 2}, {"vocab_size", kVocab},
            {"chunk_size", 8}, {"stack", arch == "softmax" ? "dense" : "pure"}};
  m.update(model_extra);
  // A synthetic task: no data files needed to build the model.
  return trainer::prepare_config({{"model", m}, {"data", {{"task", "mqar"}, {"seq_len", 64}}}, {"threads", 1}});
}

struct TinyModel {
  std::unique_ptr<kernels::Backend> be;
  std::unique_ptr<trainer::Model> model;
  explicit TinyModel(const json& cfg, uint64_t seed = 7) {
    be = kernels::make_backend("cpu", 1);
    model = std::make_unique<trainer::Model>(cfg, *be);
    model->init(seed);
    // Every parameter away from its init (zero routing projections, unit norms, small
    // weights would hide a wrong block in near-uniform predictions).
    data::Rng rng(seed, "eval-test-params", 0);
    float* p = model->params().host_params();
    for (int64_t i = 0; i < model->params().numel(); ++i)
      p[i] += static_cast<float>(0.3 * (static_cast<double>(rng.below(2001)) / 1000.0 - 1.0));
  }
};

std::vector<int32_t> random_tokens(data::Rng& rng, int n) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<int32_t>(rng.below(kVocab));
  return t;
}

// −Σ log p(continuation) by the model's own masked loss over one sequence.
double direct_logprob(trainer::Model& m, const eval::Request& q) {
  std::vector<int32_t> full = q.context;
  full.insert(full.end(), q.continuation.begin(), q.continuation.end());
  data::Batch b;
  b.batch = 1;
  b.seq_len = static_cast<int>(full.size()) - 1;
  b.inputs.assign(full.begin(), full.end() - 1);
  b.targets.assign(full.begin() + 1, full.end());
  b.loss_mask.assign(b.inputs.size(), 0.f);
  for (size_t k = q.context.size() - 1; k < b.inputs.size(); ++k) b.loss_mask[k] = 1.f;
  const auto r = m.evaluate(b);
  return -r.loss * r.mask_sum;
}

}  // namespace

TEST(EvalScore, LogLikelihoodsEqualADirectForwardAtAnyBatching) {
  TinyModel tm(tiny_config("gdn"));
  data::Rng rng(1, "eval-test", 0);
  std::vector<eval::Request> reqs;
  for (int i = 0; i < 7; ++i) reqs.push_back({random_tokens(rng, 3 + 5 * i % 17), random_tokens(rng, 1 + i % 4)});
  const auto one = eval::score(*tm.model, reqs, {1, 64, false});
  const auto three = eval::score(*tm.model, reqs, {3, 64, true});
  for (size_t i = 0; i < reqs.size(); ++i) {
    const double want = direct_logprob(*tm.model, reqs[i]);
    EXPECT_NEAR(one[i].logprob, want, 1e-4 * std::max(1.0, std::abs(want))) << "request " << i;
    EXPECT_NEAR(three[i].logprob, want, 1e-4 * std::max(1.0, std::abs(want))) << "request " << i;
    ASSERT_EQ(three[i].token_logprobs.size(), reqs[i].continuation.size());
    ASSERT_EQ(three[i].top_logprobs.size(), reqs[i].continuation.size());
    bool greedy = true;
    for (size_t k = 0; k < reqs[i].continuation.size(); ++k) {
      // The argmax is at least as likely as the actual token; equal exactly when it is it.
      EXPECT_GE(three[i].top_logprobs[k], three[i].token_logprobs[k] - 1e-5);
      EXPECT_LE(three[i].top_logprobs[k], 0.0);
      greedy = greedy && three[i].argmax[k] == reqs[i].continuation[k];
    }
    EXPECT_EQ(three[i].greedy, greedy);
  }
}

TEST(EvalScore, LeftTruncationKeepsTheLastTokens) {
  TinyModel tm(tiny_config("softmax"));
  data::Rng rng(2, "eval-test", 0);
  eval::Request q{random_tokens(rng, 40), random_tokens(rng, 5)};
  const auto r = eval::score(*tm.model, {q}, {4, 16, false});
  EXPECT_EQ(r[0].dropped_context, 40 + 5 - 17);
  eval::Request cut{std::vector<int32_t>(q.context.end() - 12, q.context.end()), q.continuation};
  EXPECT_NEAR(r[0].logprob, direct_logprob(*tm.model, cut), 1e-4);
  EXPECT_THROW(eval::score(*tm.model, {{{1}, random_tokens(rng, 17)}}, {4, 16, false}), UserError);
  EXPECT_THROW(eval::score(*tm.model, {{{1}, {kVocab}}}, {4, 16, false}), UserError);
}

class EvalDecoder : public ::testing::TestWithParam<std::pair<std::string, json>> {};

TEST_P(EvalDecoder, StepLogProbabilitiesEqualTheFullForward) {
  const auto& [arch, extra] = GetParam();
  TinyModel tm(tiny_config(arch, extra));
  data::Rng rng(3, "eval-test", 0);
  const int B = 2, T = 19;
  std::vector<std::vector<int32_t>> seqs = {random_tokens(rng, T + 1), random_tokens(rng, T + 1)};
  std::vector<eval::Request> reqs;
  for (const auto& s : seqs) reqs.push_back({{s[0]}, std::vector<int32_t>(s.begin() + 1, s.end())});
  const auto want = eval::score(*tm.model, reqs, {B, 64, false});
  eval::Decoder dec(*tm.model, B, T + 1);
  for (int t = 0; t < T; ++t) {
    std::vector<int32_t> cur = {seqs[0][t], seqs[1][t]}, next = {seqs[0][t + 1], seqs[1][t + 1]};
    std::vector<double> lp;
    const auto am = dec.step(cur, &next, &lp);
    for (int r = 0; r < B; ++r) {
      EXPECT_NEAR(lp[r], want[r].token_logprobs[t], 2e-4) << arch << " row " << r << " position " << t;
      EXPECT_EQ(am[r], want[r].argmax[t]) << arch << " row " << r << " position " << t;
    }
  }
  EXPECT_EQ(dec.position(), T);
}

INSTANTIATE_TEST_SUITE_P(
    Mixers, EvalDecoder,
    ::testing::Values(std::make_pair(std::string("softmax"), json::object()),
                      std::make_pair(std::string("gdn"), json::object()),
                      std::make_pair(std::string("gla"), json{{"ccq", {{"enabled", true}}}}),
                      std::make_pair(std::string("gdn"), json{{"stack", "hybrid"}, {"hybrid_ratio", 1}, {"n_layers", 4}, {"routing", "clvr"}}),
                      std::make_pair(std::string("deltanet"), json{{"routing", "cler_h"}, {"routing_rank", 4}})),
    [](const auto& info) { return "case" + std::to_string(info.index); });

TEST(EvalGenerate, GreedyGenerationFollowsTheArgmaxChain) {
  TinyModel tm(tiny_config("gdn"));
  data::Rng rng(4, "eval-test", 0);
  const std::vector<std::vector<int32_t>> prompts = {random_tokens(rng, 5), random_tokens(rng, 9), random_tokens(rng, 2)};
  const auto gen = eval::generate(*tm.model, prompts, 6, 64, 2);
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_EQ(gen[i].size(), 6u);
    // Each generated token is the argmax given everything before it.
    std::vector<int32_t> ctx = prompts[i];
    for (int32_t t : gen[i]) {
      const auto s = eval::score(*tm.model, {{ctx, {t}}}, {1, 64, false});
      EXPECT_TRUE(s[0].greedy);
      ctx.push_back(t);
    }
  }
}

TEST(EvalTaskFiles, ShapesAndErrorsNameTheLine) {
  TempDir d;
  auto mc = d.write("HellaSwag.jsonl", "{\"context\": \"a\", \"choices\": [\"b\", \"c\"], \"gold\": 0}\n");
  auto t = eval::open_task_file(mc.string());
  EXPECT_EQ(t.name, "hellaswag");
  EXPECT_EQ(t.kind, eval::TaskKind::multiple_choice);
  EXPECT_EQ(t.sha256.size(), 64u);
  auto wino = d.write("w.jsonl", "{\"contexts\": [\"a\", \"b\"], \"continuation\": \"c\", \"gold\": 1}\n");
  EXPECT_EQ(eval::open_task_file("wino=" + wino.string()).name, "wino");
  auto lam = d.write("lambada_openai.jsonl", "{\"text\": \"x y\"}\n");
  EXPECT_EQ(eval::open_task_file(lam.string()).kind, eval::TaskKind::lambada);
  EXPECT_EQ(eval::open_task_file("docs=" + lam.string()).kind, eval::TaskKind::perplexity);
  EXPECT_EQ(eval::open_task_file(d.write("wiki.txt", "w o r d s").string()).kind, eval::TaskKind::perplexity);
  auto bad = d.write("bad.jsonl", "{\"text\": \"ok\"}\n{\"text\": oops}\n");
  try {
    eval::open_task_file(bad.string());
    FAIL() << "a malformed line must be refused";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find(bad.string() + ":2:"), std::string::npos) << e.what();
  }
  auto odd = d.write("odd.jsonl", "{\"question\": \"?\"}\n");
  EXPECT_THROW(eval::open_task_file(odd.string()), UserError);
  EXPECT_THROW(eval::open_task_file((d.path / "missing.jsonl").string()), UserError);
  EXPECT_THROW(eval::open_task_file("bad name=" + mc.string()), UserError);
}

TEST(EvalLengths, ParsesPlainAndKilo) {
  EXPECT_EQ(eval::parse_lengths("4096,8K,2k", "--lengths"), (std::vector<int>{4096, 8192, 2048}));
  EXPECT_THROW(eval::parse_lengths("4096,x", "--lengths"), UserError);
  EXPECT_THROW(eval::parse_lengths("1", "--lengths"), UserError);
  EXPECT_THROW(eval::parse_lengths("", "--lengths"), UserError);
}

// Paper-table columns read `lar eval`'s scalars by name; a published percentage of a
// recorded fraction takes the _pct suffix.
TEST(EvalColumns, TablesReadRecordedScalarsAndPercentages) {
  report::ReportRun r;
  r.summary = {{"hellaswag_acc_norm", 0.4131}, {"wikitext_ppl", 17.5}, {"final_loss", 2.0}};
  bool proxy = true;
  EXPECT_DOUBLE_EQ(*report::run_metric(r, "hellaswag_acc_norm"), 0.4131);
  EXPECT_DOUBLE_EQ(*report::run_metric(r, "hellaswag_acc_norm_pct"), 41.31);
  EXPECT_DOUBLE_EQ(*report::run_metric(r, "wikitext_ppl", &proxy), 17.5);
  EXPECT_FALSE(proxy);  // the recorded perplexity, not the validation-loss stand-in
  EXPECT_FALSE(report::run_metric(r, "piqa_acc_pct").has_value());
  r.summary["mkniah_acc@4096"] = 0.25;
  r.summary["acc@2048"] = 0.5;
  EXPECT_DOUBLE_EQ(*report::run_metric(r, "mkniah_acc_pct@4K"), 25.0);
  EXPECT_DOUBLE_EQ(*report::run_metric(r, "mkniah_acc_pct@4096"), 25.0);
  EXPECT_DOUBLE_EQ(*report::run_metric(r, "acc_pct@2K"), 50.0);  // the trainer's own key
}

// `lar export figure ccq/fig3_4`: one line per row through its ppl@L columns.
TEST(EvalColumns, PerplexityAtLengthsFigure) {
  report::Report rep;
  rep.metrics = {"ppl@4096", "ppl@8192", "ppl@16384", "final_loss"};
  report::Row row;
  row.id = "gdn.ccq";
  for (auto [m, v] : std::vector<std::pair<std::string, double>>{{"ppl@8192", 12.0}, {"ppl@4096", 10.0}, {"final_loss", 2.0}}) {
    report::MetricValue mv;
    mv.values = {v};
    mv.run_ids = {"x/gdn.ccq.s0"};
    mv.stats.n = 1;
    mv.stats.mean = v;
    row.ours[m] = mv;
  }
  rep.rows.push_back(row);
  const auto fig = report::metric_vs_suffix(rep, "ppl@", /*exp_y=*/false);
  ASSERT_EQ(fig.series.size(), 1u);
  ASSERT_EQ(fig.series[0].points.size(), 2u);  // 16K has no value; final_loss is no length
  EXPECT_EQ(fig.series[0].points[0].x, 4096);
  EXPECT_EQ(fig.series[0].points[0].y, 10.0);
  EXPECT_EQ(fig.series[0].points[1].x, 8192);
  EXPECT_EQ(fig.runs(), std::vector<std::string>{"x/gdn.ccq.s0"});
  EXPECT_EQ(report::find_figure("ccq/fig3_4").table, "ccq/fig3_4");
}
