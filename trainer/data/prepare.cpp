#include "trainer/data/prepare.hpp"

#include <openssl/evp.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <memory>
#include <sstream>

#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/hash.hpp"
#include "trainer/data/documents.hpp"
#include "trainer/data/rng.hpp"
#include "trainer/data/shard.hpp"
#include "trainer/data/tokenizer.hpp"

namespace lar::data {

namespace fs = std::filesystem;

namespace {

// SHA-256 of a file, read in chunks (inputs may be larger than memory).
std::string sha256_file(const fs::path& path, uint64_t* bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UserError(path.string() + ": cannot open input file");
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr);
  std::vector<char> buf(1 << 20);
  *bytes = 0;
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const auto n = in.gcount();
    if (n > 0) EVP_DigestUpdate(ctx.get(), buf.data(), static_cast<size_t>(n));
    *bytes += static_cast<uint64_t>(n);
  }
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_DigestFinal_ex(ctx.get(), md, &len);
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (unsigned i = 0; i < len; ++i) {
    s.push_back(hex[md[i] >> 4]);
    s.push_back(hex[md[i] & 15]);
  }
  return s;
}

// Rate-limited progress reporting.
class Progress {
 public:
  explicit Progress(const std::function<void(const std::string&)>& fn) : fn_(fn) {}
  template <class F>
  void maybe(F make_message, bool force = false) {
    if (!fn_) return;
    auto now = std::chrono::steady_clock::now();
    if (!force && now - last_ < std::chrono::milliseconds(500)) return;
    last_ = now;
    fn_(make_message());
  }

 private:
  const std::function<void(const std::string&)>& fn_;
  std::chrono::steady_clock::time_point last_{};
};

// The shards of one split; a new file every `shard_tokens` tokens; no file when empty.
class SplitWriter {
 public:
  SplitWriter(fs::path root, std::string split, const Tokenizer& tok, std::string slice_id, uint64_t shard_tokens)
      : root_(std::move(root)), split_(std::move(split)), tok_(tok), slice_(std::move(slice_id)), per_shard_(shard_tokens) {}

  void append(const int32_t* ids, size_t n) {
    while (n > 0) {
      if (!cur_ || cur_->tokens() >= per_shard_) open_next();
      const size_t take = static_cast<size_t>(std::min<uint64_t>(n, per_shard_ - cur_->tokens()));
      cur_->append(ids, take);
      ids += take;
      n -= take;
      tokens_ += take;
    }
  }
  void add_document() { ++documents_; }
  uint64_t tokens() const { return tokens_; }

  json finish() {
    close_current();
    return {{"documents", documents_}, {"tokens", tokens_}, {"shards", shards_}};
  }

 private:
  void close_current() {
    if (!cur_) return;
    cur_->finish();
    shards_.back()["tokens"] = cur_->tokens();
    cur_.reset();
  }
  void open_next() {
    close_current();
    char name[32];
    std::snprintf(name, sizeof name, "shard_%05zu.bin", shards_.size());
    const std::string rel = split_ + "/" + name;
    cur_ = std::make_unique<ShardWriter>(root_ / rel, static_cast<uint32_t>(tok_.vocab_size()), tok_.id(), slice_);
    shards_.push_back({{"file", rel}, {"tokens", 0}});
  }

  fs::path root_;
  std::string split_;
  const Tokenizer& tok_;
  std::string slice_;
  uint64_t per_shard_;
  std::unique_ptr<ShardWriter> cur_;
  json shards_ = json::array();
  uint64_t tokens_ = 0, documents_ = 0;
};

std::string human_count(uint64_t n) {
  std::ostringstream s;
  if (n >= 10'000'000) s << n / 1'000'000 << "M";
  else if (n >= 10'000) s << n / 1000 << "k";
  else s << n;
  return s.str();
}

}  // namespace

std::string compute_slice_id(const std::vector<std::string>& input_sha256, const std::string& tokenizer_id,
                             double val_fraction, uint64_t seed) {
  json j = {{"format", kManifestVersion},
            {"inputs", input_sha256},
            {"tokenizer", tokenizer_id},
            {"val_fraction", val_fraction},
            {"seed", seed}};
  return sha256_hex(canonical_dump(j)).substr(0, 16);
}

json prepare(const PrepareOptions& o) {
  // ---- 1. Every check that can fail on the user's input, before anything is written.
  if (o.out.empty()) throw UserError("no output folder given (--out DIR)");
  check_inputs_exist(o.inputs);
  if (!(o.val_fraction >= 0.0 && o.val_fraction < 1.0))
    throw UserError("--val-fraction " + std::to_string(o.val_fraction) + " must be in [0, 1)");
  if (o.shard_tokens == 0) throw UserError("--shard-tokens must be at least 1");
  for (const auto& f : o.inputs) input_format(f, o.format);  // validates the format name
  auto tok = make_tokenizer(o.tokenizer);
  std::error_code ec;
  if (fs::exists(o.out, ec) && !o.force)
    throw UserError(o.out.string() + " already exists (use --force to replace it)");

  Progress progress(o.progress);
  json inputs = json::array();
  std::vector<std::string> shas;
  uint64_t n_docs = 0;
  for (size_t i = 0; i < o.inputs.size(); ++i) {
    const auto& f = o.inputs[i];
    uint64_t bytes = 0;
    const std::string sha = sha256_file(f, &bytes);
    uint64_t docs = 0;
    for_each_document(f, input_format(f, o.format), [&](Document&&) { ++docs; });
    n_docs += docs;
    shas.push_back(sha);
    inputs.push_back({{"path", f.string()}, {"sha256", sha}, {"bytes", bytes}, {"documents", docs}});
    progress.maybe([&] { return "checking inputs: " + std::to_string(i + 1) + "/" + std::to_string(o.inputs.size()) + " files, " + human_count(n_docs) + " documents"; });
  }
  if (n_docs == 0) throw UserError("empty input: the input files hold no documents with text");

  // ---- 2. The split: exactly round(F·N) documents go to val (at least one when F > 0
  // and there are two or more), chosen by a Fisher–Yates shuffle seeded by --seed.
  // A single document is split by tokens instead: its last F go to val.
  const bool split_by_tokens = n_docs == 1 && o.val_fraction > 0;
  std::vector<char> is_val(n_docs, 0);
  if (!split_by_tokens && o.val_fraction > 0) {
    uint64_t n_val = static_cast<uint64_t>(std::llround(o.val_fraction * static_cast<double>(n_docs)));
    n_val = std::clamp<uint64_t>(n_val, 1, n_docs - 1);
    std::vector<uint64_t> order(n_docs);
    for (uint64_t i = 0; i < n_docs; ++i) order[i] = i;
    Rng rng(o.seed, "val-split", 0);
    for (uint64_t i = 0; i < n_val; ++i) std::swap(order[i], order[i + rng.below(n_docs - i)]);
    for (uint64_t i = 0; i < n_val; ++i) is_val[order[i]] = 1;
  }
  const std::string slice_id = compute_slice_id(shas, tok->id(), o.val_fraction, o.seed);

  // ---- 3. Write everything under a temporary name, then rename.
  const fs::path out = fs::absolute(o.out).lexically_normal();
  const fs::path parent = out.parent_path();
  const fs::path tmp = parent / ("." + out.filename().string() + ".tmp-" + std::to_string(::getpid()));
  fs::create_directories(parent);
  fs::remove_all(tmp, ec);
  try {
    fs::create_directories(tmp / "train");
    fs::create_directories(tmp / "val");
    SplitWriter train(tmp, "train", *tok, slice_id, o.shard_tokens), val(tmp, "val", *tok, slice_id, o.shard_tokens);
    std::vector<int32_t> ids;
    uint64_t k = 0;
    for (const auto& f : o.inputs) {
      for_each_document(f, input_format(f, o.format), [&](Document&& d) {
        ids.clear();
        tok->encode(d.text, ids);
        if (tok->eod_id() >= 0) ids.push_back(tok->eod_id());
        if (split_by_tokens) {
          const size_t cut = static_cast<size_t>(std::llround((1.0 - o.val_fraction) * static_cast<double>(ids.size())));
          train.append(ids.data(), cut);
          val.append(ids.data() + cut, ids.size() - cut);
          train.add_document();
          val.add_document();
        } else {
          SplitWriter& w = is_val[k] ? val : train;
          w.append(ids.data(), ids.size());
          w.add_document();
        }
        ++k;
        progress.maybe([&] {
          return "tokenizing: " + std::to_string(k) + "/" + std::to_string(n_docs) + " documents, " +
                 human_count(train.tokens() + val.tokens()) + " tokens";
        });
      });
    }
    json manifest = {
        {"format", "lar-token-shards"},
        {"version", kManifestVersion},
        {"slice_id", slice_id},
        {"tokenizer", {{"id", tok->id()}, {"vocab_size", tok->vocab_size()}, {"eod_id", tok->eod_id()}}},
        {"dtype", dtype_for_vocab(static_cast<uint64_t>(tok->vocab_size())) == 2 ? "uint16" : "uint32"},
        {"split", {{"val_fraction", o.val_fraction}, {"seed", o.seed}, {"unit", split_by_tokens ? "tokens" : "documents"}}},
        {"inputs", inputs},
        {"train", train.finish()},
        {"val", val.finish()},
    };
    if (manifest["train"]["tokens"].get<uint64_t>() == 0)
      throw UserError("empty input: tokenization produced no training tokens");
    if (o.tokenizer.rfind("spm:", 0) == 0) {
      lar::atomic_write(tmp / "tokenizer.model", lar::read_file(o.tokenizer.substr(4)));
      manifest["tokenizer"]["model"] = "tokenizer.model";
    } else {
      manifest["tokenizer"]["model"] = nullptr;
    }
    lar::atomic_write(tmp / "manifest.json", manifest.dump(2) + "\n");
    fsync_dir(tmp / "train");
    fsync_dir(tmp / "val");
    fsync_dir(tmp);
    if (fs::exists(out)) {
      const fs::path old = parent / ("." + out.filename().string() + ".old-" + std::to_string(::getpid()));
      fs::rename(out, old);
      fs::rename(tmp, out);
      fs::remove_all(old, ec);
    } else {
      fs::rename(tmp, out);
    }
    fsync_dir(parent);
    progress.maybe([&] {
      return "wrote " + out.string() + ": " + human_count(manifest["train"]["tokens"].get<uint64_t>()) + " train + " +
             human_count(manifest["val"]["tokens"].get<uint64_t>()) + " val tokens, slice " + slice_id;
    }, true);
    return manifest;
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
}

json read_manifest(const fs::path& dir) {
  const fs::path mpath = dir / "manifest.json";
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw UserError(dir.string() + ": no such data folder");
  if (!fs::is_regular_file(mpath, ec))
    throw UserError(dir.string() + ": not a prepared data folder (no manifest.json; create one with `lar data prepare`)");
  json m;
  try {
    m = json::parse(lar::read_file(mpath));
  } catch (const json::exception& e) {
    throw UserError(mpath.string() + ": bad manifest: " + e.what());
  }
  auto bad = [&](const std::string& why) { return UserError(mpath.string() + ": bad manifest: " + why); };
  if (!m.is_object() || m.value("format", "") != "lar-token-shards") throw bad("format is not \"lar-token-shards\"");
  if (m.value("version", 0) != kManifestVersion)
    throw bad("unsupported version " + m.value("version", json(0)).dump() + " (this lar reads " + std::to_string(kManifestVersion) + ")");
  try {
    const std::string slice = m.at("slice_id").get<std::string>();
    const std::string tok = m.at("tokenizer").at("id").get<std::string>();
    for (const char* split : {"train", "val"}) {
      uint64_t sum = 0;
      for (const auto& s : m.at(split).at("shards")) {
        const fs::path file = dir / s.at("file").get<std::string>();
        ShardInfo info = read_shard_info(file);  // validates magic, version, size
        if (info.tokens != s.at("tokens").get<uint64_t>())
          throw bad(file.string() + " holds " + std::to_string(info.tokens) + " tokens, the manifest says " + s.at("tokens").dump());
        if (info.tokenizer_id != tok || info.slice_id != slice)
          throw bad(file.string() + " belongs to another data slice (" + info.tokenizer_id + ", " + info.slice_id + ")");
        sum += info.tokens;
      }
      if (sum != m.at(split).at("tokens").get<uint64_t>()) throw bad(std::string(split) + " token total does not match its shards");
    }
  } catch (const json::exception& e) {
    throw bad(e.what());
  }
  return m;
}

std::string describe_manifest(const json& m, const fs::path& dir) {
  std::ostringstream s;
  auto split_line = [&](const char* name) {
    const auto& sp = m.at(name);
    const auto n = sp.at("shards").size();
    s << "  " << name << (std::string(name) == "val" ? "         " : "       ") << sp.at("documents").get<uint64_t>()
      << " documents, " << sp.at("tokens").get<uint64_t>() << " tokens in " << n << (n == 1 ? " shard" : " shards") << "\n";
  };
  const auto& t = m.at("tokenizer");
  s << "data folder   " << dir.string() << "\n"
    << "  slice id    " << m.at("slice_id").get<std::string>() << "\n"
    << "  tokenizer   " << t.at("id").get<std::string>() << " (vocab " << t.at("vocab_size").get<int>()
    << ", document separator id " << t.at("eod_id").get<int>() << ")\n"
    << "  dtype       " << m.at("dtype").get<std::string>() << "\n"
    << "  split       val fraction " << m.at("split").at("val_fraction").get<double>() << " by "
    << m.at("split").at("unit").get<std::string>() << ", seed " << m.at("split").at("seed").get<uint64_t>() << "\n";
  split_line("train");
  split_line("val");
  const auto& in = m.at("inputs");
  s << "  inputs      " << in.size() << (in.size() == 1 ? " file" : " files");
  if (!in.empty()) s << " (" << in[0].at("path").get<std::string>() << (in.size() > 1 ? ", …" : "") << ")";
  s << "\n";
  return s.str();
}

}  // namespace lar::data
