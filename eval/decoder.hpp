#pragma once
// Recurrent decoding through the mixers' step() (trainer/mixer.hpp: one position per call,
// carried state — KV caches for softmax layers, the recurrent state of linear ones), with
// the model's own blocks around it: the same parameters and the same ops as
// Model::forward at T = 1, so step t's logits equal the full forward's at position t.
// Whatever backend the model runs on does the work (its step kernels on a GPU).
#include <memory>
#include <vector>

#include "trainer/model.hpp"

namespace lar::eval {

class Decoder {
 public:
  // Room for max_len positions per row (KV caches are sized by it).
  Decoder(trainer::Model& model, int batch, int max_len);
  ~Decoder();
  // One token per row; returns the argmax next token per row, and the log-probability of
  // `next` (when given, one per row) under the step's distribution.
  std::vector<int32_t> step(const std::vector<int32_t>& tokens, const std::vector<int32_t>* next = nullptr,
                            std::vector<double>* next_logprob = nullptr);
  int position() const { return pos_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int pos_ = 0;
};

}  // namespace lar::eval
