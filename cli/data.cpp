// `lar data` — prepare token shards, train a SentencePiece tokenizer, describe a data folder.
//   lar data prepare --input FILES... --tokenizer byte|spm:MODEL --out DIR [--val-fraction F] [--seed S]
//   lar data tokenizer train --input FILES... --vocab-size N --out MODEL
//   lar data info DIR [--json]
// The logic lives in trainer/data/ (prepare.hpp, tokenizer.hpp); see docs/data.md.
#include <unistd.h>

#include <iostream>
#include <memory>

#include "cli/command.hpp"
#include "trainer/data/prepare.hpp"
#include "trainer/data/tokenizer.hpp"

namespace {

struct DataOptions {
  lar::data::PrepareOptions prepare;
  std::vector<std::string> prepare_inputs;
  std::string prepare_out;
  lar::data::SpmTrainOptions spm;
  std::vector<std::string> spm_inputs;
  std::string spm_out;
  std::string info_dir;
  bool info_json = false;
  bool quiet = false;
};

// Progress goes to stderr: rewritten in place on a terminal, one line at a time otherwise.
void show_progress(const std::string& line) {
  static const bool tty = ::isatty(STDERR_FILENO) == 1;
  if (tty) std::cerr << "\r\033[K" << line << std::flush;
  else std::cerr << line << "\n";
}
void end_progress() {
  if (::isatty(STDERR_FILENO) == 1) std::cerr << "\n";
}

}  // namespace

static lar::cli::CommandRegistration reg{
    "data", "Prepare token shards, train a tokenizer, describe a data folder", 70,
    [](CLI::App& app) -> lar::cli::Runner {
      auto o = std::make_shared<DataOptions>();
      app.require_subcommand(1);

      CLI::App* prep = app.add_subcommand("prepare", "Tokenize text / JSONL files into train and val token shards");
      prep->add_option("--input", o->prepare_inputs, "input files: text (one document per file) or JSONL (*.jsonl: field \"text\")")
          ->required()->expected(1, -1);
      prep->add_option("--tokenizer", o->prepare.tokenizer, "byte, or spm:MODEL for a SentencePiece model")
          ->capture_default_str();
      prep->add_option("--out", o->prepare_out, "output folder (written whole or not at all)")->required();
      prep->add_option("--val-fraction", o->prepare.val_fraction, "fraction of documents held out for validation")
          ->capture_default_str();
      prep->add_option("--seed", o->prepare.seed, "seed of the train/val split")->capture_default_str();
      prep->add_option("--format", o->prepare.format, "input format: auto (by extension), text or jsonl")
          ->check(CLI::IsMember({"auto", "text", "jsonl"}))->capture_default_str();
      prep->add_option("--shard-tokens", o->prepare.shard_tokens, "tokens per shard file at most")->capture_default_str();
      prep->add_flag("--force", o->prepare.force, "replace an existing output folder");
      prep->add_flag("-q,--quiet", o->quiet, "no progress lines");

      CLI::App* tok = app.add_subcommand("tokenizer", "SentencePiece tokenizers");
      tok->require_subcommand(1);
      CLI::App* train = tok->add_subcommand("train", "Train a SentencePiece model (libsentencepiece) on text / JSONL files");
      train->add_option("--input", o->spm_inputs, "input files (text or JSONL, as for prepare)")->required()->expected(1, -1);
      train->add_option("--vocab-size", o->spm.vocab_size, "vocabulary size")->required();
      train->add_option("--out", o->spm_out, "the .model file to write")->required();
      train->add_option("--model-type", o->spm.model_type, "unigram, bpe, char or word")
          ->check(CLI::IsMember({"unigram", "bpe", "char", "word"}))->capture_default_str();
      train->add_option("--character-coverage", o->spm.character_coverage, "fraction of characters covered")
          ->capture_default_str();
      train->add_option("--format", o->spm.format, "input format: auto, text or jsonl")
          ->check(CLI::IsMember({"auto", "text", "jsonl"}))->capture_default_str();
      train->add_flag("--verbose", o->spm.verbose, "show SentencePiece's own log");

      CLI::App* info = app.add_subcommand("info", "Describe a prepared data folder (and check its shards)");
      info->add_option("dir", o->info_dir, "data folder")->required();
      info->add_flag("--json", o->info_json, "print the manifest as JSON");

      return [o, prep, train, info] {
        if (prep->parsed()) {
          o->prepare.inputs.assign(o->prepare_inputs.begin(), o->prepare_inputs.end());
          o->prepare.out = o->prepare_out;
          if (!o->quiet) o->prepare.progress = show_progress;
          const auto m = lar::data::prepare(o->prepare);
          if (!o->quiet) end_progress();
          std::cout << lar::data::describe_manifest(m, o->prepare.out);
          return 0;
        }
        if (train->parsed()) {
          o->spm.inputs.assign(o->spm_inputs.begin(), o->spm_inputs.end());
          o->spm.out = o->spm_out;
          std::cerr << "training a SentencePiece " << o->spm.model_type << " model, vocab " << o->spm.vocab_size << "…\n";
          lar::data::train_spm(o->spm);
          std::cout << "wrote " << o->spm.out.string() << " (use it with --tokenizer spm:" << o->spm.out.string() << ")\n";
          return 0;
        }
        if (info->parsed()) {
          const auto m = lar::data::read_manifest(o->info_dir);
          if (o->info_json) std::cout << m.dump(2) << "\n";
          else std::cout << lar::data::describe_manifest(m, o->info_dir);
          return 0;
        }
        return 2;
      };
    }};
