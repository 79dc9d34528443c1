#pragma once
// Synthetic retrieval tasks (docs/spec.md §6), each a pure function of (parameters, rng): the
// dataset seeds an Rng from (seed, stream, sample index), so any sample can be regenerated
// on its own. docs/data.md describes every layout precisely.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/json.hpp"
#include "trainer/data/dataset.hpp"
#include "trainer/data/rng.hpp"

namespace lar::data {

// One sequence: inputs/targets/loss_mask/answer_id of length seq_len (answer ids local to
// the sample, 0…answer_kind.size()-1).
struct Sample {
  std::vector<int32_t> inputs, targets;
  std::vector<float> loss_mask;
  std::vector<int32_t> answer_id;
  std::vector<int32_t> answer_kind;
};

class TaskGenerator {
 public:
  virtual ~TaskGenerator() = default;
  virtual std::string name() const = 0;
  // Throws UserError (naming the config key) when seq_len cannot hold the task.
  virtual void check_length(int seq_len) const = 0;
  virtual Sample generate(Rng& rng, int seq_len) const = 0;
  virtual int vocab_needed() const = 0;
  virtual lar::json params() const = 0;              // everything that shapes the data
  virtual std::vector<std::string> kind_names() const { return {}; }  // for per-kind accuracy
};

struct TaskParams {
  int vocab_size = 256;      // model.vocab_size
  int num_kv_pairs = 8;      // data.num_kv_pairs
  std::string needle = "passkey";  // data.needle
  int num_needles = 4;       // data.num_needles
  int num_overwrites = 4;    // data.num_overwrites
};

// task: mqar | sniah | mkniah | sko. UserError for parameters that cannot work.
std::unique_ptr<TaskGenerator> make_task(const std::string& task, const TaskParams& p);

// Zoology's power-law gap distribution: `count` distinct slots out of [0, space) drawn
// one after another without replacement with weight ∝ (x+1)^(a−1), a = 0.01.
std::vector<int> power_law_slots(Rng& rng, int space, int count, double a = 0.01);

// Per-answer and per-token accuracy of argmax predictions (shared by every task).
lar::json score_answers(const Batch& batch, const std::vector<int32_t>& predictions,
                        const std::vector<std::string>& kind_names);

}  // namespace lar::data
