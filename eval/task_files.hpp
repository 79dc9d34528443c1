#pragma once
// Zero-shot tasks from local files, in the shapes lm-evaluation-harness uses (docs/eval.md):
//   multiple choice  JSONL {"context": str, "choices": [str…], "gold": i} (HellaSwag, PIQA,
//                    ARC, …; optional "delimiter", default " ") or {"contexts": [str…],
//                    "continuation": str, "gold": i} (WinoGrande's partial scoring):
//                    acc, and acc_norm (log-likelihood per byte of the choice)
//   lambada          JSONL {"text": str}: the last word given the rest: acc (greedy), ppl
//   perplexity       a text file (one document) or JSONL {"text": str} (a document per line):
//                    ppl = exp(NLL / words) (WikiText's word perplexity), byte_ppl,
//                    bits_per_byte, token_ppl, over rolling windows of max_len tokens
// A JSONL file with "text" lines is a LAMBADA file when its task name starts with "lambada".
#include <filesystem>
#include <string>

#include "core/json.hpp"
#include "eval/loaded_run.hpp"

namespace lar::eval {

enum class TaskKind { multiple_choice, lambada, perplexity };
std::string to_string(TaskKind k);

struct TaskFile {
  std::string name;             // metric prefix: NAME_acc, …
  std::filesystem::path path;   // absolute
  std::string sha256;           // of the file's bytes
  TaskKind kind = TaskKind::perplexity;
};

// "[NAME=]FILE" (NAME defaults to the file's stem, lower-cased). Reads and hashes the file
// and decides its kind; UserError naming FILE:LINE:COL for a malformed line.
TaskFile open_task_file(const std::string& arg);

struct TaskOptions {
  int batch = 8;
  int max_len = 0;  // model input length (0: the run's data.seq_len)
  long limit = 0;   // score the first N documents only (0: all)
};

// Scores one task file. Returns {"kind", "n", <metric>: value…} (metric names without the
// task prefix). samples (optional): one object per scored request — document index,
// choice, log-likelihood, greedy — appended (lm-eval's --log_samples).
json run_task(LoadedRun& run, const TaskFile& task, const TaskOptions& o, json* samples = nullptr);

}  // namespace lar::eval
