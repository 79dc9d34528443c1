#pragma once
// Log-likelihoods of continuations under a model, batched (what lm-evaluation-harness
// calls loglikelihood requests), and greedy generation. Every sequence is scored by one
// full-sequence forward pass of the model (Model::evaluate, evaluation mode: CCQ's
// disable_at_eval applies); rows of a batch are right-padded, which causal models ignore.
#include <cstdint>
#include <vector>

#include "trainer/model.hpp"

namespace lar::eval {

struct Request {
  std::vector<int32_t> context;       // at least one token (callers prefix the document separator)
  std::vector<int32_t> continuation;  // scored tokens
};

struct Scored {
  double logprob = 0;                  // Σ log p(continuation | context)
  bool greedy = false;                 // every continuation token is the model's argmax
  std::vector<double> token_logprobs;  // log p of each continuation token
  std::vector<int32_t> argmax;         // the model's top token at each continuation position
  std::vector<double> top_logprobs;    // log p(argmax) at each position (ScoreOptions::top)
  int dropped_context = 0;             // context tokens cut from the left to fit max_len
};

struct ScoreOptions {
  int batch = 8;     // sequences per forward pass
  int max_len = 0;   // model input length at most (context + continuation − 1); > 0
  bool top = false;  // also log p(argmax) per position (a second pass with argmax targets)
};

// One result per request, in request order. UserError when a continuation alone does not
// fit max_len, or a token is outside the model's vocabulary.
std::vector<Scored> score(trainer::Model& model, const std::vector<Request>& requests, const ScoreOptions& o);

// Greedy continuation of each prompt (non-empty): up to max_tokens new tokens, stopping
// early at `stop` (not included; −1 = none). Prompts longer than max_len keep their last
// max_len tokens. Batched over prompts, one full forward pass per new token.
std::vector<std::vector<int32_t>> generate(trainer::Model& model, const std::vector<std::vector<int32_t>>& prompts,
                                           int max_tokens, int max_len, int batch, int32_t stop = -1);

}  // namespace lar::eval
