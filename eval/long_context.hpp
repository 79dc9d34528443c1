#pragma once
// Evaluation at lengths (docs/eval.md):
//  - token-weighted perplexity over the non-overlapping windows of each length of a
//    prepared corpus (CCQ Figs. 3–4): window k reads tokens [kL, kL+L) and predicts
//    [kL+1, kL+L]; ppl@L = exp(Σ NLL / Σ predicted tokens) over all windows scored;
//  - synthetic S-NIAH / MK-NIAH retrieval (trainer/data/tasks.hpp generators) at each
//    length, on the held-out samples the trainer's own eval.lengths uses
//    (Rng(0, "<task>-val-<L>", k)), so a task-trained run scores the same set.
#include <filesystem>
#include <string>
#include <vector>

#include "core/json.hpp"
#include "eval/loaded_run.hpp"

namespace lar::eval {

struct WindowOptions {
  std::vector<int> lengths;
  std::filesystem::path corpus;  // prepared folder ("" = the run's own data)
  std::string split = "val";     // val | train
  long max_windows = 64;         // per length, at most (0 = all)
  int batch = 1;
};
// {"ppl@L", "loss@L", "tokens@L", "windows@L"} per length; provenance in `prov`.
json window_perplexity(LoadedRun& run, const WindowOptions& o, json& prov);

struct NiahOptions {
  std::vector<int> lengths;
  std::vector<std::string> tasks;  // "sniah", "sniah:passkey|number|uuid", "mkniah", "mkniah:uuid"
  int samples = 32;                // per length
  int batch = 8;
};
// {"<task>[_<needle>]_acc@L"} per task and length (answers all right / answers).
json niah(LoadedRun& run, const NiahOptions& o);

// "4096,8192" or "4K,8K" → lengths. UserError naming the bad item.
std::vector<int> parse_lengths(const std::string& csv, const std::string& flag);

}  // namespace lar::eval
