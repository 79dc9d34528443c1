#include <gtest/gtest.h>

#include <map>
#include <set>

#include "core/error.hpp"
#include "trainer/data/dataset.hpp"
#include "trainer/data/tasks.hpp"

using namespace lar::data;
using lar::json;

namespace {

json config(const std::string& task, json data = json::object(), int vocab = 256, int seed = 1) {
  data["task"] = task;
  return {{"seed", seed}, {"data", data}, {"model", {{"vocab_size", vocab}}}};
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

bool same(const Batch& a, const Batch& b) {
  return a.inputs == b.inputs && a.targets == b.targets && a.loss_mask == b.loss_mask && a.answer_id == b.answer_id &&
         a.answer_kind == b.answer_kind;
}

// MQAR / SKO oracle: the value bound to each key by the pairs of the first `bind_end`
// positions; `latest` picks the last binding, otherwise the first.
std::vector<int32_t> lookup_oracle(const Batch& b, int bind_end, bool latest) {
  std::vector<int32_t> pred(b.inputs.size(), 0);
  for (int r = 0; r < b.batch; ++r) {
    const int32_t* x = &b.inputs[static_cast<size_t>(r) * b.seq_len];
    std::map<int32_t, int32_t> bound;
    for (int t = 0; t + 1 < bind_end; t += 2)
      if (latest || !bound.count(x[t])) bound[x[t]] = x[t + 1];
    for (int t = bind_end; t < b.seq_len; ++t) {
      auto it = bound.find(x[t]);
      if (it != bound.end()) pred[static_cast<size_t>(r) * b.seq_len + t] = it->second;
    }
  }
  return pred;
}

std::string row_text(const Batch& b, int r) {
  std::string s;
  for (int t = 0; t < b.seq_len; ++t) s.push_back(static_cast<char>(b.inputs[static_cast<size_t>(r) * b.seq_len + t]));
  return s;
}

// NIAH oracle: read the query, find its needle in the text, predict the value at the
// answer positions (the last `len(value)` positions).
std::vector<int32_t> niah_oracle(const Batch& b) {
  std::vector<int32_t> pred(b.inputs.size(), -1);
  for (int r = 0; r < b.batch; ++r) {
    const std::string text = row_text(b, r);
    const size_t q = text.rfind("\nWhat is the ");
    EXPECT_NE(q, std::string::npos);
    std::string marker;
    if (text.compare(q, 23, "\nWhat is the pass key? ") == 0) {
      marker = "The pass key is ";
    } else {
      const size_t f = text.find(" for ", q) + 5;
      const std::string key = text.substr(f, text.find('?', f) - f);
      marker = " for " + key + " is: ";
    }
    const size_t at = text.find(marker);
    EXPECT_LT(at, q);
    const size_t v0 = at + marker.size();
    const std::string value = text.substr(v0, text.find(". ", v0) - v0);
    for (size_t i = 0; i < value.size(); ++i)
      pred[static_cast<size_t>(r) * b.seq_len + b.seq_len - value.size() + i] = static_cast<unsigned char>(value[i]);
  }
  return pred;
}

}  // namespace

TEST(Tasks, PowerLawSlots) {
  Rng rng(3, "test", 0);
  double first_sum = 0;
  for (int i = 0; i < 200; ++i) {
    auto s = power_law_slots(rng, 50, 8);
    std::set<int> u(s.begin(), s.end());
    ASSERT_EQ(u.size(), 8u);
    for (int x : s) ASSERT_TRUE(x >= 0 && x < 50);
    first_sum += s[0];
  }
  EXPECT_LT(first_sum / 200, 15.0);  // skewed towards small gaps (uniform would be 24.5)
  auto all = power_law_slots(rng, 5, 5);
  EXPECT_EQ(std::set<int>(all.begin(), all.end()).size(), 5u);
}

TEST(Mqar, LayoutMaskAndOracle) {
  auto ds = make_dataset(config("mqar", {{"seq_len", 64}, {"batch_size", 4}, {"num_kv_pairs", 8}}));
  EXPECT_EQ(ds->vocab_needed(), 256);
  Batch b = ds->next_train();
  ASSERT_EQ(b.inputs.size(), 4u * 64);
  EXPECT_EQ(b.num_answers(), 32);
  for (int r = 0; r < 4; ++r) {
    int masked = 0;
    for (int t = 0; t < 64; ++t) {
      const size_t i = static_cast<size_t>(r) * 64 + t;
      if (t < 16) {
        const bool in_range = t % 2 == 0 ? (b.inputs[i] >= 1 && b.inputs[i] < 128) : (b.inputs[i] >= 128 && b.inputs[i] < 256);
        EXPECT_TRUE(in_range) << t;
      }
      if (b.loss_mask[i] == 0) {
        EXPECT_EQ(b.answer_id[i], -1);
        if (t + 1 < 64) {
          EXPECT_EQ(b.targets[i], b.inputs[i + 1]);
        }  // plain next token where unscored
        continue;
      }
      ++masked;
      EXPECT_GE(t, 16);
      EXPECT_EQ((t - 16) % 2, 0);
      // The query key appears in the context and the target is the value after it.
      bool found = false;
      for (int c = 0; c < 16; c += 2)
        if (b.inputs[r * 64 + c] == b.inputs[i]) {
          EXPECT_EQ(b.targets[i], b.inputs[r * 64 + c + 1]);
          found = true;
        }
      EXPECT_TRUE(found);
    }
    EXPECT_EQ(masked, 8);
  }
  const json perfect = ds->score(b, lookup_oracle(b, 16, true));
  EXPECT_DOUBLE_EQ(perfect["acc"].get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(perfect["token_acc"].get<double>(), 1.0);
  EXPECT_EQ(perfect["answers"], 32);
  const json constant = ds->score(b, std::vector<int32_t>(b.inputs.size(), 200));
  EXPECT_LT(constant["acc"].get<double>(), 0.2);
}

// Noise never repeats a key: after the pairs, each key occurs exactly once (its query),
// so every query has exactly one binding. The noise still covers every other token.
TEST(Mqar, NoiseNeverRepeatsAKey) {
  const int V = 16, P = 4, L = 64, B = 64;
  auto ds = make_dataset(config("mqar", {{"seq_len", L}, {"batch_size", B}, {"num_kv_pairs", P}}, V));
  std::set<int32_t> noise_seen;
  for (const Batch& b : {ds->next_train(), ds->val_batch(0, L)}) {
    for (int r = 0; r < B; ++r) {
      const int32_t* x = &b.inputs[static_cast<size_t>(r) * L];
      std::set<int32_t> keys;
      for (int i = 0; i < P; ++i) keys.insert(x[2 * i]);
      ASSERT_EQ(keys.size(), static_cast<size_t>(P));
      std::map<int32_t, int> occurrences;
      for (int t = 2 * P; t < L; ++t) {
        const size_t i = static_cast<size_t>(r) * L + t;
        if (keys.count(x[t])) {
          ++occurrences[x[t]];
          EXPECT_EQ(b.loss_mask[i], 1.f) << "key " << x[t] << " as noise at row " << r << " position " << t;
        } else {
          noise_seen.insert(x[t]);
          EXPECT_EQ(b.loss_mask[i], 0.f);
        }
      }
      for (int32_t k : keys) EXPECT_EQ(occurrences[k], 1) << "key " << k << " in row " << r;
    }
  }
  // Over 128 rows (each with its own keys) every token of [0, V) serves as noise somewhere.
  EXPECT_EQ(noise_seen.size(), static_cast<size_t>(V));
}

TEST(Mqar, DeterminismAndFixedValidation) {
  const json c = config("mqar", {{"seq_len", 64}, {"batch_size", 2}});
  auto a = make_dataset(c), b = make_dataset(c);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(same(a->next_train(), b->next_train()));
  auto other = make_dataset(config("mqar", {{"seq_len", 64}, {"batch_size", 2}}, 256, 2));
  EXPECT_FALSE(same(make_dataset(c)->next_train(), other->next_train()));
  // Validation: the same batch whenever asked, independent of the training position and
  // of the run's seed; batches differ from one another and from training.
  Batch v0 = a->val_batch(0, 64);
  EXPECT_TRUE(same(v0, b->val_batch(0, 64)));
  EXPECT_TRUE(same(v0, other->val_batch(0, 64)));
  EXPECT_FALSE(same(v0, a->val_batch(1, 64)));
  EXPECT_FALSE(same(v0, make_dataset(c)->next_train()));
  EXPECT_EQ(a->slice_id(), other->slice_id());
  EXPECT_NE(a->slice_id(), make_dataset(config("mqar", {{"seq_len", 64}, {"num_kv_pairs", 4}}))->slice_id());
  // Longer evaluation lengths (retrieval at length).
  Batch longer = a->val_batch(0, 256);
  EXPECT_EQ(longer.seq_len, 256);
  EXPECT_EQ(longer.inputs.size(), 2u * 256);
  EXPECT_DOUBLE_EQ(a->score(longer, lookup_oracle(longer, 16, true))["acc"].get<double>(), 1.0);
}

TEST(Mqar, StateRestoreContinues) {
  const json c = config("mqar", {{"seq_len", 32}, {"batch_size", 3}, {"num_kv_pairs", 4}});
  auto a = make_dataset(c);
  a->next_train();
  a->next_train();
  const json st = a->state();
  EXPECT_EQ(st["next_sequence"], 6);
  const Batch expected = a->next_train();
  auto b = make_dataset(c);
  b->restore(st);
  EXPECT_TRUE(same(b->next_train(), expected));
  EXPECT_TRUE(same(b->next_train(), a->next_train()));
  auto lm_like = json{{"kind", "sko"}, {"next_sequence", 0}, {"slice_id", "x"}};
  EXPECT_THROW(b->restore(lm_like), lar::RuntimeError);
}

TEST(Mqar, ConfigErrors) {
  EXPECT_NE(user_error([] { make_dataset(config("mqar", {{"num_kv_pairs", 8}}, 16)); })
                .find("model.vocab_size 16 is too small for mqar with data.num_kv_pairs 8"),
            std::string::npos);
  EXPECT_NE(user_error([] { make_dataset(config("mqar", {{"seq_len", 20}, {"num_kv_pairs", 8}})); })
                .find("data.seq_len 20 is too short for mqar"),
            std::string::npos);
  EXPECT_NE(user_error([] { make_dataset(config("mqar", {{"batch_size", 0}})); }).find("data.batch_size 0"), std::string::npos);
}

TEST(Sko, LatestBindingOracleAndKinds) {
  auto ds = make_dataset(config("sko", {{"seq_len", 64}, {"batch_size", 8}, {"num_kv_pairs", 6}, {"num_overwrites", 3}}));
  Batch b = ds->next_train();
  EXPECT_EQ(b.num_answers(), 48);
  int overwritten = 0;
  for (int k : b.answer_kind) overwritten += k;
  EXPECT_EQ(overwritten, 24);
  const int bind_end = 2 * 6 + 2 * 3;
  for (size_t i = 0; i < b.inputs.size(); ++i)
    if (b.loss_mask[i] > 0) {
      EXPECT_GE(static_cast<int>(i % 64), bind_end);
    }
  const json latest = ds->score(b, lookup_oracle(b, bind_end, true));
  EXPECT_DOUBLE_EQ(latest["acc"].get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(latest["acc_overwritten"].get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(latest["acc_kept"].get<double>(), 1.0);
  // Returning the first binding is right exactly for the keys that were never overwritten.
  const json first = ds->score(b, lookup_oracle(b, bind_end, false));
  EXPECT_DOUBLE_EQ(first["acc_overwritten"].get<double>(), 0.0);
  EXPECT_DOUBLE_EQ(first["acc_kept"].get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(first["acc"].get<double>(), 0.5);
}

TEST(Sko, ErrorsAndDeterminism) {
  EXPECT_NE(user_error([] { make_dataset(config("sko", {{"num_kv_pairs", 4}, {"num_overwrites", 5}})); })
                .find("data.num_overwrites 5 must be between 0 and data.num_kv_pairs (4)"),
            std::string::npos);
  EXPECT_NE(user_error([] { make_dataset(config("sko", {{"seq_len", 30}, {"num_kv_pairs", 6}, {"num_overwrites", 4}})); })
                .find("data.seq_len 30 is too short for sko"),
            std::string::npos);
  const json c = config("sko", {{"seq_len", 64}});
  auto a = make_dataset(c), b = make_dataset(c);
  EXPECT_TRUE(same(a->next_train(), b->next_train()));
  const json st = a->state();
  const Batch next = a->next_train();
  auto r = make_dataset(c);
  r->restore(st);
  EXPECT_TRUE(same(r->next_train(), next));
}

class Niah : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(Niah, OracleFindsEveryNeedle) {
  const auto [task, needle] = GetParam();
  const int L = 512;
  auto ds = make_dataset(config(task, {{"seq_len", L}, {"batch_size", 6}, {"needle", needle}, {"num_needles", 3}}));
  EXPECT_EQ(ds->vocab_needed(), 128);
  Batch b = ds->next_train();
  const size_t answer_len = needle == "uuid" ? 36 : needle == "number" ? 7 : 5;
  std::set<size_t> needle_positions;
  for (int r = 0; r < b.batch; ++r) {
    const std::string text = row_text(b, r);
    for (char c : text) ASSERT_TRUE(c > 0 && c < 127);  // ASCII
    // Loss only on the answer: the last answer_len positions.
    for (int t = 0; t < L; ++t) EXPECT_EQ(b.loss_mask[static_cast<size_t>(r) * L + t], t >= L - static_cast<int>(answer_len) ? 1.f : 0.f);
    const std::string haystack = text.substr(0, text.rfind("\nWhat is the "));
    const std::string marker = task == "sniah" && needle == "passkey" ? "The pass key is " : "One of the special magic";
    size_t needles = 0;
    for (size_t p = haystack.find(marker); p != std::string::npos; p = haystack.find(marker, p + 1)) ++needles;
    EXPECT_EQ(needles, task == "sniah" ? 1u : 3u);
    needle_positions.insert(text.find(task == "sniah" && needle == "passkey" ? "The pass key is " : "One of the special magic"));
  }
  EXPECT_GT(needle_positions.size(), 2u);  // needles at different depths
  const json perfect = ds->score(b, niah_oracle(b));
  EXPECT_DOUBLE_EQ(perfect["acc"].get<double>(), 1.0);
  EXPECT_EQ(perfect["answers"], 6);
  EXPECT_EQ(perfect["answer_tokens"], static_cast<int>(6 * answer_len));
  const json constant = ds->score(b, std::vector<int32_t>(b.inputs.size(), '5'));
  EXPECT_LT(constant["acc"].get<double>(), 0.5);
  // One wrong byte per answer: per-answer accuracy 0, per-token accuracy high.
  auto almost = niah_oracle(b);
  for (int r = 0; r < b.batch; ++r) almost[static_cast<size_t>(r) * L + L - 1] = '#';
  const json partial = ds->score(b, almost);
  EXPECT_DOUBLE_EQ(partial["acc"].get<double>(), 0.0);
  EXPECT_NEAR(partial["token_acc"].get<double>(), (answer_len - 1.0) / answer_len, 1e-12);
  // Determinism and resume.
  const json c = config(task, {{"seq_len", L}, {"batch_size", 6}, {"needle", needle}, {"num_needles", 3}});
  auto again = make_dataset(c);
  EXPECT_TRUE(same(again->next_train(), b));
  const json st = again->state();
  const Batch next = again->next_train();
  auto resumed = make_dataset(c);
  resumed->restore(st);
  EXPECT_TRUE(same(resumed->next_train(), next));
  EXPECT_TRUE(same(ds->val_batch(2, 1024), resumed->val_batch(2, 1024)));
  EXPECT_DOUBLE_EQ(ds->score(ds->val_batch(2, 1024), niah_oracle(ds->val_batch(2, 1024)))["acc"].get<double>(), 1.0);
}

INSTANTIATE_TEST_SUITE_P(AllKinds, Niah,
                         ::testing::Combine(::testing::Values("sniah", "mkniah"),
                                            ::testing::Values("passkey", "number", "uuid")));

TEST(NiahErrors, LengthAndVocab) {
  EXPECT_NE(user_error([] { make_dataset(config("sniah", {{"seq_len", 64}, {"needle", "uuid"}})); })
                .find("data.seq_len 64 is too short for sniah with needle uuid (needs at least"),
            std::string::npos);
  EXPECT_NE(user_error([] { make_dataset(config("mkniah", {{"seq_len", 256}}, 100)); })
                .find("model.vocab_size 100 is too small for mkniah"),
            std::string::npos);
}
