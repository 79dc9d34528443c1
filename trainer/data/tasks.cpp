#include "trainer/data/tasks.hpp"

#include <algorithm>
#include <cmath>
#include <string_view>

#include "core/error.hpp"

namespace lar::data {

namespace {

std::string str(long v) { return std::to_string(v); }

Sample empty_sample(int seq_len) {
  Sample s;
  s.inputs.assign(seq_len, 0);
  s.targets.assign(seq_len, 0);
  s.loss_mask.assign(seq_len, 0.f);
  s.answer_id.assign(seq_len, -1);
  return s;
}

// Inputs and default targets from a full sequence of seq_len+1 tokens (next-token targets).
void fill_from_sequence(Sample& s, const std::vector<int32_t>& seq) {
  const size_t L = s.inputs.size();
  std::copy(seq.begin(), seq.begin() + L, s.inputs.begin());
  std::copy(seq.begin() + 1, seq.begin() + L + 1, s.targets.begin());
}

// Draw `count` distinct values from [lo, hi) in random order (partial Fisher–Yates).
std::vector<int32_t> distinct(Rng& rng, int32_t lo, int32_t hi, int count) {
  std::vector<int32_t> pool(hi - lo);
  for (int32_t i = 0; i < hi - lo; ++i) pool[i] = lo + i;
  for (int i = 0; i < count; ++i) std::swap(pool[i], pool[i + rng.below(pool.size() - i)]);
  pool.resize(count);
  return pool;
}

// ---------------------------------------------------------------------------------------
// MQAR (Zoology, Arora et al. 2023). Keys from [1, V/2), values from [V/2, V).
//   positions 0 … 2P−1      : k_1 v_1 k_2 v_2 … k_P v_P   (distinct keys, distinct values)
//   positions 2P … L        : the query region; slot g ∈ [0, (L−2P)/2) is position 2P+2g.
//                             Each key is queried once, at a power-law slot; every other
//                             position holds a uniform random token from [0, V) minus the
//                             P keys. (Zoology draws from all of [0, V): a noise copy of k_i
//                             followed by a noise token reads as a second binding of k_i, so
//                             a rule that keeps the latest binding — the delta rule — would
//                             be marked wrong for answering it. Excluding the keys makes every
//                             query unambiguous.)
//   target at a query position = that key's value; loss and accuracy only there.
class Mqar final : public TaskGenerator {
 public:
  explicit Mqar(const TaskParams& p) : V_(p.vocab_size), P_(p.num_kv_pairs) {
    if (P_ < 1) throw UserError("data.num_kv_pairs " + str(P_) + " must be at least 1");
    if (V_ / 2 - 1 < P_)
      throw UserError("model.vocab_size " + str(V_) + " is too small for mqar with data.num_kv_pairs " + str(P_) +
                      ": keys use [1, V/2) and values [V/2, V), so V must be at least " + str(2 * P_ + 2));
  }
  std::string name() const override { return "mqar"; }
  void check_length(int L) const override {
    if (L < 4 * P_)
      throw UserError("data.seq_len " + str(L) + " is too short for mqar with data.num_kv_pairs " + str(P_) +
                      " (needs at least 4·num_kv_pairs = " + str(4 * P_) + ")");
  }
  int vocab_needed() const override { return V_; }
  json params() const override {
    return {{"task", "mqar"}, {"vocab_size", V_}, {"num_kv_pairs", P_}, {"power_a", 0.01}, {"noise", "non_key"}};
  }

  Sample generate(Rng& rng, int L) const override {
    Sample s = empty_sample(L);
    const auto keys = distinct(rng, 1, V_ / 2, P_);
    const auto vals = distinct(rng, V_ / 2, V_, P_);
    const int space = (L - 2 * P_) / 2;
    const auto slots = power_law_slots(rng, space, P_);
    std::vector<int32_t> seq(L + 1);
    for (int i = 0; i < P_; ++i) {
      seq[2 * i] = keys[i];
      seq[2 * i + 1] = vals[i];
    }
    std::vector<int32_t> sorted_keys = keys;
    std::sort(sorted_keys.begin(), sorted_keys.end());
    for (int t = 2 * P_; t <= L; ++t) seq[t] = non_key(rng, sorted_keys);
    for (int i = 0; i < P_; ++i) seq[2 * P_ + 2 * slots[i]] = keys[i];
    fill_from_sequence(s, seq);
    for (int i = 0; i < P_; ++i) {
      const int t = 2 * P_ + 2 * slots[i];
      s.targets[t] = vals[i];
      s.loss_mask[t] = 1.f;
      s.answer_id[t] = i;
      s.answer_kind.push_back(0);
    }
    return s;
  }

 private:
  // A uniform token from [0, V) that is none of the (ascending) keys: the r-th non-key
  // token, found by stepping r over the keys in order.
  int32_t non_key(Rng& rng, const std::vector<int32_t>& sorted_keys) const {
    auto r = static_cast<int32_t>(rng.below(V_ - P_));
    for (int32_t k : sorted_keys)
      if (r >= k) ++r;
    return r;
  }

  int V_, P_;
};

// ---------------------------------------------------------------------------------------
// SKO, selective key overwrite. Vocabulary as MQAR. With P = num_kv_pairs, W = num_overwrites:
//   positions 0 … 2P−1          : k_1 v_1 … k_P v_P
//   positions 2P … 2P+2W−1      : W of those keys (distinct, random order) re-bound to fresh
//                                 values (never used before in the sequence)
//   positions 2P+2W … L         : query region as MQAR: every key queried once at a
//                                 power-law slot; target = the key's latest value.
// Answer kinds: 0 = kept (never overwritten), 1 = overwritten.
class Sko final : public TaskGenerator {
 public:
  explicit Sko(const TaskParams& p) : V_(p.vocab_size), P_(p.num_kv_pairs), W_(p.num_overwrites) {
    if (P_ < 1) throw UserError("data.num_kv_pairs " + str(P_) + " must be at least 1");
    if (W_ < 0 || W_ > P_)
      throw UserError("data.num_overwrites " + str(W_) + " must be between 0 and data.num_kv_pairs (" + str(P_) + ")");
    if (V_ / 2 - 1 < P_ || V_ - V_ / 2 < P_ + W_)
      throw UserError("model.vocab_size " + str(V_) + " is too small for sko with data.num_kv_pairs " + str(P_) +
                      " and data.num_overwrites " + str(W_) + ": needs V/2 − 1 ≥ pairs and V/2 ≥ pairs + overwrites, V ≥ " +
                      str(std::max(2 * P_ + 2, 2 * (P_ + W_))));
  }
  std::string name() const override { return "sko"; }
  void check_length(int L) const override {
    if (L < 4 * P_ + 2 * W_)
      throw UserError("data.seq_len " + str(L) + " is too short for sko (needs at least 4·num_kv_pairs + 2·num_overwrites = " +
                      str(4 * P_ + 2 * W_) + ")");
  }
  int vocab_needed() const override { return V_; }
  json params() const override {
    return {{"task", "sko"}, {"vocab_size", V_}, {"num_kv_pairs", P_}, {"num_overwrites", W_}, {"power_a", 0.01}};
  }
  std::vector<std::string> kind_names() const override { return {"kept", "overwritten"}; }

  Sample generate(Rng& rng, int L) const override {
    Sample s = empty_sample(L);
    const auto keys = distinct(rng, 1, V_ / 2, P_);
    const auto vals = distinct(rng, V_ / 2, V_, P_ + W_);  // last W are the fresh values
    const auto which = distinct(rng, 0, P_, W_);            // indices of overwritten keys, in order
    std::vector<int32_t> latest(vals.begin(), vals.begin() + P_);
    std::vector<int32_t> kind(P_, 0);
    std::vector<int32_t> seq(L + 1);
    for (int i = 0; i < P_; ++i) {
      seq[2 * i] = keys[i];
      seq[2 * i + 1] = vals[i];
    }
    for (int j = 0; j < W_; ++j) {
      const int i = which[j];
      latest[i] = vals[P_ + j];
      kind[i] = 1;
      seq[2 * P_ + 2 * j] = keys[i];
      seq[2 * P_ + 2 * j + 1] = latest[i];
    }
    const int q0 = 2 * P_ + 2 * W_;
    const int space = (L - q0) / 2;
    const auto slots = power_law_slots(rng, space, P_);
    for (int t = q0; t <= L; ++t) seq[t] = static_cast<int32_t>(rng.below(V_));
    for (int i = 0; i < P_; ++i) seq[q0 + 2 * slots[i]] = keys[i];
    fill_from_sequence(s, seq);
    for (int i = 0; i < P_; ++i) {
      const int t = q0 + 2 * slots[i];
      s.targets[t] = latest[i];
      s.loss_mask[t] = 1.f;
      s.answer_id[t] = i;
      s.answer_kind.push_back(kind[i]);
    }
    return s;
  }

 private:
  int V_, P_, W_;
};

// ---------------------------------------------------------------------------------------
// Needle in a haystack (RULER, Hsieh et al. 2024), as byte-level ASCII text (ids = bytes).
constexpr std::string_view kNoise = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ";
constexpr std::string_view kAdjectives[] = {
    "amber", "brave", "calm", "dark", "eager", "fancy", "gentle", "happy", "icy", "jolly", "kind",
    "lively", "mellow", "noble", "odd", "proud", "quiet", "rapid", "silent", "tall", "urban", "vivid",
    "warm", "young", "zesty", "bold", "crisp", "dusty", "early", "fresh", "grand", "humble"};
constexpr std::string_view kNouns[] = {
    "apple", "bridge", "cloud", "desert", "engine", "forest", "garden", "harbor", "island", "jungle",
    "kettle", "ladder", "meadow", "needle", "ocean", "pencil", "quartz", "river", "saddle", "tunnel",
    "valley", "window", "yacht", "zebra", "anchor", "basket", "candle", "dragon", "falcon", "glacier",
    "hammer", "lantern"};
constexpr int kNumKeys = 32 * 32;

std::string key_name(int k) { return std::string(kAdjectives[k / 32]) + "-" + std::string(kNouns[k % 32]); }

std::string digits(Rng& rng, int n) {
  std::string s(1, static_cast<char>('1' + rng.below(9)));  // no leading zero
  for (int i = 1; i < n; ++i) s.push_back(static_cast<char>('0' + rng.below(10)));
  return s;
}

std::string uuid4(Rng& rng) {
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < 32; ++i) {
    if (i == 8 || i == 12 || i == 16 || i == 20) s.push_back('-');
    int v = static_cast<int>(rng.below(16));
    if (i == 12) v = 4;                    // version 4
    if (i == 16) v = 8 + (v & 3);          // RFC 4122 variant
    s.push_back(hex[v]);
  }
  return s;
}

struct Needle {
  std::string text;  // inserted into the haystack
  std::string key;   // "" for the pass-key template
  std::string value;
};

class Niah final : public TaskGenerator {
 public:
  Niah(std::string task, const TaskParams& p) : task_(std::move(task)), needle_(p.needle), K_(task_ == "sniah" ? 1 : p.num_needles) {
    if (needle_ != "passkey" && needle_ != "number" && needle_ != "uuid")
      throw UserError("data.needle '" + needle_ + "' is not one of passkey, number, uuid");
    if (K_ < 1 || K_ > 64) throw UserError("data.num_needles " + str(K_) + " must be between 1 and 64");
    if (p.vocab_size < 128)
      throw UserError("model.vocab_size " + str(p.vocab_size) + " is too small for " + task_ +
                      ": the haystack is ASCII text with byte ids, so it needs at least 128");
  }
  std::string name() const override { return task_; }
  int vocab_needed() const override { return 128; }
  json params() const override {
    json j = {{"task", task_}, {"needle", needle_}, {"encoding", "ascii-bytes"}};
    if (task_ == "mkniah") j["num_needles"] = K_;
    return j;
  }

  // The longest the fixed parts can be (keys and values at their longest).
  int fixed_max() const {
    Rng rng(0, "probe", 0);
    int longest_key = 0;
    for (int k = 0; k < kNumKeys; ++k) longest_key = std::max<int>(longest_key, static_cast<int>(key_name(k).size()));
    const std::string key(longest_key, 'x');
    const std::string value = needle_ == "uuid" ? uuid4(rng) : digits(rng, needle_ == "number" ? 7 : 5);
    auto [needle, query] = templates(key, value);
    return K_ * static_cast<int>(needle.size()) + static_cast<int>(query.size() + value.size());
  }
  void check_length(int L) const override {
    const int need = fixed_max() + 16;  // at least a little haystack
    if (L + 1 < need)
      throw UserError("data.seq_len " + str(L) + " is too short for " + task_ + " with needle " + needle_ +
                      (task_ == "mkniah" ? " and " + str(K_) + " needles" : "") + " (needs at least " + str(need - 1) + ")");
  }

  Sample generate(Rng& rng, int L) const override {
    // Needles: distinct keys, fresh values.
    std::vector<Needle> needles;
    const bool classic_passkey = task_ == "sniah" && needle_ == "passkey";
    std::vector<int32_t> key_ids = distinct(rng, 0, kNumKeys, K_);
    for (int i = 0; i < K_; ++i) {
      Needle n;
      n.key = classic_passkey ? "" : key_name(key_ids[i]);
      n.value = needle_ == "uuid" ? uuid4(rng) : digits(rng, needle_ == "number" ? 7 : 5);
      n.text = templates(n.key, n.value).first;
      needles.push_back(std::move(n));
    }
    const int asked = static_cast<int>(rng.below(K_));
    const std::string query = templates(needles[asked].key, needles[asked].value).second;
    const std::string& answer = needles[asked].value;
    size_t fixed = query.size() + answer.size();
    for (const auto& n : needles) fixed += n.text.size();
    const int H = L + 1 - static_cast<int>(fixed);  // haystack bytes; check_length keeps it ≥ 16
    // Depths: uniform in [0, 1], snapped down to a sentence start of the noise; needles
    // appear in increasing depth order.
    std::vector<int> cuts;
    for (int i = 0; i < K_; ++i) cuts.push_back(sentence_start_at_or_before(static_cast<int>(rng.uniform() * (H + 1))));
    std::sort(cuts.begin(), cuts.end());
    std::vector<int> order(K_);
    for (int i = 0; i < K_; ++i) order[i] = i;
    for (int i = K_ - 1; i > 0; --i) std::swap(order[i], order[rng.below(i + 1)]);  // which needle at which depth
    std::string text;
    text.reserve(L + 1);
    int h = 0;
    for (int i = 0; i < K_; ++i) {
      for (; h < cuts[i]; ++h) text.push_back(kNoise[h % kNoise.size()]);
      text += needles[order[i]].text;
    }
    for (; h < H; ++h) text.push_back(kNoise[h % kNoise.size()]);
    text += query;
    text += answer;
    std::vector<int32_t> seq(text.begin(), text.end());
    Sample s = empty_sample(L);
    fill_from_sequence(s, seq);
    const int a = static_cast<int>(answer.size());
    for (int t = L - a; t < L; ++t) {
      s.loss_mask[t] = 1.f;
      s.answer_id[t] = 0;
    }
    s.answer_kind.push_back(0);
    return s;
  }

 private:
  // (needle sentence, query prefix) for a key and value.
  std::pair<std::string, std::string> templates(const std::string& key, const std::string& value) const {
    if (key.empty()) {  // the classic pass-key template (Mohtashami & Jaggi 2023)
      return {"The pass key is " + value + ". Remember it. " + value + " is the pass key. ",
              "\nWhat is the pass key? The pass key is "};
    }
    const std::string noun = needle_ == "passkey" ? "pass key" : needle_;
    return {"One of the special magic " + noun + "s for " + key + " is: " + value + ". ",
            "\nWhat is the special magic " + noun + " for " + key + "? The special magic " + noun + " for " + key + " is "};
  }
  static int sentence_start_at_or_before(int pos) {
    // Sentence starts in the cyclic noise: 0 and every position right after ". ".
    while (pos > 0) {
      const size_t i = static_cast<size_t>(pos) % kNoise.size();
      const size_t prev = (i + kNoise.size() - 1) % kNoise.size();
      const size_t prev2 = (i + kNoise.size() - 2) % kNoise.size();
      if (kNoise[prev] == ' ' && kNoise[prev2] == '.') break;
      --pos;
    }
    return pos;
  }

  std::string task_, needle_;
  int K_;
};

}  // namespace

std::vector<int> power_law_slots(Rng& rng, int space, int count, double a) {
  std::vector<double> w(space);
  for (int x = 0; x < space; ++x) w[x] = a * std::pow(static_cast<double>(x + 1), a - 1.0);
  std::vector<int> out;
  out.reserve(count);
  double total = 0;
  for (double v : w) total += v;
  for (int c = 0; c < count; ++c) {
    double u = rng.uniform() * total;
    int pick = -1, last = -1;
    for (int x = 0; x < space; ++x) {
      if (w[x] == 0) continue;
      last = x;
      if (u < w[x]) {
        pick = x;
        break;
      }
      u -= w[x];
    }
    if (pick < 0) pick = last;  // rounding at the very end of the range
    out.push_back(pick);
    total -= w[pick];
    w[pick] = 0;
  }
  return out;
}

std::unique_ptr<TaskGenerator> make_task(const std::string& task, const TaskParams& p) {
  if (task == "mqar") return std::make_unique<Mqar>(p);
  if (task == "sko") return std::make_unique<Sko>(p);
  if (task == "sniah" || task == "mkniah") return std::make_unique<Niah>(task, p);
  throw UserError("data.task '" + task + "' is not a synthetic task (mqar, sniah, mkniah, sko)");
}

json score_answers(const Batch& b, const std::vector<int32_t>& pred, const std::vector<std::string>& kind_names) {
  const size_t n = static_cast<size_t>(b.batch) * b.seq_len;
  if (pred.size() != n || b.answer_id.size() != n)
    throw RuntimeError("score: " + std::to_string(pred.size()) + " predictions for a batch of " + std::to_string(n) + " positions");
  const int A = b.num_answers();
  std::vector<char> right(A, 1);
  long tokens = 0, tokens_right = 0;
  for (size_t i = 0; i < n; ++i) {
    const int a = b.answer_id[i];
    if (a < 0) continue;
    ++tokens;
    if (pred[i] == b.targets[i]) ++tokens_right;
    else right[a] = 0;
  }
  long answers_right = 0;
  for (int a = 0; a < A; ++a) answers_right += right[a];
  json out = {{"acc", A ? static_cast<double>(answers_right) / A : 0.0},
              {"token_acc", tokens ? static_cast<double>(tokens_right) / tokens : 0.0},
              {"answers", A},
              {"answer_tokens", tokens}};
  for (size_t k = 0; k < kind_names.size(); ++k) {
    long cnt = 0, ok = 0;
    for (int a = 0; a < A; ++a) {
      if (b.answer_kind[a] != static_cast<int>(k)) continue;
      ++cnt;
      ok += right[a];
    }
    if (cnt) out["acc_" + kind_names[k]] = static_cast<double>(ok) / cnt;
  }
  return out;
}

}  // namespace lar::data
