#pragma once
// Inference speed (CCQ Appendix C's protocol, docs/eval.md): prefill latency — one
// full-sequence forward pass over a batch of prompts of a length — and decode throughput —
// new tokens per second at the batch size through the mixers' recurrent step() (the
// backend's decode kernels), from an empty state. Medians over repeats, after one warm-up.
#include "core/json.hpp"
#include "eval/loaded_run.hpp"

namespace lar::eval {

struct SpeedOptions {
  int batch = 8;
  int prompt_len = 0;   // 0: the run's data.seq_len
  int decode_tokens = 64;
  int repeats = 3;
};

// {"prefill_ms", "prefill_tok_s", "decode_tok_s", "decode_ms_per_step"}.
json measure_speed(LoadedRun& run, const SpeedOptions& o);

}  // namespace lar::eval
