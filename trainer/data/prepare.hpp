#pragma once
// `lar data prepare`: text / JSONL → a folder of token shards with a manifest.
//
//   DIR/manifest.json        what is in the folder (format, tokenizer, slice id, splits)
//   DIR/train/shard_NNNNN.bin
//   DIR/val/shard_NNNNN.bin
//   DIR/tokenizer.model      a copy of the SentencePiece model (spm tokenizers only)
//
// The folder appears whole or not at all: it is written under a temporary name next to
// DIR and renamed at the end; every user mistake is found before anything is written.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "core/json.hpp"

namespace lar::data {

inline constexpr int kManifestVersion = 1;

struct PrepareOptions {
  std::vector<std::filesystem::path> inputs;
  std::string tokenizer = "byte";  // byte | spm:MODEL
  std::filesystem::path out;
  std::string format = "auto";     // auto | text | jsonl (documents.hpp)
  double val_fraction = 0.05;      // fraction of documents held out for validation
  uint64_t seed = 0;               // which documents are held out
  uint64_t shard_tokens = 100'000'000;  // tokens per shard file at most
  bool force = false;              // replace an existing DIR
  // Called now and then with a one-line progress message (nullptr: silent).
  std::function<void(const std::string&)> progress;
};

// Returns the manifest written to DIR/manifest.json.
lar::json prepare(const PrepareOptions& opts);

// The data-slice id: first 16 hex digits of the SHA-256 of the canonical JSON of
// {"format": kManifestVersion, "inputs": [SHA-256 of each input file, in order],
//  "tokenizer": tokenizer id, "val_fraction": F, "seed": S}.
std::string compute_slice_id(const std::vector<std::string>& input_sha256, const std::string& tokenizer_id,
                             double val_fraction, uint64_t seed);

// Reads DIR/manifest.json and checks it against the shard headers (existence, token
// counts, tokenizer and slice ids). UserError naming DIR when it is absent or broken.
lar::json read_manifest(const std::filesystem::path& dir);

// Human summary for `lar data info`.
std::string describe_manifest(const lar::json& manifest, const std::filesystem::path& dir);

}  // namespace lar::data
