#pragma once
// Tokenizers for `lar data prepare`: the byte-level tokenizer (no model file, vocab 256)
// and SentencePiece models through libsentencepiece. See docs/data.md.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace lar::data {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Stable identity written into every shard and the manifest: "byte", or
  // "spm-<first 16 hex digits of the model file's SHA-256>".
  virtual std::string id() const = 0;
  virtual int vocab_size() const = 0;
  // Appended after every document (the document separator); -1 when the model has none.
  virtual int eod_id() const = 0;
  virtual void encode(std::string_view text, std::vector<int32_t>& out) const = 0;  // appends
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
};

// Byte-level: token id = byte value (0…255). Id 0 (the NUL byte, which text never
// contains; `lar data prepare` rejects input holding one) separates documents.
class ByteTokenizer final : public Tokenizer {
 public:
  static constexpr int kEod = 0;
  std::string id() const override { return "byte"; }
  int vocab_size() const override { return 256; }
  int eod_id() const override { return kEod; }
  void encode(std::string_view text, std::vector<int32_t>& out) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
};

// "byte" or "spm:MODEL_PATH". Throws UserError for an unknown kind or an unreadable model.
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& spec);

// Train a SentencePiece model with the library (SentencePieceTrainer) on the documents
// of `inputs` (text or JSONL, see prepare.hpp) and write it atomically to `out`.
struct SpmTrainOptions {
  std::vector<std::filesystem::path> inputs;
  std::string format = "auto";        // auto | text | jsonl
  int vocab_size = 8000;
  std::string model_type = "unigram"; // unigram | bpe | char | word
  double character_coverage = 1.0;
  std::filesystem::path out;          // the .model file to write
  bool verbose = false;               // let the library log its progress to stderr
};
void train_spm(const SpmTrainOptions& opts);

}  // namespace lar::data
