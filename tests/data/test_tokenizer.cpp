#include <gtest/gtest.h>

#include "core/error.hpp"
#include "tests/temp_dir.hpp"
#include "trainer/data/tokenizer.hpp"

using namespace lar::data;

namespace {
// A few hundred lines of simple English, enough for a small SentencePiece model.
std::string sample_text() {
  const char* subjects[] = {"the cat", "a dog", "my friend", "the old man", "her sister", "our teacher"};
  const char* verbs[] = {"sees", "likes", "reads", "finds", "paints", "carries"};
  const char* objects[] = {"a red ball", "the morning paper", "two green apples", "a long letter", "the blue house"};
  const char* places[] = {"at home", "in the park", "near the river", "on monday", "every evening"};
  std::string s;
  for (int i = 0; i < 900; ++i)
    s += std::string(subjects[i % 6]) + " " + verbs[(i / 6) % 6] + " " + objects[(i / 36) % 5] + " " + places[(i / 180) % 5] + ".\n";
  return s;
}
}  // namespace

TEST(ByteTokenizer, RoundTripAllBytes) {
  ByteTokenizer t;
  EXPECT_EQ(t.id(), "byte");
  EXPECT_EQ(t.vocab_size(), 256);
  EXPECT_EQ(t.eod_id(), 0);
  std::string s = "héllo, wörld\n\t";
  for (int c = 1; c < 256; ++c) s.push_back(static_cast<char>(c));
  std::vector<int32_t> ids;
  t.encode(s, ids);
  ASSERT_EQ(ids.size(), s.size());
  EXPECT_EQ(ids[0], 'h');
  EXPECT_EQ(ids[1], 0xC3);  // first byte of UTF-8 "é"
  EXPECT_EQ(t.decode(ids), s);
}

TEST(ByteTokenizer, FactoryAndErrors) {
  EXPECT_EQ(make_tokenizer("byte")->id(), "byte");
  try {
    make_tokenizer("bpe");
    FAIL();
  } catch (const lar::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("unknown tokenizer 'bpe'"), std::string::npos);
  }
  try {
    make_tokenizer("spm:/nonexistent/m.model");
    FAIL();
  } catch (const lar::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/m.model: no such SentencePiece model file"), std::string::npos);
  }
  TempDir t;
  auto junk = t.write("junk.model", "this is not a protobuf");
  EXPECT_THROW(make_tokenizer("spm:" + junk.string()), lar::UserError);
}

TEST(SpmTokenizer, TrainEncodeDecode) {
  TempDir t;
  auto text = t.write("corpus.txt", sample_text());
  SpmTrainOptions o;
  o.inputs = {text};
  o.vocab_size = 40;
  o.out = t.path / "models" / "m.model";
  train_spm(o);
  ASSERT_TRUE(std::filesystem::exists(o.out));
  auto tok = make_tokenizer("spm:" + o.out.string());
  EXPECT_EQ(tok->vocab_size(), 40);
  EXPECT_EQ(tok->eod_id(), 2);  // SentencePiece's default </s>
  EXPECT_EQ(tok->id().rfind("spm-", 0), 0u);
  EXPECT_EQ(tok->id().size(), 4u + 16u);
  std::vector<int32_t> ids;
  tok->encode("the cat likes a red ball.", ids);
  EXPECT_GT(ids.size(), 2u);
  EXPECT_LT(ids.size(), 25u);  // merges pieces: fewer tokens than bytes
  for (int32_t id : ids) {
    EXPECT_GE(id, 0);
    EXPECT_LT(id, 40);
  }
  EXPECT_EQ(tok->decode(ids), "the cat likes a red ball.");
  // Same model file → same id; the id is a hash of the model bytes.
  EXPECT_EQ(make_tokenizer("spm:" + o.out.string())->id(), tok->id());
}

TEST(SpmTokenizer, TrainErrors) {
  TempDir t;
  SpmTrainOptions o;
  o.inputs = {t.path / "missing.txt"};
  o.vocab_size = 64;
  o.out = t.path / "m.model";
  try {
    train_spm(o);
    FAIL();
  } catch (const lar::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("missing.txt: no such input file"), std::string::npos);
  }
  o.inputs = {t.write("empty.txt", "")};
  try {
    train_spm(o);
    FAIL();
  } catch (const lar::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("empty input"), std::string::npos);
  }
  EXPECT_FALSE(std::filesystem::exists(o.out));
}
