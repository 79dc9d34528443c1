// `lar eval` and `lar serve-model` end to end, as a user runs them: a tiny model trained
// on a repeated pattern ("the cat sat on the mat. the dog ran in the park.") answers
// multiple-choice and LAMBADA items built from that pattern; perplexities obey their
// definitions; results land in status.json, metrics.jsonl, the registry and `lar show`;
// mistakes exit 2 and record nothing; NIAH at a length equals the trainer's own held-out
// accuracy; the npm `openai` client's log-likelihoods from `lar serve-model` equal
// `lar eval`'s.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "core/hash.hpp"
#include "core/json.hpp"
#include "core/run_dir.hpp"
#include "tests/runner/lar_process.hpp"
#include "tests/temp_dir.hpp"

using namespace lar;
namespace fs = std::filesystem;

namespace {

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

struct Result {
  int rc = 0;
  std::string out;
};

Result lar_run(const std::vector<std::string>& args, const fs::path& log) {
  pid_t pid = test::spawn_lar(args, log);
  Result r;
  r.rc = test::wait_exit(pid);
  r.out = slurp(log);
  return r;
}

int sh(const std::string& cmd) { return std::system(cmd.c_str()); }

const char* kPattern = "the cat sat on the mat. the dog ran in the park.";

// One trained run shared by the tests of this file (a few seconds on 2 cores).
class EvalCli : public ::testing::Test {
 protected:
  static inline TempDir* home = nullptr;
  static inline fs::path run_dir;

  static void SetUpTestSuite() {
    home = new TempDir();
    ::setenv("LAR_HOME", home->path.c_str(), 1);
    ::unsetenv("LAR_DB");
    std::string corpus;
    for (int i = 0; i < 400; ++i) corpus += std::string(kPattern) + "\n";
    home->write("corpus.txt", corpus);
    auto r = lar_run({"data", "prepare", "--input", (home->path / "corpus.txt").string(), "--out",
                      (home->path / "data/pattern").string(), "--val-fraction", "0.1"},
                     home->path / "prepare.log");
    ASSERT_EQ(r.rc, 0) << r.out;
    run_dir = home->path / "runs/evaltest/gdn";
    const json config = {{"model", {{"architecture", "gdn"}, {"stack", "pure"}, {"n_layers", 1}, {"d_model", 32},
                                    {"n_heads", 2}, {"vocab_size", 256}}},
                         {"data", {{"path", (home->path / "data/pattern").string()}, {"seq_len", 32}, {"batch_size", 8}}},
                         {"budget", {{"steps", 60}}},
                         {"optimizer", {{"name", "adamw"}, {"lr", 0.01}}},
                         {"eval", {{"batches", 1}}},
                         {"threads", 2}};
    RunDir(run_dir).write_config({{"experiment", "evaltest"}, {"cell_id", "gdn"}, {"hash", "h-gdn"},
                                  {"axes", json::object()}, {"role", "main"}, {"baseline", nullptr}, {"config", config}});
    r = lar_run({"train", "--run-dir", run_dir.string()}, home->path / "train.log");
    ASSERT_EQ(r.rc, 0) << r.out;
    r = lar_run({"sync"}, home->path / "sync.log");
    ASSERT_EQ(r.rc, 0) << r.out;
  }
  static void TearDownTestSuite() {
    delete home;
    home = nullptr;
  }

  json summary() const { return RunDir(run_dir).read_status()->summary; }

  // Multiple choice built from the pattern: the trained continuation is the gold one.
  fs::path write_tasks() const {
    home->write("tasks/mc.jsonl",
                "{\"context\": \"the cat sat on the\", \"choices\": [\"mat.\", \"park.\", \"dog.\"], \"gold\": 0}\n"
                "{\"context\": \"the dog ran in the\", \"choices\": [\"mat.\", \"park.\", \"cat.\"], \"gold\": 1}\n"
                "{\"contexts\": [\"the cat sat on the mat. the cat\", \"the cat sat on the mat. the dog\"], "
                "\"continuation\": \"ran in the park.\", \"gold\": 1}\n");
    home->write("tasks/lambada.jsonl",
                "{\"text\": \"the cat sat on the mat. the dog ran in the park\"}\n"
                "{\"text\": \"the dog ran in the park. the cat sat on the mat\"}\n");
    return home->write("tasks/wiki.txt", std::string(kPattern) + "\n" + kPattern + "\n");
  }
};

TEST_F(EvalCli, ScoresTaskFilesAndRecordsThemInTheRunAndTheRegistry) {
  write_tasks();
  const fs::path t = home->path / "tasks";
  auto r = lar_run({"eval", "evaltest/gdn", "--task", (t / "mc.jsonl").string(), "--task", (t / "lambada.jsonl").string(),
                    "--task", "wikitext=" + (t / "wiki.txt").string(), "--samples", (home->path / "samples.jsonl").string()},
                   home->path / "eval.log");
  ASSERT_EQ(r.rc, 0) << r.out;
  const json s = summary();
  EXPECT_EQ(s.value("mc_acc", -1.0), 1.0) << s.dump();
  EXPECT_EQ(s.value("mc_acc_norm", -1.0), 1.0);
  EXPECT_EQ(s.value("mc_n", 0), 3);
  EXPECT_EQ(s.value("lambada_acc", -1.0), 1.0);
  EXPECT_GT(s.value("lambada_ppl", 0.0), 1.0);
  EXPECT_LT(s.value("lambada_ppl", 99.0), 1.5);  // the last word is all but certain
  // Perplexities by their definitions: NLL = ln(byte_ppl)·bytes = ln(ppl)·words; byte-level
  // tokens are bytes; 2 lines of 12 words, 49 bytes each with the newline.
  EXPECT_EQ(s.value("wikitext_words", 0), 24);
  EXPECT_EQ(s.value("wikitext_bytes", 0), 98);
  EXPECT_EQ(s.value("wikitext_tokens", 0), 98);
  const double nll = std::log(s.value("wikitext_byte_ppl", 0.0)) * 98;
  EXPECT_NEAR(std::log(s.value("wikitext_ppl", 0.0)) * 24, nll, 1e-9 * nll);
  EXPECT_NEAR(s.value("wikitext_token_ppl", 0.0), s.value("wikitext_byte_ppl", 1.0), 1e-12);
  EXPECT_NEAR(s.value("wikitext_bits_per_byte", 0.0), nll / 98 / std::log(2.0), 1e-12);
  EXPECT_EQ(s["eval_files"]["mc"]["sha256"], sha256_hex(slurp(t / "mc.jsonl")));
  EXPECT_EQ(s["eval_files"]["wikitext"]["file"], (t / "wiki.txt").string());
  EXPECT_EQ(s["eval_files"]["mc"]["checkpoint_step"], 60);
  // A metrics line at the checkpoint step, and the registry has them.
  const auto lines = read_metrics(RunDir(run_dir).metrics_path()).lines;
  bool found = false;
  for (const auto& l : lines) found = found || (l.contains("mc_acc") && l["step"] == 60);
  EXPECT_TRUE(found);
  // An average over recorded metrics, as the papers' task averages.
  r = lar_run({"eval", "evaltest/gdn", "--average", "avg2=mc_acc,lambada_ppl"}, home->path / "avg.log");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_DOUBLE_EQ(summary().value("avg2", 0.0), (1.0 + s.value("lambada_ppl", 0.0)) / 2);
  r = lar_run({"eval", "evaltest/gdn", "--average", "avg=mc_acc,no_such"}, home->path / "avg-bad.log");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("'no_such' is not a recorded metric"), std::string::npos) << r.out;
  r = lar_run({"show", "evaltest/gdn"}, home->path / "show.log");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("mc_acc = 1"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("eval_files.mc.sha256 = " + sha256_hex(slurp(t / "mc.jsonl"))), std::string::npos) << r.out;
  r = lar_run({"metrics", "evaltest/gdn", "--name", "lambada_acc"}, home->path / "metrics.log");
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("60"), std::string::npos) << r.out;
  // Samples: 3 + 3 + 2 choices and 2 LAMBADA items, the gold choice the most likely.
  std::ifstream in(home->path / "samples.jsonl");
  std::string line;
  int n = 0;
  while (std::getline(in, line)) ++n;
  EXPECT_EQ(n, 10);
}

TEST_F(EvalCli, MistakesExitTwoAndRecordNothing) {
  write_tasks();
  const std::string before = slurp(RunDir(run_dir).status_path());
  const fs::path bad_gold = home->write("tasks/bad.jsonl",
                                        "{\"context\": \"a\", \"choices\": [\"b\", \"c\"], \"gold\": 0}\n"
                                        "{\"context\": \"a\", \"choices\": [\"b\", \"c\"], \"gold\": 5}\n");
  auto r = lar_run({"eval", run_dir.string(), "--task", bad_gold.string()}, home->path / "e1.log");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find(bad_gold.string() + ":2:1: gold: 5 is not the index"), std::string::npos) << r.out;
  r = lar_run({"eval", run_dir.string(), "--task", (home->path / "nope.jsonl").string()}, home->path / "e2.log");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("no such file"), std::string::npos) << r.out;
  r = lar_run({"eval", run_dir.string()}, home->path / "e3.log");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("nothing to evaluate"), std::string::npos) << r.out;
  r = lar_run({"eval", run_dir.string(), "--lengths", "run"}, home->path / "e6.log");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("no eval.lengths"), std::string::npos) << r.out;
  r = lar_run({"eval", run_dir.string(), "--niah", "sniah", "--lengths", "64"}, home->path / "e4.log");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("too short for sniah"), std::string::npos) << r.out;
  r = lar_run({"eval", "no/such-run", "--task", bad_gold.string()}, home->path / "e5.log");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_EQ(slurp(RunDir(run_dir).status_path()), before);
}

TEST_F(EvalCli, WindowsAtLengthsAndSpeed) {
  auto r = lar_run({"eval", run_dir.string(), "--lengths", "16,32", "--max-windows", "4", "--speed", "--speed-batch", "2",
                    "--prompt-len", "16", "--decode-tokens", "4", "--repeats", "1", "-f", "json"},
                   home->path / "lc.log");
  ASSERT_EQ(r.rc, 0) << r.out;
  const json s = summary();
  EXPECT_EQ(s.value("windows@16", 0), 4);
  EXPECT_EQ(s.value("tokens@32", 0), 4 * 32);
  EXPECT_NEAR(s.value("ppl@16", 0.0), std::exp(s.value("loss@16", 0.0)), 1e-9);
  EXPECT_LT(s.value("ppl@32", 99.0), 2.0);  // the pattern is learnt
  EXPECT_GT(s.value("prefill_ms", 0.0), 0.0);
  EXPECT_GT(s.value("decode_tok_s", 0.0), 0.0);
  EXPECT_EQ(s["eval_files"]["speed"]["batch"], 2);
  EXPECT_EQ(s["eval_files"]["long_context"]["split"], "val");
  // The same corpus cut into shards of 500 tokens: windows across shard ends, same numbers.
  r = lar_run({"data", "prepare", "--input", (home->path / "corpus.txt").string(), "--out",
               (home->path / "data/pattern-sharded").string(), "--val-fraction", "0.1", "--shard-tokens", "500"},
              home->path / "prepare-sharded.log");
  ASSERT_EQ(r.rc, 0) << r.out;
  r = lar_run({"eval", run_dir.string(), "--corpus", (home->path / "data/pattern-sharded").string(), "--lengths", "16,32",
               "--max-windows", "4", "-f", "json", "--no-record"},
              home->path / "lc-sharded.log");
  ASSERT_EQ(r.rc, 0) << r.out;
  const json m = json::parse(r.out)["results"]["long_context"]["metrics"];
  EXPECT_DOUBLE_EQ(m["ppl@16"].get<double>(), s.value("ppl@16", 0.0));
  EXPECT_DOUBLE_EQ(m["ppl@32"].get<double>(), s.value("ppl@32", 0.0));
}

// S-NIAH through `lar eval --niah` scores the same held-out haystacks as the trainer's
// eval.lengths, so the two accuracies agree.
TEST_F(EvalCli, NiahAtALengthEqualsTheTrainersHeldOutAccuracy) {
  const fs::path dir = home->path / "runs/evaltest/sniah";
  const json config = {{"model", {{"architecture", "gdn"}, {"stack", "pure"}, {"n_layers", 1}, {"d_model", 32},
                                  {"n_heads", 2}, {"vocab_size", 256}}},
                       {"data", {{"task", "sniah"}, {"needle", "number"}, {"seq_len", 192}, {"batch_size", 4}}},
                       {"budget", {{"steps", 20}}},
                       {"optimizer", {{"name", "adamw"}, {"lr", 0.01}}},
                       {"eval", {{"batches", 2}, {"lengths", json::array({256})}}},
                       {"threads", 2}};
  RunDir(dir).write_config({{"experiment", "evaltest"}, {"cell_id", "sniah"}, {"hash", "h-sniah"},
                            {"axes", json::object()}, {"role", "main"}, {"baseline", nullptr}, {"config", config}});
  auto r = lar_run({"train", "--run-dir", dir.string()}, home->path / "train-sniah.log");
  ASSERT_EQ(r.rc, 0) << r.out;
  const double trainer_acc = RunDir(dir).read_status()->summary.at("acc@256").get<double>();
  r = lar_run({"eval", dir.string(), "--niah", "sniah:number", "--lengths", "run", "--niah-samples", "8"},
              home->path / "niah.log");
  ASSERT_EQ(r.rc, 0) << r.out;
  r = lar_run({"eval", dir.string(), "--niah", "mkniah:passkey", "--lengths", "512", "--niah-samples", "2"},
              home->path / "mkniah.log");
  ASSERT_EQ(r.rc, 0) << r.out;
  const json s = RunDir(dir).read_status()->summary;
  EXPECT_DOUBLE_EQ(s.at("sniah_number_acc@256").get<double>(), trainer_acc);
  EXPECT_TRUE(s.contains("mkniah_passkey_acc@512")) << s.dump();
  EXPECT_EQ(s["eval_files"]["mkniah_passkey"]["task"], "mkniah:passkey");
  EXPECT_EQ(s["eval_files"]["sniah_number"]["lengths"], json::array({256}));
}

// A SentencePiece run scores with its own model (tokenizer.model of its data folder).
TEST_F(EvalCli, SentencePieceRunsScoreWithTheirTokenizer) {
  write_tasks();
  auto r = lar_run({"data", "tokenizer", "train", "--input", (home->path / "corpus.txt").string(), "--vocab-size", "21",
                    "--out", (home->path / "spm.model").string()},
                   home->path / "spm-train.log");
  ASSERT_EQ(r.rc, 0) << r.out;
  r = lar_run({"data", "prepare", "--input", (home->path / "corpus.txt").string(), "--out",
               (home->path / "data/pattern-spm").string(), "--tokenizer", "spm:" + (home->path / "spm.model").string(),
               "--val-fraction", "0.1"},
              home->path / "spm-prepare.log");
  ASSERT_EQ(r.rc, 0) << r.out;
  const fs::path dir = home->path / "runs/evaltest/spm";
  const json config = {{"model", {{"architecture", "gdn"}, {"stack", "pure"}, {"n_layers", 1}, {"d_model", 32},
                                  {"n_heads", 2}, {"vocab_size", 64}}},
                       {"data", {{"path", (home->path / "data/pattern-spm").string()}, {"seq_len", 32}, {"batch_size", 8}}},
                       {"budget", {{"steps", 60}}},
                       {"optimizer", {{"name", "adamw"}, {"lr", 0.01}}},
                       {"eval", {{"batches", 1}}},
                       {"threads", 2}};
  RunDir(dir).write_config({{"experiment", "evaltest"}, {"cell_id", "spm"}, {"hash", "h-spm"}, {"axes", json::object()},
                            {"role", "main"}, {"baseline", nullptr}, {"config", config}});
  r = lar_run({"train", "--run-dir", dir.string()}, home->path / "train-spm.log");
  ASSERT_EQ(r.rc, 0) << r.out;
  const fs::path t = home->path / "tasks";
  r = lar_run({"eval", dir.string(), "--task", (t / "mc.jsonl").string(), "--task", "wikitext=" + (t / "wiki.txt").string()},
              home->path / "eval-spm.log");
  ASSERT_EQ(r.rc, 0) << r.out;
  const json s = RunDir(dir).read_status()->summary;
  EXPECT_EQ(s.value("mc_acc", 0.0), 1.0) << s.dump();
  EXPECT_EQ(s.value("wikitext_bytes", 0), 98);
  EXPECT_LT(s.value("wikitext_tokens", 999), 98);  // pieces longer than a byte
  EXPECT_GT(s.value("wikitext_tokens", 0), 0);
}

// A spec whose columns are lar eval metrics: launch, evaluate, and the table prints our
// numbers (a fraction as a percentage column, a perplexity instead of the proxy).
TEST_F(EvalCli, PaperTableColumnsShowLarEvalsNumbers) {
  write_tasks();
  const fs::path spec = home->write("spec/evalspec.yaml", R"(name: evalspec
description: "lar eval columns"
base:
  model: {architecture: gdn, stack: pure, n_layers: 1, d_model: 32, n_heads: 2, vocab_size: 256}
  data: {path: DATA, seq_len: 32, batch_size: 8}
  budget: {steps: 60}
  optimizer: {name: adamw, lr: 0.01}
  eval: {batches: 1}
  threads: 2
matrix:
  seed: [0]
reference:
  source: {paper: test, table: "T"}
  metrics: [mc_acc_pct, wikitext_ppl]
  rows:
    - {match: {seed: 0}, values: [100.0, 5.0]}
)");
  std::string text = slurp(spec);
  text.replace(text.find("DATA"), 4, (home->path / "data/pattern").string());
  home->write("spec/evalspec.yaml", text);
  auto r = lar_run({"launch", spec.string()}, home->path / "launch.log");
  ASSERT_EQ(r.rc, 0) << r.out;
  r = lar_run({"table", spec.string(), "--format", "json"}, home->path / "table0.log");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(json::parse(r.out).dump().find("\"proxy\":true"), std::string::npos) << r.out;  // before: the validation-perplexity stand-in
  const fs::path t = home->path / "tasks";
  r = lar_run({"eval", "evalspec/s0", "--task", (t / "mc.jsonl").string(), "--task", "wikitext=" + (t / "wiki.txt").string()},
              home->path / "eval-spec.log");
  ASSERT_EQ(r.rc, 0) << r.out;
  r = lar_run({"table", spec.string(), "--format", "json"}, home->path / "table.log");
  ASSERT_EQ(r.rc, 0) << r.out;
  const json table = json::parse(r.out);
  const std::string dump = table.dump();
  EXPECT_NE(dump.find("100.0"), std::string::npos) << dump;
  const json st = RunDir(home->path / "runs/evalspec/s0").read_status()->summary;
  EXPECT_EQ(st.value("mc_acc", 0.0), 1.0);
  EXPECT_NE(dump.find(json(st.at("wikitext_ppl").get<double>()).dump()), std::string::npos) << dump;
  EXPECT_EQ(dump.find("proxy\":true"), std::string::npos) << dump;
}

TEST_F(EvalCli, ServeModelAnswersTheNpmOpenaiClientWithLarEvalsLogLikelihoods) {
  if (sh("command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "node/npm not installed: the npm `openai` client test needs them (scripts/setup.sh installs them)";
  const fs::path npm = LAR_NPM_DIR;
  if (!fs::exists(npm / "node_modules/openai/package.json")) {
    fs::create_directories(npm);
    if (sh("npm install --no-audit --no-fund --silent --prefix '" + npm.string() + "' openai >'" +
           (home->path / "npm.log").string() + "' 2>&1") != 0)
      GTEST_SKIP() << "could not install the npm `openai` package (offline?): " << slurp(home->path / "npm.log");
  }
  write_tasks();
  const fs::path t = home->path / "tasks";
  auto r = lar_run({"eval", run_dir.string(), "--task", (t / "mc.jsonl").string(), "--no-record", "--samples",
                    (home->path / "mc-samples.jsonl").string()},
                   home->path / "eval-mc.log");
  ASSERT_EQ(r.rc, 0) << r.out;
  // The requests of the samples as token lists: [separator 0] + bytes of context + " " + choice.
  std::vector<std::pair<std::string, std::string>> pairs = {{"the cat sat on the", " mat."}, {"the cat sat on the", " park."},
                                                            {"the cat sat on the", " dog."}, {"the dog ran in the", " mat."},
                                                            {"the dog ran in the", " park."}, {"the dog ran in the", " cat."}};
  json prompts = json::array(), cont_len = json::array();
  for (const auto& [c, x] : pairs) {
    json ids = json::array({0});
    for (unsigned char ch : c + x) ids.push_back(static_cast<int>(ch));
    prompts.push_back(ids);
    cont_len.push_back(x.size());
  }
  home->write("client/in.json", json({{"prompts", prompts}}).dump());
  home->write("client/client.mjs", R"js(
import fs from 'node:fs';
import { createRequire } from 'node:module';
const require = createRequire(process.argv[2] + '/node_modules/');
const { default: OpenAI } = await import(require.resolve('openai'));
const client = new OpenAI({ baseURL: process.argv[3], apiKey: 'unused', maxRetries: 0 });
const input = JSON.parse(fs.readFileSync(process.argv[4], 'utf8'));
const out = {};
const scored = await client.completions.create({ model: 'tiny', prompt: input.prompts, max_tokens: 0, echo: true, logprobs: 1 });
out.logprobs = scored.choices.map(c => c.logprobs.token_logprobs);
out.tokens = scored.choices.map(c => c.logprobs.tokens);
const gen = await client.completions.create({ model: 'tiny', prompt: 'the cat sat on the', max_tokens: 5, temperature: 0 });
out.text = gen.choices[0].text;
out.finish = gen.choices[0].finish_reason;
const stop = await client.completions.create({ model: 'tiny', prompt: 'the dog ran in the', max_tokens: 12, stop: ['.'] });
out.stopped = stop.choices[0].text;
try {
  await client.completions.create({ model: 'tiny', prompt: 'x', temperature: 0.7 });
  out.error = 'none';
} catch (e) {
  out.error = String(e.status);
}
const models = await client.models.list();
out.models = models.data.map(m => m.id);
fs.writeFileSync(process.argv[5], JSON.stringify(out));
)js");
  r = lar_run({"serve-model", run_dir.string(), "--host", "0.0.0.0"}, home->path / "serve-remote.log");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("not a loopback address"), std::string::npos) << r.out;
  const fs::path log = home->path / "serve-model.log";
  pid_t server = test::spawn_lar({"serve-model", run_dir.string(), "--port", "0", "--model-name", "tiny"}, log);
  std::string url;
  const std::regex url_re(R"(lar serve-model: (http://127\.0\.0\.1:\d+/v1))");
  for (int i = 0; i < 600 && url.empty(); ++i) {
    std::smatch m;
    const std::string text = slurp(log);
    if (std::regex_search(text, m, url_re)) url = m[1];
    else std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_FALSE(url.empty()) << slurp(log);
  const fs::path out = home->path / "client/out.json";
  const int rc = sh("node '" + (home->path / "client/client.mjs").string() + "' '" + npm.string() + "' '" + url + "' '" +
                    (home->path / "client/in.json").string() + "' '" + out.string() + "' >'" +
                    (home->path / "client/node.log").string() + "' 2>&1");
  ::kill(server, SIGTERM);
  test::wait_exit(server);
  ASSERT_EQ(rc, 0) << slurp(home->path / "client/node.log") << slurp(log);
  const json got = json::parse(slurp(out));
  // lar eval's log-likelihood of each choice = the sum of the served log-probabilities of
  // the choice's tokens (the last ones of the echoed prompt).
  std::ifstream in(home->path / "mc-samples.jsonl");
  std::string line;
  for (size_t i = 0; i < pairs.size(); ++i) {
    ASSERT_TRUE(std::getline(in, line));
    const json sample = json::parse(line);
    const auto& lps = got["logprobs"][i];
    ASSERT_EQ(lps.size(), prompts[i].size());
    EXPECT_TRUE(lps[0].is_null());
    double sum = 0;
    const size_t n = cont_len[i].get<size_t>();
    for (size_t k = lps.size() - n; k < lps.size(); ++k) sum += lps[k].get<double>();
    EXPECT_NEAR(sum, sample["logprob"].get<double>(), 1e-5) << "choice " << i;
  }
  EXPECT_EQ(got["tokens"][0][1], "t");
  EXPECT_EQ(got["text"], " mat.");
  EXPECT_EQ(got["finish"], "length");
  EXPECT_EQ(got["stopped"], " park");
  EXPECT_EQ(got["error"], "400");
  EXPECT_EQ(got["models"], json::array({"tiny"}));
}

}  // namespace
