#include "eval/long_context.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "trainer/data/prepare.hpp"
#include "trainer/data/shard.hpp"
#include "trainer/data/tasks.hpp"

namespace lar::eval {

namespace fs = std::filesystem;

std::vector<int> parse_lengths(const std::string& csv, const std::string& flag) {
  std::vector<int> out;
  size_t pos = 0;
  while (pos <= csv.size()) {
    size_t comma = csv.find(',', pos);
    if (comma == std::string::npos) comma = csv.size();
    std::string item = csv.substr(pos, comma - pos);
    pos = comma + 1;
    if (item.empty()) continue;
    long mult = 1;
    std::string num = item;
    if (num.back() == 'K' || num.back() == 'k') {
      mult = 1024;
      num.pop_back();
    }
    size_t used = 0;
    long v = 0;
    try {
      v = std::stol(num, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != num.size() || num.empty() || v * mult < 2 || v * mult > (1L << 24))
      throw UserError(flag + ": '" + item + "' is not a length (an integer ≥ 2, or NK for N·1024)");
    out.push_back(static_cast<int>(v * mult));
  }
  if (out.empty()) throw UserError(flag + ": no lengths given");
  return out;
}

json window_perplexity(LoadedRun& run, const WindowOptions& o, json& prov) {
  const fs::path dir = o.corpus.empty() ? run.data_dir() : o.corpus;
  if (dir.empty())
    throw UserError("--lengths: this run trained on a synthetic task; give a prepared corpus with --corpus DIR");
  if (o.split != "val" && o.split != "train") throw UserError("--split: expected val or train, got '" + o.split + "'");
  const json manifest = data::read_manifest(dir);
  const std::string tok_id = manifest.at("tokenizer").at("id").get<std::string>();
  if (!run.data_dir().empty()) {
    const std::string own = data::read_manifest(run.data_dir()).at("tokenizer").at("id").get<std::string>();
    if (own != tok_id)
      throw UserError("--corpus " + dir.string() + ": tokenized with " + tok_id + ", the run's data with " + own +
                      " (prepare the corpus with the run's tokenizer)");
  }
  std::vector<data::ShardReader> shards;
  uint64_t total = 0;
  for (const auto& s : manifest.at(o.split).at("shards")) {
    shards.emplace_back(dir / s.at("file").get<std::string>());
    total += shards.back().size();
  }
  std::vector<uint64_t> starts;  // first token of each shard in the split
  for (size_t k = 0; k < shards.size(); ++k) starts.push_back(k == 0 ? 0 : starts[k - 1] + shards[k - 1].size());
  // Tokens [pos, pos + n) of the split, across shard boundaries (read from the mapped shards).
  auto copy = [&](uint64_t pos, uint64_t n, int32_t* dst) {
    size_t k = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), pos) - starts.begin()) - 1;
    while (n > 0) {
      const uint64_t off = pos - starts[k], take = std::min<uint64_t>(n, shards[k].size() - off);
      shards[k].copy(off, take, dst);
      dst += take, pos += take, n -= take, ++k;
    }
  };
  json out = json::object();
  auto& model = run.model();
  std::vector<double> nll;
  for (int L : o.lengths) {
    long windows = total > 0 ? static_cast<long>((total - 1) / L) : 0;
    if (windows == 0)
      throw UserError("--lengths " + std::to_string(L) + ": the " + o.split + " split of " + dir.string() + " holds " +
                      std::to_string(total) + " tokens, fewer than one window of " + std::to_string(L + 1));
    if (o.max_windows > 0) windows = std::min(windows, o.max_windows);
    double sum = 0, count = 0;
    for (long w0 = 0; w0 < windows; w0 += o.batch) {
      const int B = static_cast<int>(std::min<long>(o.batch, windows - w0));
      data::Batch b;
      b.batch = B;
      b.seq_len = L;
      b.inputs.resize(static_cast<size_t>(B) * L);
      b.targets.resize(b.inputs.size());
      b.loss_mask.assign(b.inputs.size(), 1.f);
      std::vector<int32_t> w(static_cast<size_t>(L) + 1);
      for (int r = 0; r < B; ++r) {
        copy(static_cast<uint64_t>(w0 + r) * L, static_cast<uint64_t>(L) + 1, w.data());
        std::copy(w.begin(), w.end() - 1, b.inputs.begin() + static_cast<size_t>(r) * L);
        std::copy(w.begin() + 1, w.end(), b.targets.begin() + static_cast<size_t>(r) * L);
      }
      trainer::StepResult res = model.evaluate(b);
      sum += res.loss * res.mask_sum;
      count += res.mask_sum;
    }
    const std::string k = "@" + std::to_string(L);
    out["loss" + k] = sum / count;
    out["ppl" + k] = std::exp(sum / count);
    out["tokens" + k] = count;
    out["windows" + k] = windows;
  }
  prov = {{"corpus", fs::absolute(dir).string()}, {"slice_id", manifest.value("slice_id", "")},
          {"split", o.split}, {"tokenizer", tok_id}, {"max_windows", o.max_windows}};
  return out;
}

json niah(LoadedRun& run, const NiahOptions& o) {
  const json& cfg = run.config();
  const json& d = cfg.at("data");
  json out = json::object();
  for (const auto& spec : o.tasks) {
    std::string task = spec, needle = d.at("needle").get<std::string>();
    if (auto c = spec.find(':'); c != std::string::npos) {
      task = spec.substr(0, c);
      needle = spec.substr(c + 1);
    }
    if (task != "sniah" && task != "mkniah")
      throw UserError("--niah: '" + spec + "' is not a retrieval task (sniah, sniah:passkey|number|uuid, mkniah)");
    data::TaskParams tp;
    tp.vocab_size = cfg.at("model").at("vocab_size").get<int>();
    tp.needle = needle;
    tp.num_needles = d.at("num_needles").get<int>();
    auto gen = data::make_task(task, tp);
    if (gen->vocab_needed() > tp.vocab_size)
      throw UserError("--niah " + spec + ": needs a vocabulary of " + std::to_string(gen->vocab_needed()) +
                      ", the model has " + std::to_string(tp.vocab_size));
    const std::string key = task + (spec.find(':') != std::string::npos ? "_" + needle : "") + "_acc";
    for (int L : o.lengths) {
      try {
        gen->check_length(L);
      } catch (const UserError& e) {
        throw UserError("--niah " + spec + " at length " + std::to_string(L) + ": " + e.what());
      }
      double right = 0, answers = 0;
      std::vector<int32_t> pred;
      const std::string domain = gen->name() + "-val-" + std::to_string(L);
      for (int s0 = 0; s0 < o.samples; s0 += o.batch) {
        const int B = std::min(o.batch, o.samples - s0);
        data::Batch b;
        b.batch = B;
        b.seq_len = L;
        for (int r = 0; r < B; ++r) {
          data::Rng rng(0, domain, static_cast<uint64_t>(s0 + r));
          data::Sample smp = gen->generate(rng, L);
          const int base = b.num_answers();
          b.inputs.insert(b.inputs.end(), smp.inputs.begin(), smp.inputs.end());
          b.targets.insert(b.targets.end(), smp.targets.begin(), smp.targets.end());
          b.loss_mask.insert(b.loss_mask.end(), smp.loss_mask.begin(), smp.loss_mask.end());
          for (int32_t a : smp.answer_id) b.answer_id.push_back(a < 0 ? -1 : a + base);
          b.answer_kind.insert(b.answer_kind.end(), smp.answer_kind.begin(), smp.answer_kind.end());
        }
        run.model().evaluate(b, &pred);
        const json sc = data::score_answers(b, pred, gen->kind_names());
        const double n = sc.value("answers", 0.0);
        right += n * sc.value("acc", 0.0);
        answers += n;
      }
      out[key + "@" + std::to_string(L)] = answers > 0 ? right / answers : 0.0;
    }
  }
  return out;
}

}  // namespace lar::eval
