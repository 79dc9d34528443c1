#pragma once
// Where training batches come from: token shards (LM) or synthetic tasks generated from
// the seed. The trainer sees only this interface. See docs/spec.md §6.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "core/json.hpp"

namespace lar::data {

struct Batch {
  int batch = 0, seq_len = 0;
  std::vector<int32_t> inputs;     // batch·seq_len token ids
  std::vector<int32_t> targets;    // next tokens, batch·seq_len
  std::vector<float> loss_mask;    // 1 where the loss counts (all 1 for LM; query positions for tasks)
  // Synthetic tasks: which answer each position belongs to (-1: none), batch·seq_len; an
  // answer is right when every one of its positions is predicted right. Empty for LM.
  std::vector<int32_t> answer_id;
  std::vector<int32_t> answer_kind;  // per answer: a task-specific category (SKO: 0 kept, 1 overwritten)
  int num_answers() const { return static_cast<int>(answer_kind.size()); }
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual Batch next_train() = 0;                 // advances the data position
  virtual Batch val_batch(int index, int seq_len) = 0;  // deterministic held-out batch
  virtual int vocab_needed() const = 0;            // smallest vocab that covers the data
  virtual std::string slice_id() const = 0;        // identifies data + split (matched baselines)
  virtual std::string tokenizer_id() const { return ""; }  // "" for synthetic tasks (ids are the task's)
  virtual uint64_t train_tokens() const { return 0; }      // size of one epoch; 0 = generated, no epochs
  // Position in the data stream and RNG state, for checkpoints; restore continues exactly.
  virtual lar::json state() const = 0;
  virtual void restore(const lar::json& state) = 0;
  // Task metrics from the model's argmax predictions on a val batch (e.g. {"acc": 0.97});
  // empty for LM.
  virtual lar::json score(const Batch& batch, const std::vector<int32_t>& predictions) const = 0;
};

// Build the dataset a run config asks for (config with schema defaults applied).
// Throws lar::UserError for a bad data section (missing path, vocab too small, …).
std::unique_ptr<Dataset> make_dataset(const lar::json& config);

// What every dataset needs of a config (schema defaults applied), before any data is read:
// sequences of at least 2 tokens, a batch, a vocabulary of at least 2. UserError naming the key.
void check_data_shape(const lar::json& config);

// The folder of prepared shards an lm config reads (data.path, or the embedded corpus).
std::filesystem::path lm_data_dir(const lar::json& config);

}  // namespace lar::data
