// The training loop in process: bit-identical resume (AdamW and Muon), divergence,
// config validation, checkpoint files.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/hash.hpp"
#include "core/run_dir.hpp"
#include "core/config_schema.hpp"
#include "trainer/checkpoint.hpp"
#include "trainer/data/dataset.hpp"
#include "trainer/train.hpp"
#include "tests/temp_dir.hpp"
#include "tests/trainer/run_test_helpers.hpp"

using namespace lar;
namespace fs = std::filesystem;
using lar::test::metric_values;
using lar::test::write_run;

namespace {

json tiny_run(json overrides = json::object()) {
  json c = {{"seed", 3},
            {"threads", 1},
            {"model", {{"n_layers", 2}, {"d_model", 32}, {"n_heads", 4}, {"n_kv_heads", 2}, {"vocab_size", 64}}},
            {"data", {{"task", "mqar"}, {"seq_len", 32}, {"batch_size", 4}, {"num_kv_pairs", 4}}},
            {"optimizer", {{"lr", 3e-3}}},
            {"schedule", {{"warmup_steps", 3}}},
            {"budget", {{"steps", 12}}},
            {"eval", {{"every", 4}, {"batches", 1}}},
            {"checkpoint", {{"every", 0}, {"keep", 2}}}};
  c.merge_patch(overrides);
  return c;
}

void expect_resume_bit_identical(const json& config) {
  TempDir a, b;
  write_run(a.path, config);
  write_run(b.path, config);
  ASSERT_EQ(trainer::train_run(a.path), 0);
  trainer::TrainOptions stop;
  stop.stop_after_steps = 5;
  ASSERT_EQ(trainer::train_run(b.path, stop), trainer::kExitPreempted);
  auto st = RunDir(b.path).read_status();
  ASSERT_TRUE(st);
  EXPECT_EQ(st->state, RunState::preempted);
  EXPECT_EQ(st->step, 5);
  EXPECT_TRUE(fs::exists(trainer::checkpoint_path(RunDir(b.path).checkpoints_dir(), 5)));
  ASSERT_EQ(trainer::train_run(b.path), 0);
  st = RunDir(b.path).read_status();
  EXPECT_EQ(st->state, RunState::completed);
  EXPECT_EQ(st->attempt, 2);
  const auto ma = metric_values(a.path), mb = metric_values(b.path);
  ASSERT_GE(ma.size(), 12u);
  EXPECT_EQ(ma, mb);  // every loss, lr, grad norm and val loss, bit for bit
  auto ca = trainer::read_checkpoint(trainer::checkpoint_path(RunDir(a.path).checkpoints_dir(), 12));
  auto cb = trainer::read_checkpoint(trainer::checkpoint_path(RunDir(b.path).checkpoints_dir(), 12));
  EXPECT_EQ(sha256_hex(ca.params), sha256_hex(cb.params));
  EXPECT_EQ(sha256_hex(ca.optimizer), sha256_hex(cb.optimizer));
}

TEST(Train, ResumeFromCheckpointIsBitIdenticalAdamW) { expect_resume_bit_identical(tiny_run()); }

TEST(Train, ResumeFromCheckpointIsBitIdenticalMuon) {
  expect_resume_bit_identical(tiny_run({{"optimizer", {{"name", "muon"}, {"lr", 0.02}, {"scalar_lr", 3e-3}}},
                                        {"schedule", {{"name", "cosine"}}}}));
}

// Evaluation over several batches: the answer counts are totals, the accuracies fractions of
// them (MQAR: batch_size · num_kv_pairs one-token answers per batch).
TEST(Train, EvaluationCountsAddUpOverBatches) {
  TempDir d;
  write_run(d.path, tiny_run({{"eval", {{"every", 0}, {"batches", 3}}}}));
  ASSERT_EQ(trainer::train_run(d.path), 0);
  const auto st = RunDir(d.path).read_status();
  ASSERT_TRUE(st);
  const json& s = st->summary;
  EXPECT_EQ(s.at("answers").get<double>(), 3.0 * 4 * 4) << s.dump();
  EXPECT_EQ(s.at("answer_tokens").get<double>(), 3.0 * 4 * 4) << s.dump();
  const double acc = s.at("acc").get<double>(), token_acc = s.at("token_acc").get<double>();
  EXPECT_GE(acc, 0.0);
  EXPECT_LE(acc, 1.0);
  EXPECT_DOUBLE_EQ(acc, token_acc);  // one-token answers: the same fraction
  EXPECT_DOUBLE_EQ(acc * 48, std::round(acc * 48)) << "acc is a fraction of the 48 answers";
}

TEST(Train, WritesProtocolFilesAndSummary) {
  TempDir d;
  write_run(d.path, tiny_run({{"checkpoint", {{"every", 5}, {"keep", 2}}}, {"eval", {{"lengths", {48}}}}}));
  ASSERT_EQ(trainer::train_run(d.path), 0);
  RunDir rd(d.path);
  auto st = rd.read_status();
  ASSERT_TRUE(st);
  EXPECT_EQ(st->state, RunState::completed);
  EXPECT_EQ(st->step, 12);
  EXPECT_EQ(st->total_steps, 12);
  const json& s = st->summary;
  for (const char* k : {"final_loss", "saturation_loss", "params", "tokens_per_s", "peak_mem_mb", "acc"})
    EXPECT_TRUE(s.contains(k)) << k << " in " << s.dump();
  EXPECT_GT(s["params"].get<long>(), 10000);
  // The data the run trained on, for the audit's matched pairs: the dataset's own slice id;
  // a synthetic task has no tokenizer and no epochs.
  EXPECT_EQ(s.at("data_slice").get<std::string>(), data::make_dataset(with_defaults(tiny_run()))->slice_id());
  EXPECT_FALSE(s.contains("tokenizer"));
  EXPECT_FALSE(s.contains("epochs"));
  // wsd with decay_fraction 0.2 of 12 steps: the stable phase ends after step 10.
  auto lines = read_metrics(rd.metrics_path()).lines;
  double val10 = NAN;
  int train_lines = 0;
  for (const auto& l : lines) {
    if (l.contains("val_loss") && l["step"] == 10) val10 = l["val_loss"];
    if (l.contains("loss")) {
      ++train_lines;
      for (const char* k : {"lr", "grad_norm", "tokens_per_s", "iter_time", "peak_mem_mb", "tokens", "wall_time"})
        EXPECT_TRUE(l.contains(k)) << k;
    }
  }
  EXPECT_EQ(train_lines, 12);
  EXPECT_EQ(s["saturation_loss"].get<double>(), val10);
  ASSERT_TRUE(lines.back().contains("val_loss@48")) << lines.back().dump();
  EXPECT_TRUE(lines.back().contains("acc@48"));
  EXPECT_EQ(s["val_loss@48"].get<double>(), lines.back()["val_loss@48"].get<double>());
  EXPECT_EQ(s["final_loss"].get<double>(), lines[lines.size() - 2]["val_loss"].get<double>());
  // keep = 2: steps 10 and 12 remain.
  auto cks = trainer::list_checkpoints(rd.checkpoints_dir());
  ASSERT_EQ(cks.size(), 2u);
  EXPECT_EQ(cks[0].filename(), "step_00000010.ckpt");
  EXPECT_EQ(cks[1].filename(), "step_00000012.ckpt");
  // A completed run is not retrained.
  EXPECT_EQ(trainer::train_run(d.path), 0);
  EXPECT_EQ(rd.read_status()->attempt, 1);
}

TEST(Train, DamagedCheckpointIsSkippedOnResume) {
  TempDir d;
  write_run(d.path, tiny_run({{"checkpoint", {{"every", 2}, {"keep", 3}}}}));
  trainer::TrainOptions stop;
  stop.stop_after_steps = 6;
  ASSERT_EQ(trainer::train_run(d.path, stop), trainer::kExitPreempted);
  auto newest = trainer::checkpoint_path(RunDir(d.path).checkpoints_dir(), 6);
  std::string bytes = read_file(newest);
  bytes[bytes.size() / 2] ^= 0x5a;
  atomic_write(newest, bytes);
  std::vector<std::string> skipped;
  auto ck = trainer::load_latest_checkpoint(RunDir(d.path).checkpoints_dir(), &skipped);
  ASSERT_TRUE(ck);
  EXPECT_EQ(ck->step, 4);
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_NE(skipped[0].find("checksum mismatch"), std::string::npos) << skipped[0];
  EXPECT_EQ(trainer::train_run(d.path), 0);
}

TEST(Train, NonFiniteLossIsRecordedAsDiverged) {
  TempDir d;
  write_run(d.path, tiny_run({{"optimizer", {{"lr", 1e30}, {"grad_clip", 0.0}}}, {"schedule", {{"warmup_steps", 0}}}}));
  EXPECT_EQ(trainer::train_run(d.path), trainer::kExitDiverged);
  auto st = RunDir(d.path).read_status();
  ASSERT_TRUE(st);
  EXPECT_EQ(st->state, RunState::diverged);
  EXPECT_NE(st->reason.find("non-finite"), std::string::npos) << st->reason;
  EXPECT_NE(st->reason.find("at step " + std::to_string(st->step + 1)), std::string::npos) << st->reason;
  EXPECT_LT(st->step, 12);
}

void expect_config_error(json overrides, const std::string& needle) {
  try {
    trainer::prepare_config(tiny_run(overrides));
    FAIL() << "no error for " << overrides.dump();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(TrainConfig, BadConfigsAreUserErrorsNamingTheProblem) {
  expect_config_error({{"model", {{"d_modle", 32}}}}, "model.d_modle: unknown key 'd_modle'");
  expect_config_error({{"model", {{"d_model", "big"}}}}, "model.d_model: expected integer");
  expect_config_error({{"model", {{"d_model", 30}}}}, "model.d_model: 30 is not divisible by model.n_heads = 4");
  expect_config_error({{"model", {{"n_kv_heads", 3}}}}, "not divisible by model.n_kv_heads = 3");
  expect_config_error({{"data", {{"task", "lm"}, {"path", "/nonexistent/lar-data"}}}}, "data.path");
  expect_config_error({{"model", {{"vocab_size", 6}}}}, "model.vocab_size");
  expect_config_error({{"optimizer", {{"name", "sgd"}}}}, "unknown value 'sgd'");
  expect_config_error({{"budget", {{"steps", 0}}}}, "budget.steps");
  EXPECT_NO_THROW(trainer::prepare_config(tiny_run()));
}

// The cuda kernel keys are validated with the config, naming the key and the value, and reach
// the backend as Backend::Options::cuda (a config written without them: their defaults).
TEST(TrainConfig, CudaKeysAreCheckedAndReachTheBackendOptions) {
  expect_config_error({{"cuda", {{"attention", "sdpa"}}}}, "cuda.attention: unknown value 'sdpa' (choices: auto, cudnn, flash)");
  expect_config_error({{"cuda", {{"gemm", "fast"}}}}, "cuda.gemm: unknown value 'fast'");
  expect_config_error({{"cuda", {{"linear_keep", "none"}}}}, "cuda.linear_keep: unknown value 'none' (choices: all, p, og)");
  expect_config_error({{"cuda", {{"ccq_group", 65}}}}, "cuda.ccq_group: expected an integer from 0 to 64, got 65");
  expect_config_error({{"cuda", {{"ccq_group", -1}}}}, "cuda.ccq_group: expected an integer from 0 to 64, got -1");
  expect_config_error({{"cuda", {{"gemm", "tune"}}}, {"deterministic", true}}, "cuda.gemm: 'tune' picks GEMM algorithms");
  const json cfg = trainer::prepare_config(tiny_run({{"cuda", {{"attention", "flash"}, {"gemm", "cublas"},
                                                                {"linear_path", "chunked"}, {"linear_keep", "og"},
                                                                {"ccq_fwd", "ws"}, {"ccq_bwd", "par"}, {"ccq_group", 8}}},
                                                      {"deterministic", true}, {"precision", "fp32"}}));
  const kernels::Backend::Options o = trainer::backend_options(cfg);
  EXPECT_TRUE(o.deterministic);
  EXPECT_EQ(o.precision, "fp32");
  EXPECT_EQ(o.cuda.attention, "flash");
  EXPECT_EQ(o.cuda.gemm, "cublas");
  EXPECT_EQ(o.cuda.linear_path, "chunked");
  EXPECT_EQ(o.cuda.linear_keep, "og");
  EXPECT_EQ(o.cuda.ccq_fwd, "ws");
  EXPECT_EQ(o.cuda.ccq_bwd, "par");
  EXPECT_EQ(o.cuda.ccq_group, 8);
  const kernels::Backend::Options d = trainer::backend_options(json{{"deterministic", false}});
  EXPECT_EQ(d.cuda.attention, "auto");
  EXPECT_EQ(d.cuda.gemm, "heuristic");
  EXPECT_EQ(d.cuda.linear_path, "auto");
  EXPECT_EQ(d.cuda.linear_keep, "all");
  EXPECT_EQ(d.cuda.ccq_group, 0);
  const json dflt = trainer::prepare_config(tiny_run());
  EXPECT_EQ(dflt["cuda"], with_defaults(json::object())["cuda"]);
}

TEST(TrainConfig, YamlAndJsonConfigFilesLoad) {
  TempDir d;
  atomic_write(d.path / "c.yaml", "seed: 4\nmodel:\n  d_model: 32\n  rope_base: 5.0e5\n  architecture: \"softmax\"\n");
  json y = trainer::load_config_file(d.path / "c.yaml");
  EXPECT_EQ(y["seed"], 4);
  EXPECT_EQ(y["model"]["rope_base"].get<double>(), 5e5);
  EXPECT_EQ(y["model"]["architecture"], "softmax");
  atomic_write(d.path / "c.json", R"({"config": {"seed": 5}})");
  EXPECT_EQ(trainer::load_config_file(d.path / "c.json")["seed"], 5);
  atomic_write(d.path / "bad.yaml", "model: [1, 2\n");
  try {
    trainer::load_config_file(d.path / "bad.yaml");
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("bad.yaml:"), std::string::npos) << e.what();
  }
  EXPECT_THROW(trainer::read_run_config(d.path / "nowhere"), UserError);
}

}  // namespace
