#include "trainer/data/tokenizer.hpp"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <unordered_map>

#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/hash.hpp"
#include "trainer/data/documents.hpp"

// Exported by libsentencepiece but absent from its installed headers (0.1.97): the
// threshold of its INFO/WARNING log lines, which otherwise flood stderr while training.
namespace sentencepiece::logging {
int GetMinLogLevel();
void SetMinLogLevel(int v);
}  // namespace sentencepiece::logging

namespace lar::data {

namespace fs = std::filesystem;

void ByteTokenizer::encode(std::string_view text, std::vector<int32_t>& out) const {
  out.reserve(out.size() + text.size());
  for (unsigned char c : text) out.push_back(c);
}

std::string ByteTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string s;
  s.reserve(ids.size());
  for (int32_t id : ids) s.push_back(static_cast<char>(static_cast<unsigned char>(id)));
  return s;
}

namespace {

class SpmTokenizer final : public Tokenizer {
 public:
  explicit SpmTokenizer(const fs::path& model) {
    std::error_code ec;
    if (!fs::is_regular_file(model, ec)) throw UserError(model.string() + ": no such SentencePiece model file");
    const std::string bytes = lar::read_file(model);
    const auto st = sp_.LoadFromSerializedProto(bytes);
    if (!st.ok()) throw UserError(model.string() + ": not a SentencePiece model (" + st.ToString() + ")");
    id_ = "spm-" + sha256_hex(bytes).substr(0, 16);
  }
  std::string id() const override { return id_; }
  int vocab_size() const override { return sp_.GetPieceSize(); }
  int eod_id() const override { return sp_.eos_id(); }
  void encode(std::string_view text, std::vector<int32_t>& out) const override {
    std::vector<int> ids;
    const auto st = sp_.Encode(absl::string_view(text.data(), text.size()), &ids);
    if (!st.ok()) throw RuntimeError("SentencePiece encode failed: " + st.ToString());
    out.insert(out.end(), ids.begin(), ids.end());
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::vector<int> v(ids.begin(), ids.end());
    std::string s;
    const auto st = sp_.Decode(v, &s);
    if (!st.ok()) throw RuntimeError("SentencePiece decode failed: " + st.ToString());
    return s;
  }

 private:
  sentencepiece::SentencePieceProcessor sp_;
  std::string id_;
};

// Feeds the trainer one line of a document at a time (SentencePiece trains on lines).
class LinesIterator final : public sentencepiece::SentenceIterator {
 public:
  explicit LinesIterator(std::vector<std::string> lines) : lines_(std::move(lines)) {}
  bool done() const override { return i_ >= lines_.size(); }
  void Next() override { ++i_; }
  const std::string& value() const override { return lines_[i_]; }
  sentencepiece::util::Status status() const override { return sentencepiece::util::Status(); }

 private:
  std::vector<std::string> lines_;
  size_t i_ = 0;
};

}  // namespace

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& spec) {
  if (spec == "byte") return std::make_unique<ByteTokenizer>();
  if (spec.rfind("spm:", 0) == 0 && spec.size() > 4) return std::make_unique<SpmTokenizer>(spec.substr(4));
  throw UserError("unknown tokenizer '" + spec + "' (expected 'byte' or 'spm:MODEL_FILE')");
}

void train_spm(const SpmTrainOptions& o) {
  check_inputs_exist(o.inputs);
  if (o.vocab_size < 8) throw UserError("--vocab-size " + std::to_string(o.vocab_size) + " is too small (at least 8)");
  if (o.out.empty()) throw UserError("no output model path given (--out MODEL)");
  std::vector<std::string> lines;
  for (const auto& f : o.inputs) {
    for_each_document(f, input_format(f, o.format), [&](Document&& d) {
      size_t start = 0;
      while (start <= d.text.size()) {
        size_t end = d.text.find('\n', start);
        if (end == std::string::npos) end = d.text.size();
        if (end > start) lines.emplace_back(d.text, start, end - start);
        start = end + 1;
      }
    });
  }
  if (lines.empty()) throw UserError("empty input: the input files hold no text to train a tokenizer on");
  std::unordered_map<std::string, std::string> args = {
      {"model_prefix", ""},
      {"vocab_size", std::to_string(o.vocab_size)},
      {"model_type", o.model_type},
      {"character_coverage", std::to_string(o.character_coverage)},
      // Keep the default special ids (unk 0, bos 1, eos 2); eos separates documents.
      {"input_sentence_size", "0"},
      {"num_threads", "1"},
  };
  LinesIterator it(std::move(lines));
  std::string model;
  const int old_level = sentencepiece::logging::GetMinLogLevel();
  if (!o.verbose) sentencepiece::logging::SetMinLogLevel(2);  // errors only
  const auto st = sentencepiece::SentencePieceTrainer::Train(args, &it, &model);
  sentencepiece::logging::SetMinLogLevel(old_level);
  if (!st.ok()) {
    // The library reports bad settings (e.g. a vocab larger than the text allows) as status
    // codes; those are the user's to fix.
    throw UserError("SentencePiece training failed: " + st.ToString());
  }
  if (o.out.has_parent_path()) fs::create_directories(o.out.parent_path());
  lar::atomic_write(o.out, model);
}

}  // namespace lar::data
