#include <gtest/gtest.h>

#include <algorithm>

#include "core/error.hpp"
#include "core/hash.hpp"
#include "tests/temp_dir.hpp"
#include "trainer/data/prepare.hpp"
#include "trainer/data/shard.hpp"
#include "trainer/data/tokenizer.hpp"

using namespace lar::data;
namespace fs = std::filesystem;

namespace {
std::string jsonl_docs(int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s += "{\"text\": \"document number " + std::to_string(i) + "\", \"id\": " + std::to_string(i) + "}\n";
  return s;
}
template <class F>
std::string user_error(F f) {
  try {
    f();
  } catch (const lar::UserError& e) {
    return e.what();
  }
  return "(no UserError)";
}
// Nothing but the inputs in the folder: no output, no temporary folder left behind.
std::vector<std::string> entries(const fs::path& dir) {
  std::vector<std::string> v;
  for (const auto& e : fs::directory_iterator(dir)) v.push_back(e.path().filename().string());
  std::sort(v.begin(), v.end());
  return v;
}
}  // namespace

TEST(Prepare, JsonlWithValSplit) {
  TempDir t;
  auto in = t.write("docs.jsonl", jsonl_docs(20) + "\n   \n");  // blank lines are skipped
  PrepareOptions o;
  o.inputs = {in};
  o.out = t.path / "out";
  o.val_fraction = 0.25;
  o.seed = 7;
  std::vector<std::string> messages;
  o.progress = [&](const std::string& m) { messages.push_back(m); };
  const auto m = prepare(o);
  EXPECT_EQ(m["train"]["documents"], 15);
  EXPECT_EQ(m["val"]["documents"], 5);
  // Each document: its bytes plus the separator id 0.
  uint64_t expected = 0;
  for (int i = 0; i < 20; ++i) expected += std::string("document number " + std::to_string(i)).size() + 1;
  EXPECT_EQ(m["train"]["tokens"].get<uint64_t>() + m["val"]["tokens"].get<uint64_t>(), expected);
  EXPECT_EQ(m["tokenizer"]["id"], "byte");
  EXPECT_EQ(m["dtype"], "uint16");
  EXPECT_EQ(m["split"]["unit"], "documents");
  EXPECT_EQ(m["inputs"][0]["documents"], 20);
  ASSERT_FALSE(messages.empty());
  EXPECT_NE(messages.back().find("wrote"), std::string::npos);

  // The manifest on disk matches and checks out against the shards.
  const auto read = read_manifest(o.out);
  EXPECT_EQ(read, m);
  ShardReader val(o.out / m["val"]["shards"][0]["file"].get<std::string>());
  EXPECT_EQ(val.info().slice_id, m["slice_id"]);
  // Val holds whole documents: it ends with a separator and decodes to "document number N".
  EXPECT_EQ(val[val.size() - 1], ByteTokenizer::kEod);
  std::vector<int32_t> ids(val.size());
  val.copy(0, val.size(), ids.data());
  EXPECT_EQ(ByteTokenizer().decode(ids).rfind("document number ", 0), 0u);
  EXPECT_EQ(entries(t.path), (std::vector<std::string>{"docs.jsonl", "out"}));
  EXPECT_NE(describe_manifest(m, o.out).find("15 documents"), std::string::npos);
}

TEST(Prepare, SliceIdStability) {
  TempDir t;
  auto a = t.write("a/docs.jsonl", jsonl_docs(10));
  auto b = t.write("b/copy.jsonl", jsonl_docs(10));  // same content, other path
  auto run = [&](const fs::path& in, double f, uint64_t seed, const std::string& out) {
    PrepareOptions o;
    o.inputs = {in};
    o.out = t.path / out;
    o.val_fraction = f;
    o.seed = seed;
    return prepare(o)["slice_id"].get<std::string>();
  };
  const std::string s1 = run(a, 0.2, 1, "o1");
  EXPECT_EQ(s1.size(), 16u);
  EXPECT_EQ(run(b, 0.2, 1, "o2"), s1);  // content, not paths
  EXPECT_NE(run(a, 0.3, 1, "o3"), s1);  // split fraction
  EXPECT_NE(run(a, 0.2, 2, "o4"), s1);  // split seed
  auto c = t.write("c.jsonl", jsonl_docs(11));
  EXPECT_NE(run(c, 0.2, 1, "o5"), s1);  // content
  EXPECT_EQ(s1, compute_slice_id({lar::sha256_hex(jsonl_docs(10))}, "byte", 0.2, 1));
  // Same seed → the same documents held out.
  EXPECT_EQ(read_manifest(t.path / "o1")["val"], read_manifest(t.path / "o2")["val"]);
}

TEST(Prepare, JsonlErrorsNameFileAndLine) {
  TempDir t;
  auto bad = t.write("bad.jsonl", "{\"text\": \"ok\"}\n{\"text\": \"fine\"}\n{\"text\": \"broken\n");
  PrepareOptions o;
  o.inputs = {bad};
  o.out = t.path / "out";
  const std::string e1 = user_error([&] { prepare(o); });
  EXPECT_NE(e1.find(bad.string() + ":3:"), std::string::npos) << e1;
  EXPECT_NE(e1.find("bad JSON line"), std::string::npos) << e1;

  auto notext = t.write("notext.jsonl", "{\"text\": \"ok\"}\n{\"body\": \"x\"}\n");
  o.inputs = {notext};
  const std::string e2 = user_error([&] { prepare(o); });
  EXPECT_NE(e2.find(notext.string() + ":2:1: error: JSONL object has no string field \"text\""), std::string::npos) << e2;

  auto nul = t.write("nul.txt", std::string("line one\nline\0two\n", 18));
  o.inputs = {nul};
  const std::string e3 = user_error([&] { prepare(o); });
  EXPECT_NE(e3.find(nul.string() + ":2: error: NUL byte"), std::string::npos) << e3;

  o.inputs = {t.path / "missing.txt"};
  EXPECT_NE(user_error([&] { prepare(o); }).find("missing.txt: no such input file"), std::string::npos);

  auto empty = t.write("empty.jsonl", "\n{\"text\": \"\"}\n");
  o.inputs = {empty};
  EXPECT_NE(user_error([&] { prepare(o); }).find("empty input"), std::string::npos);

  o.inputs = {t.write("ok.txt", "hello")};
  o.val_fraction = 1.0;
  EXPECT_NE(user_error([&] { prepare(o); }).find("--val-fraction 1.000000 must be in [0, 1)"), std::string::npos);
  o.val_fraction = 0.1;
  o.tokenizer = "spm:" + (t.path / "nope.model").string();
  EXPECT_NE(user_error([&] { prepare(o); }).find("no such SentencePiece model"), std::string::npos);

  // Nothing was written by any failed attempt.
  EXPECT_EQ(entries(t.path), (std::vector<std::string>{"bad.jsonl", "empty.jsonl", "notext.jsonl", "nul.txt", "ok.txt"}));
}

TEST(Prepare, SingleTextDocumentSplitsByTokens) {
  TempDir t;
  std::string text(1000, 'a');
  auto in = t.write("one.txt", text);
  PrepareOptions o;
  o.inputs = {in};
  o.out = t.path / "out";
  o.val_fraction = 0.1;
  const auto m = prepare(o);
  EXPECT_EQ(m["split"]["unit"], "tokens");
  EXPECT_EQ(m["train"]["tokens"], 901);  // round(0.9 · 1001)
  EXPECT_EQ(m["val"]["tokens"], 100);
}

TEST(Prepare, ShardsRollOverAndExistingOutput) {
  TempDir t;
  auto in = t.write("docs.jsonl", jsonl_docs(30));
  PrepareOptions o;
  o.inputs = {in};
  o.out = t.path / "out";
  o.val_fraction = 0;
  o.shard_tokens = 100;
  const auto m = prepare(o);
  const uint64_t total = m["train"]["tokens"];
  EXPECT_EQ(m["train"]["shards"].size(), (total + 99) / 100);
  EXPECT_EQ(m["train"]["shards"][0]["tokens"], 100);
  EXPECT_EQ(m["val"]["shards"].size(), 0u);
  EXPECT_NE(user_error([&] { prepare(o); }).find("already exists (use --force"), std::string::npos);
  o.force = true;
  o.shard_tokens = 1000;
  EXPECT_EQ(prepare(o)["train"]["shards"].size(), 1u);
  EXPECT_EQ(read_manifest(o.out)["train"]["shards"].size(), 1u);
  EXPECT_FALSE(fs::exists(o.out / "train" / "shard_00001.bin"));
}

TEST(Prepare, ReadManifestFindsDamage) {
  TempDir t;
  PrepareOptions o;
  o.inputs = {t.write("docs.jsonl", jsonl_docs(10))};
  o.out = t.path / "out";
  o.val_fraction = 0.2;
  prepare(o);
  fs::resize_file(o.out / "train" / "shard_00000.bin", 130);  // header (128 bytes) + 1 token
  EXPECT_NE(user_error([&] { read_manifest(o.out); }).find("truncated or corrupt shard"), std::string::npos);
  EXPECT_NE(user_error([&] { read_manifest(t.path); }).find("not a prepared data folder"), std::string::npos);
  EXPECT_NE(user_error([&] { read_manifest(t.path / "nowhere"); }).find("no such data folder"), std::string::npos);
}

TEST(Prepare, WithSentencePiece) {
  TempDir t;
  std::string text;
  const char* who[] = {"the quick fox", "a lazy dog", "the brown cat", "my old friend"};
  const char* what[] = {"jumps over", "sleeps under", "runs around", "looks at"};
  const char* where[] = {"the red fence", "a tall tree", "the green house", "our small garden"};
  for (int i = 0; i < 640; ++i) text += std::string(who[i % 4]) + " " + what[(i / 4) % 4] + " " + where[(i / 16) % 4] + " " + std::to_string(i % 10) + "\n";
  auto corpus = t.write("corpus.txt", text);
  SpmTrainOptions so;
  so.inputs = {corpus};
  so.vocab_size = 48;
  so.out = t.path / "tok.model";
  train_spm(so);
  PrepareOptions o;
  o.inputs = {t.write("docs.jsonl", "{\"text\": \"the lazy dog\"}\n{\"text\": \"the quick fox\"}\n{\"text\": \"a brown dog\"}\n")};
  o.tokenizer = "spm:" + so.out.string();
  o.out = t.path / "out";
  o.val_fraction = 0.34;
  const auto m = prepare(o);
  EXPECT_EQ(m["tokenizer"]["vocab_size"], 48);
  EXPECT_EQ(m["tokenizer"]["eod_id"], 2);
  EXPECT_EQ(m["tokenizer"]["model"], "tokenizer.model");
  EXPECT_EQ(m["val"]["documents"], 1);
  EXPECT_EQ(make_tokenizer("spm:" + (o.out / "tokenizer.model").string())->id(), m["tokenizer"]["id"]);
  ShardReader r(o.out / "train" / "shard_00000.bin");
  EXPECT_EQ(r[r.size() - 1], 2);  // documents end with </s>
}
