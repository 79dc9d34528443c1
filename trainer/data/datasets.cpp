// make_dataset: the LM dataset over prepared shards and the synthetic-task dataset.
#include <algorithm>

#include "core/config_schema.hpp"
#include "core/error.hpp"
#include "core/hash.hpp"
#include "core/paths.hpp"
#include "trainer/data/dataset.hpp"
#include "trainer/data/prepare.hpp"
#include "trainer/data/rng.hpp"
#include "trainer/data/shard.hpp"
#include "trainer/data/tasks.hpp"

namespace lar::data {

namespace fs = std::filesystem;

namespace {

// The shards of one split read as one stream of tokens.
class TokenStream {
 public:
  void add(ShardReader&& r) {
    starts_.push_back(total_);
    total_ += r.size();
    shards_.push_back(std::move(r));
  }
  uint64_t size() const { return total_; }
  void copy(uint64_t pos, uint64_t n, int32_t* out) const {
    // First shard whose range contains pos.
    size_t s = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), pos) - starts_.begin()) - 1;
    while (n > 0) {
      const uint64_t off = pos - starts_[s];
      const uint64_t take = std::min<uint64_t>(n, shards_[s].size() - off);
      shards_[s].copy(off, take, out);
      out += take;
      pos += take;
      n -= take;
      ++s;
    }
  }

 private:
  std::vector<ShardReader> shards_;
  std::vector<uint64_t> starts_;
  uint64_t total_ = 0;
};

std::string str(long v) { return std::to_string(v); }

// Language modelling on prepared shards. Train window n (n counts sequences from the
// start of training) starts at a uniform position drawn from Rng(seed, "lm-train", n);
// val window k is the k-th non-overlapping window of the val split (wrapping around).
class LmDataset final : public Dataset {
 public:
  LmDataset(const fs::path& dir, const json& manifest, uint64_t seed, int seq_len, int batch)
      : seed_(seed), L_(seq_len), B_(batch), manifest_(manifest) {
    for (const char* split : {"train", "val"}) {
      TokenStream& ts = std::string(split) == "train" ? train_ : val_;
      for (const auto& s : manifest.at(split).at("shards")) ts.add(ShardReader(dir / s.at("file").get<std::string>()));
    }
    if (train_.size() < static_cast<uint64_t>(L_) + 1)
      throw UserError("data.seq_len " + str(L_) + " needs at least " + str(L_ + 1) + " training tokens, but " + dir.string() +
                      " holds " + std::to_string(train_.size()));
  }

  Batch next_train() override {
    Batch b = make_batch(L_);
    const uint64_t span = train_.size() - L_;  // window starts in [0, span)
    std::vector<int32_t> w(L_ + 1);
    for (int r = 0; r < B_; ++r) {
      Rng rng(seed_, "lm-train", next_++);
      train_.copy(rng.below(span), L_ + 1, w.data());
      put(b, r, w);
    }
    return b;
  }

  Batch val_batch(int index, int seq_len) override {
    const uint64_t windows = val_.size() > 0 ? (val_.size() - 1) / seq_len : 0;
    if (windows == 0)
      throw UserError("the validation split (" + std::to_string(val_.size()) + " tokens) is shorter than one window of " +
                      str(seq_len + 1) + " tokens; prepare the data with a larger --val-fraction");
    Batch b = make_batch(seq_len);
    std::vector<int32_t> w(seq_len + 1);
    for (int r = 0; r < B_; ++r) {
      const uint64_t k = (static_cast<uint64_t>(index) * B_ + r) % windows;
      val_.copy(k * seq_len, seq_len + 1, w.data());
      put(b, r, w);
    }
    return b;
  }

  uint64_t val_tokens() const { return val_.size(); }
  int vocab_needed() const override { return manifest_.at("tokenizer").at("vocab_size").get<int>(); }
  std::string slice_id() const override { return manifest_.at("slice_id").get<std::string>(); }
  std::string tokenizer_id() const override { return manifest_.at("tokenizer").at("id").get<std::string>(); }
  uint64_t train_tokens() const override { return manifest_.at("train").at("tokens").get<uint64_t>(); }
  json state() const override { return {{"kind", "lm"}, {"next_sequence", next_}, {"seed", seed_}, {"slice_id", slice_id()}}; }
  void restore(const json& st) override {
    if (st.value("kind", "") != "lm" || st.value("slice_id", "") != slice_id())
      throw RuntimeError("data state " + st.dump() + " belongs to other data than lm slice " + slice_id());
    next_ = st.at("next_sequence").get<uint64_t>();
  }
  json score(const Batch&, const std::vector<int32_t>&) const override { return json::object(); }

 private:
  Batch make_batch(int L) const {
    Batch b;
    b.batch = B_;
    b.seq_len = L;
    b.inputs.resize(static_cast<size_t>(B_) * L);
    b.targets.resize(b.inputs.size());
    b.loss_mask.assign(b.inputs.size(), 1.f);
    return b;
  }
  static void put(Batch& b, int r, const std::vector<int32_t>& w) {
    const size_t L = b.seq_len;
    std::copy(w.begin(), w.begin() + L, b.inputs.begin() + r * L);
    std::copy(w.begin() + 1, w.begin() + L + 1, b.targets.begin() + r * L);
  }

  TokenStream train_, val_;
  uint64_t seed_;
  int L_, B_;
  json manifest_;
  uint64_t next_ = 0;
};

// Synthetic tasks. Train sequence n comes from Rng(seed, "<task>-train", n). Validation
// sequences do not depend on the run's seed: sequence k at length L comes from
// Rng(0, "<task>-val-L", k), so every run of a task is scored on the same held-out set.
class TaskDataset final : public Dataset {
 public:
  TaskDataset(std::unique_ptr<TaskGenerator> gen, uint64_t seed, int seq_len, int batch)
      : gen_(std::move(gen)), seed_(seed), L_(seq_len), B_(batch) {
    gen_->check_length(L_);
    slice_ = "task-" + sha256_hex(canonical_dump(gen_->params())).substr(0, 16);
  }

  Batch next_train() override {
    const std::string domain = gen_->name() + "-train";
    return assemble(L_, [&](int) { return Rng(seed_, domain, next_++); });
  }
  Batch val_batch(int index, int seq_len) override {
    gen_->check_length(seq_len);
    const std::string domain = gen_->name() + "-val-" + str(seq_len);
    return assemble(seq_len, [&](int r) { return Rng(0, domain, static_cast<uint64_t>(index) * B_ + r); });
  }
  int vocab_needed() const override { return gen_->vocab_needed(); }
  std::string slice_id() const override { return slice_; }
  json state() const override { return {{"kind", gen_->name()}, {"next_sequence", next_}, {"seed", seed_}, {"slice_id", slice_}}; }
  void restore(const json& st) override {
    if (st.value("kind", "") != gen_->name() || st.value("slice_id", "") != slice_)
      throw RuntimeError("data state " + st.dump() + " belongs to other data than " + gen_->name() + " slice " + slice_);
    next_ = st.at("next_sequence").get<uint64_t>();
  }
  json score(const Batch& b, const std::vector<int32_t>& pred) const override {
    return score_answers(b, pred, gen_->kind_names());
  }

 private:
  template <class MakeRng>
  Batch assemble(int L, MakeRng make_rng) {
    Batch b;
    b.batch = B_;
    b.seq_len = L;
    for (int r = 0; r < B_; ++r) {
      Rng rng = make_rng(r);
      Sample s = gen_->generate(rng, L);
      const int base = b.num_answers();
      b.inputs.insert(b.inputs.end(), s.inputs.begin(), s.inputs.end());
      b.targets.insert(b.targets.end(), s.targets.begin(), s.targets.end());
      b.loss_mask.insert(b.loss_mask.end(), s.loss_mask.begin(), s.loss_mask.end());
      for (int32_t a : s.answer_id) b.answer_id.push_back(a < 0 ? -1 : a + base);
      b.answer_kind.insert(b.answer_kind.end(), s.answer_kind.begin(), s.answer_kind.end());
    }
    return b;
  }

  std::unique_ptr<TaskGenerator> gen_;
  uint64_t seed_;
  int L_, B_;
  std::string slice_;
  uint64_t next_ = 0;
};

}  // namespace

fs::path lm_data_dir(const json& config) {
  const std::string p = config.at("data").at("path").get<std::string>();
  return p.empty() ? data_root() / "brown" : fs::path(p);
}

void check_data_shape(const json& config) {
  const int L = config.at("data").at("seq_len").get<int>();
  const int B = config.at("data").at("batch_size").get<int>();
  const int vocab = config.at("model").at("vocab_size").get<int>();
  if (L < 2) throw UserError("data.seq_len " + str(L) + " must be at least 2");
  if (B < 1) throw UserError("data.batch_size " + str(B) + " must be at least 1");
  if (vocab < 2) throw UserError("model.vocab_size " + str(vocab) + " must be at least 2");
}

std::unique_ptr<Dataset> make_dataset(const json& config_in) {
  const json config = with_defaults(config_in);
  const json& d = config.at("data");
  const std::string task = d.at("task").get<std::string>();
  const int L = d.at("seq_len").get<int>();
  const int B = d.at("batch_size").get<int>();
  const int vocab = config.at("model").at("vocab_size").get<int>();
  const uint64_t seed = static_cast<uint64_t>(config.at("seed").get<int64_t>());
  check_data_shape(config);

  std::unique_ptr<Dataset> ds;
  if (task == "lm") {
    const std::string p = d.at("path").get<std::string>();
    const fs::path dir = lm_data_dir(config);
    std::error_code ec;
    if (!fs::exists(dir / "manifest.json", ec))
      throw UserError("data.path: no prepared data at " + dir.string() +
                      (p.empty() ? " (the default corpus); run scripts/prepare_brown.sh to install it"
                                 : "; create it with `lar data prepare --input FILES --out " + dir.string() +
                                       "` (or scripts/prepare_brown.sh for the embedded Brown corpus)"));
    const json manifest = read_manifest(dir);
    auto lm = std::make_unique<LmDataset>(dir, manifest, seed, L, B);
    const int eval_batches = config.at("eval").at("batches").get<int>();
    if (eval_batches > 0 && lm->val_tokens() < static_cast<uint64_t>(L) + 1)
      throw UserError("eval.batches " + str(eval_batches) + " needs a validation split of at least " + str(L + 1) +
                      " tokens, but " + dir.string() + " has " + std::to_string(lm->val_tokens()) +
                      " (prepare it with --val-fraction > 0, or set eval.batches: 0)");
    ds = std::move(lm);
  } else {
    TaskParams tp;
    tp.vocab_size = vocab;
    tp.num_kv_pairs = d.at("num_kv_pairs").get<int>();
    tp.needle = d.at("needle").get<std::string>();
    tp.num_needles = d.at("num_needles").get<int>();
    tp.num_overwrites = d.at("num_overwrites").get<int>();
    ds = std::make_unique<TaskDataset>(make_task(task, tp), seed, L, B);
  }
  if (vocab < ds->vocab_needed())
    throw UserError("model.vocab_size " + str(vocab) + " is smaller than the data's vocabulary (" + str(ds->vocab_needed()) +
                    " for data.task " + task + ")");
  return ds;
}

}  // namespace lar::data
