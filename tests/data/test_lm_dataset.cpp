#include <gtest/gtest.h>

#include <cstdlib>

#include "core/error.hpp"
#include "tests/temp_dir.hpp"
#include "trainer/data/dataset.hpp"
#include "trainer/data/prepare.hpp"

using namespace lar::data;
using lar::json;

namespace {
// 40 documents of distinct text, prepared with a 10% val split.
std::filesystem::path prepared(const TempDir& t, uint64_t shard_tokens = 100'000'000) {
  std::string jsonl;
  for (int i = 0; i < 40; ++i) {
    std::string text;
    for (int j = 0; j < 20; ++j) text += "doc " + std::to_string(i) + " sentence " + std::to_string(j) + ". ";
    jsonl += json{{"text", text}}.dump() + "\n";
  }
  PrepareOptions o;
  o.inputs = {t.write("c.jsonl", jsonl)};
  o.out = t.path / "data";
  o.val_fraction = 0.1;
  o.shard_tokens = shard_tokens;
  prepare(o);
  return o.out;
}
json lm_config(const std::string& path, int seed = 0) {
  return {{"seed", seed}, {"data", {{"task", "lm"}, {"path", path}, {"seq_len", 32}, {"batch_size", 4}}}};
}
}  // namespace

TEST(LmDataset, WindowsComeFromTheShards) {
  TempDir t;
  const auto dir = prepared(t, 500);  // several shards: windows cross shard boundaries
  auto ds = make_dataset(lm_config(dir.string()));
  EXPECT_EQ(ds->vocab_needed(), 256);
  EXPECT_EQ(ds->slice_id(), read_manifest(dir)["slice_id"]);
  // What the trainer records with the run (summary.tokenizer, summary.epochs).
  EXPECT_EQ(ds->tokenizer_id(), "byte");
  EXPECT_EQ(ds->train_tokens(), read_manifest(dir)["train"]["tokens"].get<uint64_t>());
  EXPECT_GT(ds->train_tokens(), 0u);
  EXPECT_TRUE(ds->score(Batch{}, {}).empty());
  for (int step = 0; step < 5; ++step) {
    Batch b = ds->next_train();
    ASSERT_EQ(b.inputs.size(), 4u * 32);
    for (size_t i = 0; i < b.inputs.size(); ++i) {
      EXPECT_EQ(b.loss_mask[i], 1.f);
      if (i % 32 != 31) {
        EXPECT_EQ(b.targets[i], b.inputs[i + 1]);
      }
    }
  }
  // Val windows are fixed, non-overlapping and from the val split.
  Batch v = ds->val_batch(0, 32);
  Batch v2 = make_dataset(lm_config(dir.string(), 5))->val_batch(0, 32);
  EXPECT_EQ(v.inputs, v2.inputs);
  EXPECT_NE(v.inputs, ds->val_batch(1, 32).inputs);
}

TEST(LmDataset, DeterminismAndRestore) {
  TempDir t;
  const auto dir = prepared(t);
  auto a = make_dataset(lm_config(dir.string(), 3));
  auto b = make_dataset(lm_config(dir.string(), 3));
  EXPECT_EQ(a->next_train().inputs, b->next_train().inputs);
  EXPECT_NE(make_dataset(lm_config(dir.string(), 4))->next_train().inputs, make_dataset(lm_config(dir.string(), 3))->next_train().inputs);
  const json st = a->state();
  EXPECT_EQ(st["next_sequence"], 4);
  const Batch expected = a->next_train();
  auto r = make_dataset(lm_config(dir.string(), 3));
  r->restore(st);
  EXPECT_EQ(r->next_train().inputs, expected.inputs);
}

TEST(LmDataset, Errors) {
  TempDir t;
  try {
    make_dataset(lm_config((t.path / "nowhere").string()));
    FAIL();
  } catch (const lar::UserError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("data.path: no prepared data at " + (t.path / "nowhere").string()), std::string::npos) << m;
    EXPECT_NE(m.find("lar data prepare"), std::string::npos) << m;
    EXPECT_NE(m.find("scripts/prepare_brown.sh"), std::string::npos) << m;
  }
  // "" = the default corpus under the data root.
  setenv("LAR_DATA", (t.path / "root").c_str(), 1);
  try {
    make_dataset(lm_config(""));
    FAIL();
  } catch (const lar::UserError& e) {
    EXPECT_NE(std::string(e.what()).find((t.path / "root" / "brown").string()), std::string::npos) << e.what();
  }
  unsetenv("LAR_DATA");
  const auto dir = prepared(t);
  json c = lm_config(dir.string());
  c["model"] = {{"vocab_size", 100}};
  try {
    make_dataset(c);
    FAIL();
  } catch (const lar::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("model.vocab_size 100 is smaller than the data's vocabulary (256"), std::string::npos);
  }
  c = lm_config(dir.string());
  c["data"]["seq_len"] = 1000000;
  EXPECT_THROW(make_dataset(c), lar::UserError);
}
