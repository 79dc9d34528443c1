// End to end with the real trainer: `lar reproduce --report DIR --bundle FILE` on a small
// LM spec with claims (a corpus made here, so epochs are counted); a reproduction stopped
// by SIGTERM resumes from its checkpoints on the next call; the bundle holds no
// checkpoints and imports into an empty home where `lar table` gives the same values.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "core/json.hpp"
#include "tests/shell.hpp"

namespace fs = std::filesystem;
using lar::json;

namespace {

using Result = lar::test::ShellResult;
using lar::test::sh;

std::string slurp(const fs::path& p) {
  std::ifstream f(p);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

std::string spec_text(const fs::path& data, long long_steps) {
  return "name: results-it\n"
         "base:\n"
         "  threads: 1\n"
         "  model: {architecture: gdn, n_layers: 2, d_model: 32, n_heads: 2, stack: pure, vocab_size: 256}\n"
         "  data: {path: " + data.string() + ", seq_len: 32, batch_size: 4}\n"
         "  optimizer: {lr: 3.0e-3}\n"
         "  eval: {batches: 1}\n"
         "matrix:\n"
         "  routing: [none, clvr]\n"
         "  budget.steps: {by: routing, none: [" + std::to_string(long_steps) + "], clvr: [60]}\n"
         "  seed: [0]\n"
         "reference:\n"
         "  source: {paper: test, table: \"Table X\", page: 1}\n"
         "  metrics: [final_loss]\n"
         "  rows:\n"
         "    - {match: {routing: none}, values: [2.0]}\n"
         "    - {match: {routing: clvr}, values: [1.9]}\n"
         "claims:\n"
         "  - {name: \"CLVR beats none\", source: \"Table X\", better: {routing: clvr}, than: {routing: none}, metric: final_loss}\n";
}

}  // namespace

TEST(ResultsCli, ResumesAfterSigtermWritesTheResultsFolderAndABundleThatImports) {
  const fs::path home = fs::temp_directory_path() / ("lar_results_it_" + std::to_string(::getpid()));
  fs::remove_all(home);
  fs::create_directories(home / "docs");
  for (int i = 0; i < 12; ++i)
    std::ofstream(home / "docs" / ("d" + std::to_string(i) + ".txt"))
        << std::string(200, static_cast<char>('a' + i % 7)) << " the quick brown fox " << i << "\n";
  const std::string env = "cd " + home.string() + " && env -u LAR_DB LAR_HOME=" + home.string() + " " + LAR_BINARY " ";
  ASSERT_EQ(sh(env + "data prepare --input " + (home / "docs").string() + "/d*.txt --out " + (home / "tiny").string() +
               " --val-fraction 0.2 -q").rc, 0);
  const fs::path spec = home / "spec.yaml";
  std::ofstream(spec) << spec_text(home / "tiny", 1500);
  const std::string args = "reproduce " + spec.string() + " -j 1 --checkpoint-every 25 --report " + (home / "res").string() +
                           " --bundle " + (home / "b.tar.gz").string();

  // 1. Start, wait for the long cell's first checkpoints, stop it with SIGTERM.
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // The lar process itself, so that the signal below goes to it alone.
    if (::chdir(home.c_str()) != 0) ::_exit(126);
    ::setenv("LAR_HOME", home.c_str(), 1);
    ::unsetenv("LAR_DB");
    std::FILE* out = std::fopen((home / "first.txt").c_str(), "w");
    if (!out) ::_exit(126);
    ::dup2(::fileno(out), 1);
    ::dup2(::fileno(out), 2);
    const std::string s = spec.string(), res = (home / "res").string(), bun = (home / "b.tar.gz").string();
    ::execl(LAR_BINARY, LAR_BINARY, "reproduce", s.c_str(), "-j", "1", "--checkpoint-every", "25", "--report", res.c_str(),
            "--bundle", bun.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  const fs::path ckpts = home / "runs" / "results-it" / "none.steps1500.s0" / "checkpoints";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  bool any = false;
  while (!any && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::error_code ec;
    if (fs::is_directory(ckpts, ec))
      for (const auto& e : fs::directory_iterator(ckpts, ec)) any |= e.path().extension() == ".ckpt";
  }
  ASSERT_TRUE(any) << slurp(home / "first.txt");
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ::kill(pid, SIGTERM);  // as `timeout` does when a machine's time is up
  int status = 0;
  ::waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 130) << status;
  const std::string first = slurp(home / "first.txt");
  EXPECT_NE(first.find("wrote the results folder"), std::string::npos) << first;  // written though interrupted
  const json st = json::parse(slurp(home / "runs" / "results-it" / "none.steps1500.s0" / "status.json"));
  EXPECT_NE(st["state"], "completed") << first;
  const long stopped_at = st["step"].get<long>();

  // 2. The same command again: the long cell resumes from its checkpoint and completes.
  Result again = sh(env + args);
  ASSERT_EQ(again.rc, 0) << again.out;
  EXPECT_NE(again.out.find("resume"), std::string::npos) << again.out;
  const std::string log = slurp(home / "runs" / "results-it" / "none.steps1500.s0" / "log.txt");
  EXPECT_NE(log.find("resumed from checkpoint step"), std::string::npos) << log;
  EXPECT_GT(stopped_at, 0);

  // 3. The results folder.
  const std::string readme = slurp(home / "res" / "README.md");
  EXPECT_NE(readme.find("| routing | final_loss (ours) |"), std::string::npos) << readme;
  EXPECT_NE(readme.find("⚠ >1"), std::string::npos) << readme;  // 1500 × 128 tokens over a ~2K-token corpus
  EXPECT_NE(readme.find("### Claims"), std::string::npos) << readme;
  EXPECT_NE(readme.find("| CLVR beats none |"), std::string::npos) << readme;
  const std::string prov = slurp(home / "res" / "provenance.md");
  EXPECT_NE(prov.find("| results-it/none.steps1500.s0 | completed | yes |"), std::string::npos) << prov;
  const json audit = json::parse(slurp(home / "res" / "audit.json"));
  EXPECT_EQ(audit["claims"][0]["name"], "CLVR beats none");
  EXPECT_TRUE(audit["rows"][0]["epochs"].get<double>() > 1);
  const json pj = json::parse(slurp(home / "res" / "provenance.json"));
  EXPECT_EQ(pj["runs"].size(), 2u);
  EXPECT_GE(pj["runs"][1].value("attempts", 0), 2) << pj.dump(2);  // none.s0: stopped once, resumed

  // 4. The bundle: no checkpoints; imports into an empty home with the same table.
  Result list = sh("tar -tzf " + (home / "b.tar.gz").string());
  ASSERT_EQ(list.rc, 0);
  EXPECT_NE(list.out.find("runs/results-it/none.steps1500.s0/metrics.jsonl"), std::string::npos) << list.out;
  EXPECT_NE(list.out.find("lar.db"), std::string::npos);
  EXPECT_EQ(list.out.find("checkpoints"), std::string::npos) << list.out;
  EXPECT_TRUE(fs::exists(ckpts));  // the local runs keep theirs

  const fs::path other = home / "other";
  fs::create_directories(other);
  const std::string env2 = "cd " + other.string() + " && env -u LAR_DB LAR_HOME=" + other.string() + " " + LAR_BINARY " ";
  Result imp = sh(env2 + "bundle import " + (home / "b.tar.gz").string());
  ASSERT_EQ(imp.rc, 0) << imp.out;
  EXPECT_NE(imp.out.find("imported 2 runs of results-it"), std::string::npos) << imp.out;
  Result t1 = sh(env + "table " + spec.string() + " --format json");
  Result t2 = sh(env2 + "table " + spec.string() + " --format json");
  ASSERT_EQ(t1.rc, 0);
  ASSERT_EQ(t2.rc, 0) << t2.out;
  EXPECT_EQ(json::parse(t1.out)["rows"][0]["ours"]["final_loss"]["mean"],
            json::parse(t2.out)["rows"][0]["ours"]["final_loss"]["mean"]);
  EXPECT_TRUE(json::parse(t2.out)["rows"][0]["ours"]["final_loss"]["mean"].is_number());
  Result again_imp = sh(env2 + "bundle import " + (home / "b.tar.gz").string());
  EXPECT_NE(again_imp.out.find("2 run folder(s) exist here already and were kept"), std::string::npos) << again_imp.out;

  // 5. Bad input: exit 2, a precise message.
  std::ofstream(home / "junk.tar.gz") << "not a tarball";
  Result junk = sh(env2 + "bundle import " + (home / "junk.tar.gz").string());
  EXPECT_EQ(junk.rc, 2) << junk.out;
  EXPECT_NE(junk.out.find("not a .tar.gz bundle"), std::string::npos) << junk.out;
  std::ofstream(home / "bad.yaml") << spec_text(home / "tiny", 10) << "  - {name: x, lowest: {routing: clvrr}, metric: final_loss}\n";
  Result bad = sh(env + "plan " + (home / "bad.yaml").string());
  EXPECT_EQ(bad.rc, 2) << bad.out;
  EXPECT_NE(bad.out.find("bad.yaml:20:"), std::string::npos) << bad.out;
  EXPECT_NE(bad.out.find("did you mean 'clvr'"), std::string::npos) << bad.out;

  // 6. The timing model: a prediction, nothing trained, nothing written.
  Result est = sh(env + "reproduce laa/table2 --scale mini --seeds 3 --estimate -j 6");
  EXPECT_EQ(est.rc, 0) << est.out;
  EXPECT_NE(est.out.find("Whole table on one H200 at -j 6:"), std::string::npos) << est.out;
  EXPECT_NE(est.out.find("| gdn.adamw.pure.lr3e-4.min_lr3e-5.s2 |"), std::string::npos) << est.out;
  EXPECT_FALSE(fs::exists(home / "runs" / "laa-table2"));
  fs::remove_all(home);
}
