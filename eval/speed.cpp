#include "eval/speed.hpp"

#include <algorithm>
#include <chrono>

#include "core/error.hpp"
#include "eval/decoder.hpp"
#include "trainer/data/rng.hpp"

namespace lar::eval {

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

json measure_speed(LoadedRun& run, const SpeedOptions& opts) {
  SpeedOptions o = opts;
  if (o.prompt_len <= 0) o.prompt_len = run.train_length();
  if (o.batch < 1 || o.decode_tokens < 1 || o.repeats < 1)
    throw UserError("--speed: batch, decode tokens and repeats must be ≥ 1");
  auto& model = run.model();
  const int V = model.shape().vocab;
  // Random prompt tokens: speed does not depend on the values.
  data::Rng rng(0, "speed-prompt", 0);
  data::Batch b;
  b.batch = o.batch;
  b.seq_len = o.prompt_len;
  b.inputs.resize(static_cast<size_t>(o.batch) * o.prompt_len);
  for (auto& t : b.inputs) t = static_cast<int32_t>(rng.below(static_cast<uint64_t>(V)));
  b.targets = b.inputs;
  b.loss_mask.assign(b.inputs.size(), 1.f);
  std::vector<int32_t> pred;
  std::vector<double> prefill;
  for (int r = 0; r <= o.repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    model.evaluate(b, &pred);  // downloading the argmax waits for the device
    if (r > 0) prefill.push_back(seconds_since(t0));
  }
  std::vector<double> decode;
  for (int r = 0; r <= o.repeats; ++r) {
    Decoder dec(model, o.batch, o.decode_tokens);
    std::vector<int32_t> tok(static_cast<size_t>(o.batch));
    for (int i = 0; i < o.batch; ++i) tok[static_cast<size_t>(i)] = b.inputs[static_cast<size_t>(i) * o.prompt_len];
    const auto t0 = std::chrono::steady_clock::now();
    for (int s = 0; s < o.decode_tokens; ++s) tok = dec.step(tok);
    if (r > 0) decode.push_back(seconds_since(t0));
  }
  const double p = median(prefill), d = median(decode);
  return {{"prefill_ms", 1e3 * p},
          {"prefill_tok_s", double(o.batch) * o.prompt_len / p},
          {"decode_tok_s", double(o.batch) * o.decode_tokens / d},
          {"decode_ms_per_step", 1e3 * d / o.decode_tokens}};
}

}  // namespace lar::eval
