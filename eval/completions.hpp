#pragma once
// `lar serve-model`: an OpenAI-compatible completions endpoint over a trained run, the
// protocol lm-evaluation-harness's `local-completions` model and the LAA authors' scoring
// server speak (docs/eval.md):
//   POST /v1/completions  {"prompt": str | [str] | [int] | [[int]], "max_tokens": 16,
//                          "echo": false, "logprobs": null | 0..5, "temperature": 0,
//                          "stop": str | [str]}
//   GET  /v1/models
// Log-likelihoods come from the same scorer as `lar eval` (eval/loglik.hpp), so the two
// agree exactly. Decoding is greedy (temperature 0); prompts of one request are scored in
// batches; requests are served one at a time on the model. Loopback only unless
// allow_remote.
#include <memory>
#include <string>

#include "core/json.hpp"
#include "eval/loaded_run.hpp"

namespace lar::eval {

struct CompletionsOptions {
  std::string host = "127.0.0.1";
  int port = 8000;           // 0: a free port
  bool allow_remote = false;
  int batch = 8;             // prompts per forward pass
  int max_len = 0;           // model input length (0: the run's data.seq_len)
  std::string model_name;    // the "model" field of the replies
};

// The reply to one /v1/completions body (exposed for tests). UserError → HTTP 400.
json complete(LoadedRun& run, const json& request, const CompletionsOptions& o);

class CompletionsServer {
 public:
  CompletionsServer(LoadedRun& run, CompletionsOptions o);
  ~CompletionsServer();
  void bind();            // RuntimeError when the port cannot be had
  std::string url() const;
  void run();             // blocks until stop()
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lar::eval
