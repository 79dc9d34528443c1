#pragma once
// Checkpoints: one file per save, checkpoints/step_XXXXXXXX.ckpt, written atomically
// (core atomic_write: temp file, fsync, rename, fsync dir), so a kill -9 at any moment
// leaves the previous checkpoints intact. Layout:
//   "LARCKPT1" | u64 header length | header JSON | params blob | optimiser blob
// The header holds the step, the trainer's state (data position, RNG, tokens seen,
// recorded losses), the config hash, the parameter table, blob sizes and a SHA-256 of
// the blobs (a damaged file is detected and skipped on load).
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "core/json.hpp"

namespace lar::trainer {

struct Checkpoint {
  long step = 0;
  json state = json::object();  // trainer state: data, rng, tokens, summary so far, ...
  std::string params;           // raw bytes of the flat parameter buffer
  std::string optimizer;        // Optimizer::save_state()
};

std::filesystem::path checkpoint_path(const std::filesystem::path& dir, long step);
void save_checkpoint(const std::filesystem::path& dir, const Checkpoint& ck, int keep);
// The newest checkpoint that reads back intact (damaged ones are skipped, named in
// `skipped`); nullopt when there is none.
std::optional<Checkpoint> load_latest_checkpoint(const std::filesystem::path& dir,
                                                 std::vector<std::string>* skipped = nullptr);
Checkpoint read_checkpoint(const std::filesystem::path& file);  // throws RuntimeError
std::vector<std::filesystem::path> list_checkpoints(const std::filesystem::path& dir);  // oldest first

}  // namespace lar::trainer
