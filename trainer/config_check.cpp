#include "trainer/config_check.hpp"

#include <algorithm>
#include <filesystem>
#include <set>

#include "core/config_schema.hpp"
#include "core/error.hpp"
#include "trainer/data/dataset.hpp"
#include "trainer/mixer.hpp"
#include "trainer/model.hpp"
#include "trainer/optim/optimizer.hpp"
#include "trainer/optim/schedule.hpp"
#include "trainer/train.hpp"

namespace lar::trainer {

namespace fs = std::filesystem;

namespace {

// Each distinct layer kind once: a mixer's constructor checks its own options (CCQ's λ,
// CARVE's rank, which routings it can publish) and only describes its parameters, so
// building one per kind costs no memory.
void check_mixers(const json& model) {
  std::set<std::string> seen;
  const auto kinds = layer_kinds(model);
  for (std::size_t l = 0; l < kinds.size(); ++l)
    if (seen.insert(kinds[l]).second) (void)make_mixer(mixer_config(model, static_cast<int>(l)));
}

bool key_char(char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '.'; }

}  // namespace

std::vector<std::string> check_data(const json& config, const CheckOptions& options) {
  std::vector<std::string> notes;
  const json& d = config.at("data");
  if (d.at("task") == "lm" && !options.require_data) {
    const fs::path dir = data::lm_data_dir(config);
    std::error_code ec;
    if (!fs::exists(dir / "manifest.json", ec)) {
      data::check_data_shape(config);
      notes.push_back("data.path: no prepared data at " + dir.string() +
                      " on this machine yet (prepare it before launching; docs/data.md)");
      return notes;
    }
  }
  auto ds = data::make_dataset(config);  // data path, vocabulary coverage, task parameters
  for (const auto& len : config.at("eval").at("lengths")) {
    if (len.get<long>() < 2) throw UserError("eval.lengths: " + len.dump() + " is not a usable sequence length (≥ 2)");
    try {
      (void)ds->val_batch(0, len.get<int>());
    } catch (const UserError& e) {
      throw UserError("eval.lengths: " + len.dump() + ": " + e.what());
    }
  }
  return notes;
}

json data_check_key(const json& config) {
  return {
      {"data", config.at("data")}, {"vocab_size", config.at("model").at("vocab_size")}, {"eval", config.at("eval")}};
}

void check_config_without_data(const json& config) {
  // cuda.gemm tune times the GEMM candidates: the bits follow the timings
  if (config.contains("cuda") && config["cuda"].value("gemm", std::string()) == "tune" &&
      config.value("deterministic", false))
    throw UserError("cuda.gemm: 'tune' picks GEMM algorithms by their timings, so the bits vary between processes; "
                    "deterministic: true takes heuristic or cublas");
  validate_model_config(config);
  check_mixers(config.at("model"));
  check_batch_split(config, 1);
  (void)optim::OptimizerConfig::from_json(config);
  (void)optim::Schedule::from_json(config, total_steps(config));
}

std::vector<std::string> check_config(const json& config, const CheckOptions& options) {
  check_config_without_data(config);
  return check_data(config, options);
}

std::vector<std::string> config_keys_named(const std::string& message) {
  std::vector<std::string> keys;
  for (std::size_t i = 0; i < message.size();) {
    if (!key_char(message[i]) || (i > 0 && key_char(message[i - 1]))) {
      ++i;
      continue;
    }
    std::size_t j = i;
    while (j < message.size() && key_char(message[j])) ++j;
    std::string word = message.substr(i, j - i);
    while (!word.empty() && word.back() == '.') word.pop_back();
    // A top-level key ("seed", "threads") is a plain word too: only the message's first
    // word counts as one; elsewhere a key is written with its section ("model.n_heads").
    const bool dotted = word.find('.') != std::string::npos;
    if ((dotted || i == 0) && !word.empty()) {
      const SchemaNode* n = schema_lookup(word);
      if (n && n->type != SchemaType::map && std::find(keys.begin(), keys.end(), word) == keys.end())
        keys.push_back(word);
    }
    i = j;
  }
  return keys;
}

}  // namespace lar::trainer
