#include "eval/loaded_run.hpp"

#include <cstring>

#include "core/error.hpp"
#include "core/paths.hpp"
#include "core/run_dir.hpp"
#include "trainer/checkpoint.hpp"
#include "trainer/data/prepare.hpp"
#include "trainer/train.hpp"

namespace lar::eval {

namespace fs = std::filesystem;

std::unique_ptr<LoadedRun> LoadedRun::open(const fs::path& run_dir, const OpenOptions& o) {
  auto r = std::unique_ptr<LoadedRun>(new LoadedRun());
  r->dir_ = run_dir;
  json cfg = trainer::read_run_config(run_dir);
  if (!o.backend.empty()) cfg["backend"] = o.backend;
  if (o.threads >= 0) cfg["threads"] = o.threads;
  if (o.disable_ccq) cfg["model"]["ccq"]["disable_at_eval"] = true;
  r->config_ = cfg;
  std::vector<std::string> skipped;
  auto ck = trainer::load_latest_checkpoint(RunDir(run_dir).checkpoints_dir(), &skipped);
  if (!ck)
    throw UserError(run_dir.string() + ": no intact checkpoint to evaluate (train the run first: lar train --run-dir " +
                    run_dir.string() + ")");
  r->step_ = ck->step;
  const kernels::Backend::Options bopts = trainer::backend_options(cfg);
  r->be_ = kernels::make_backend(trainer::resolve_train_backend(cfg), cfg.at("threads").get<int>(),
                                 kernels::DType::f32, bopts);
  r->model_ = std::make_unique<trainer::Model>(cfg, *r->be_);
  auto& ps = r->model_->params();
  if (ck->params.size() != ps.params().bytes())
    throw RuntimeError("checkpoint step " + std::to_string(ck->step) + " holds " + std::to_string(ck->params.size()) +
                       " parameter bytes, the model has " + std::to_string(ps.params().bytes()));
  r->be_->upload(ck->params.data(), ps.params());
  return r;
}

fs::path LoadedRun::data_dir() const {
  const json& d = config_.at("data");
  if (d.at("task").get<std::string>() != "lm") return {};
  const std::string p = d.at("path").get<std::string>();
  return p.empty() ? data_root() / "brown" : fs::path(p);
}

const data::Tokenizer& LoadedRun::tokenizer() {
  if (tok_) return *tok_;
  const fs::path dir = data_dir();
  if (dir.empty()) {
    tok_ = std::make_unique<data::ByteTokenizer>();
    return *tok_;
  }
  const json manifest = data::read_manifest(dir);
  const std::string id = manifest.at("tokenizer").at("id").get<std::string>();
  if (id == "byte") {
    tok_ = std::make_unique<data::ByteTokenizer>();
  } else {
    const fs::path model = dir / "tokenizer.model";
    tok_ = data::make_tokenizer("spm:" + model.string());
    if (tok_->id() != id)
      throw UserError(model.string() + ": tokenizer id " + tok_->id() + " differs from the manifest's " + id);
  }
  return *tok_;
}

}  // namespace lar::eval
