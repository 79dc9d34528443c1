#pragma once
// A trained run opened for evaluation: its prepared config, a backend, the model with the
// parameters of its newest intact checkpoint, and the tokenizer its data was prepared with.
#include <filesystem>
#include <memory>
#include <string>

#include "core/json.hpp"
#include "kernels/backend.hpp"
#include "trainer/data/tokenizer.hpp"
#include "trainer/model.hpp"

namespace lar::eval {

struct OpenOptions {
  std::string backend;       // "" = the run's own (resolved like `lar train`); else cpu | cuda | auto
  int threads = -1;          // -1 = the run's `threads`
  bool disable_ccq = false;  // CCQ off at inference (model.ccq.disable_at_eval = true)
};

class LoadedRun {
 public:
  // UserError: no config.json, no intact checkpoint, a running run is not refused here.
  static std::unique_ptr<LoadedRun> open(const std::filesystem::path& run_dir, const OpenOptions& o = {});

  const std::filesystem::path& dir() const { return dir_; }
  const json& config() const { return config_; }
  trainer::Model& model() { return *model_; }
  kernels::Backend& backend() { return *be_; }
  long checkpoint_step() const { return step_; }
  // The tokenizer of the run's data (byte for synthetic tasks and byte-level shards,
  // SentencePiece from the prepared folder's tokenizer.model). UserError when the data
  // folder is gone.
  const data::Tokenizer& tokenizer();
  // The prepared data folder of an LM run ("" for synthetic tasks).
  std::filesystem::path data_dir() const;
  // Tokens the model saw per sequence in training (data.seq_len): the default window.
  int train_length() const { return config_.at("data").at("seq_len").get<int>(); }

 private:
  std::filesystem::path dir_;
  json config_;
  std::unique_ptr<kernels::Backend> be_;
  std::unique_ptr<trainer::Model> model_;
  std::unique_ptr<data::Tokenizer> tok_;
  long step_ = 0;
};

}  // namespace lar::eval
