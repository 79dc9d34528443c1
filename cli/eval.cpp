// `lar eval RUN …` — the papers' evaluations of a trained run's final checkpoint: zero-shot
// tasks from local files, perplexity, windows at lengths, S-NIAH / MK-NIAH, inference
// speed. Results go into the run directory and the registry (eval/record.hpp). Logic
// lives in eval/; docs/eval.md.
#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <iostream>

#include "cli/command.hpp"
#include "core/error.hpp"
#include "core/paths.hpp"
#include "core/run_dir.hpp"
#include "eval/long_context.hpp"
#include "eval/record.hpp"
#include "eval/speed.hpp"
#include "eval/task_files.hpp"
#include "registry/registry.hpp"
#include "trainer/train.hpp"

namespace {

namespace fs = std::filesystem;
using lar::RunDir;
using lar::UserError;
using lar::json;

struct EvalArgs {
  std::string run, db, backend, format = "text", samples_out;
  std::vector<std::string> tasks;
  int batch = 8, max_len = 0, threads = -1;
  long limit = 0;
  std::string lengths, corpus, split = "val", niah;
  std::vector<std::string> averages;
  long max_windows = 64;
  int niah_samples = 32;
  bool speed = false, disable_ccq = false, no_record = false;
  int speed_batch = 8, prompt_len = 0, decode_tokens = 64, repeats = 3;
};

fs::path resolve_run_dir(const EvalArgs& a, const fs::path& db) {
  std::error_code ec;
  if (fs::exists(fs::path(a.run) / "config.json", ec)) return fs::path(a.run);
  if (!fs::exists(db, ec))
    throw UserError("'" + a.run + "' is neither a run directory nor a run of a registry (no registry at " + db.string() + ")");
  auto reg = lar::registry::Registry::open(db, true);
  auto r = reg.require_run(a.run);
  if (r.run_dir.empty()) throw UserError("run " + r.run_id + " has no run directory in the registry");
  return fs::path(r.run_dir);
}

std::string num(const lar::json& v) {
  if (!v.is_number()) return v.dump();
  return fmt::format("{:.6g}", v.get<double>());
}

int run_eval(const EvalArgs& a) {
  using namespace lar;
  if (a.format != "text" && a.format != "json") throw UserError("--format: expected text or json, got '" + a.format + "'");
  if (a.batch < 1) throw UserError("--batch: must be ≥ 1, got " + std::to_string(a.batch));
  if (a.max_len < 0) throw UserError("--max-length: must be ≥ 0, got " + std::to_string(a.max_len));
  const fs::path db = a.db.empty() ? default_db_path() : fs::path(a.db);
  const fs::path dir = resolve_run_dir(a, db);
  // Every argument is checked (and every task file read) before the model is loaded.
  std::vector<eval::TaskFile> tasks;
  for (const auto& t : a.tasks) tasks.push_back(eval::open_task_file(t));
  std::vector<int> lengths;
  if (a.lengths == "run") {  // the run's own eval.lengths
    const json cfg = trainer::read_run_config(dir);
    for (const auto& l : cfg.at("eval").at("lengths")) lengths.push_back(l.get<int>());
    if (lengths.empty()) throw UserError("--lengths run: the run's config has no eval.lengths");
  } else if (!a.lengths.empty()) {
    lengths = eval::parse_lengths(a.lengths, "--lengths");
  }
  std::vector<std::string> niah;
  for (size_t p = 0; !a.niah.empty() && p <= a.niah.size();) {
    size_t c = a.niah.find(',', p);
    if (c == std::string::npos) c = a.niah.size();
    if (c > p) niah.push_back(a.niah.substr(p, c - p));
    p = c + 1;
  }
  if (!niah.empty() && lengths.empty()) throw UserError("--niah needs --lengths (the haystack lengths)");
  if (tasks.empty() && lengths.empty() && !a.speed && a.averages.empty())
    throw UserError("nothing to evaluate: give --task FILE, --lengths L[,L…] (with --corpus or --niah), --speed or --average");
  if (!a.no_record) eval::check_not_running(dir);

  eval::OpenOptions oo;
  oo.backend = a.backend;
  oo.threads = a.threads;
  oo.disable_ccq = a.disable_ccq;
  auto run = eval::LoadedRun::open(dir, oo);
  std::vector<eval::EvalRecord> records;
  json samples = json::array();
  for (const auto& t : tasks) {
    json r = eval::run_task(*run, t, {a.batch, a.max_len, a.limit}, a.samples_out.empty() ? nullptr : &samples);
    eval::EvalRecord rec;
    rec.name = t.name;
    rec.metrics = json::object();
    for (const auto& [k, v] : r.items())
      if (v.is_number() && k != "max_len") rec.metrics[t.name + "_" + k] = v;
    rec.provenance = {{"file", t.path.string()}, {"sha256", t.sha256}, {"kind", r["kind"]}, {"max_len", r["max_len"]},
                      {"limit", a.limit}, {"disable_ccq", a.disable_ccq}};
    records.push_back(std::move(rec));
  }
  const bool windows = !lengths.empty() && (niah.empty() || !a.corpus.empty());
  if (windows) {
    eval::WindowOptions wo;
    wo.lengths = lengths;
    wo.corpus = a.corpus;
    wo.split = a.split;
    wo.max_windows = a.max_windows;
    wo.batch = a.batch;
    eval::EvalRecord rec;
    rec.name = "long_context";
    rec.metrics = eval::window_perplexity(*run, wo, rec.provenance);
    rec.provenance["disable_ccq"] = a.disable_ccq;
    records.push_back(std::move(rec));
  }
  for (const auto& spec : niah) {
    eval::EvalRecord rec;
    rec.name = spec;
    std::replace(rec.name.begin(), rec.name.end(), ':', '_');
    rec.metrics = eval::niah(*run, {lengths, {spec}, a.niah_samples, a.batch});
    rec.provenance = {{"task", spec}, {"lengths", lengths}, {"samples", a.niah_samples}, {"disable_ccq", a.disable_ccq},
                      {"generator", "trainer/data/tasks.cpp, held-out Rng(0, <task>-val-<L>, k)"}};
    records.push_back(std::move(rec));
  }
  if (a.speed) {
    eval::SpeedOptions so{a.speed_batch, a.prompt_len, a.decode_tokens, a.repeats};
    eval::EvalRecord rec;
    rec.name = "speed";
    rec.metrics = eval::measure_speed(*run, so);
    rec.provenance = {{"batch", a.speed_batch},
                      {"prompt_len", a.prompt_len > 0 ? a.prompt_len : run->train_length()},
                      {"decode_tokens", a.decode_tokens},
                      {"repeats", a.repeats},
                      {"backend", run->backend().name()}};
    records.push_back(std::move(rec));
  }

  if (!a.samples_out.empty()) {
    std::ofstream f(a.samples_out);
    if (!f) throw UserError("--samples " + a.samples_out + ": cannot write");
    for (const auto& s : samples) f << s.dump() << "\n";
  }
  // Averages over recorded scalars (this call's or earlier ones'): NAME=KEY,KEY,…
  if (!a.averages.empty()) {
    json known = json::object();
    if (auto st = RunDir(dir).read_status()) known = st->summary;
    for (const auto& r : records) known.update(r.metrics);
    for (const auto& spec : a.averages) {
      const size_t eq = spec.find('=');
      if (eq == std::string::npos || eq == 0) throw UserError("--average '" + spec + "': expected NAME=KEY,KEY,…");
      eval::EvalRecord rec;
      rec.name = spec.substr(0, eq);
      std::vector<std::string> keys;
      double sum = 0;
      for (size_t p = eq + 1; p <= spec.size();) {
        size_t c = spec.find(',', p);
        if (c == std::string::npos) c = spec.size();
        const std::string k = spec.substr(p, c - p);
        p = c + 1;
        if (k.empty()) continue;
        if (!known.contains(k) || !known[k].is_number())
          throw UserError("--average " + rec.name + ": '" + k + "' is not a recorded metric of this run");
        keys.push_back(k);
        sum += known[k].get<double>();
      }
      if (keys.empty()) throw UserError("--average '" + spec + "': no metrics listed");
      rec.metrics = {{rec.name, sum / static_cast<double>(keys.size())}};
      rec.provenance = {{"average_of", keys}};
      records.push_back(std::move(rec));
    }
  }
  // CCQ switched off at inference is another measurement of the same checkpoint: its keys
  // carry a suffix (sniah_passkey_acc@4096_ccq_off) so that both stay recorded.
  if (a.disable_ccq)
    for (auto& r : records) {
      json m = json::object();
      for (const auto& [k, v] : r.metrics.items()) m[k + "_ccq_off"] = v;
      r.metrics = m;
      r.name += "_ccq_off";
    }
  bool synced = false;
  if (!a.no_record) {
    for (const auto& r : records) eval::record(dir, run->checkpoint_step(), r);
    synced = eval::sync_registry(db, dir);
  }
  if (a.format == "json") {
    json j = {{"run_dir", dir.string()}, {"checkpoint_step", run->checkpoint_step()}, {"results", json::object()}};
    for (const auto& r : records) j["results"][r.name] = {{"metrics", r.metrics}, {"provenance", r.provenance}};
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  std::cout << fmt::format("run dir {}  (checkpoint step {}, backend {})\n", dir.string(), run->checkpoint_step(),
                           run->backend().name());
  for (const auto& r : records) {
    std::cout << "\n" << r.name;
    if (r.provenance.contains("file")) std::cout << "  " << r.provenance["file"].get<std::string>() << "  sha256 "
                                                 << r.provenance["sha256"].get<std::string>().substr(0, 16);
    if (r.provenance.contains("corpus")) std::cout << "  " << r.provenance["corpus"].get<std::string>();
    std::cout << "\n";
    for (const auto& [k, v] : r.metrics.items()) std::cout << fmt::format("  {:<32} {}\n", k, num(v));
  }
  if (a.no_record) std::cout << "\n(not recorded: --no-record)\n";
  else std::cout << "\nrecorded in " << (dir / "status.json").string() << (synced ? " and " + db.string() : "") << "\n";
  return 0;
}

}  // namespace

static lar::cli::CommandRegistration reg{
    "eval", "Evaluate a trained run: zero-shot tasks, perplexity, lengths, NIAH, speed", 37,
    [](CLI::App& app) -> lar::cli::Runner {
      auto a = std::make_shared<EvalArgs>();
      app.add_option("run", a->run, "Run id (experiment/cell, a unique prefix, cell id or hash prefix) or a run directory")
          ->required();
      app.add_option("--db", a->db, "Registry database (default: $LAR_DB or $LAR_HOME/lar.db)");
      app.add_option("--task", a->tasks,
                     "[NAME=]FILE: a task file (repeatable). JSONL with context/choices/gold or contexts/continuation/gold:\n"
                     "multiple choice (acc, acc_norm); JSONL with text: LAMBADA when NAME starts with 'lambada'\n"
                     "(acc, ppl), else documents for perplexity; a text file: one document (ppl = word perplexity,\n"
                     "byte_ppl, bits_per_byte, token_ppl). NAME (default: the file's stem) prefixes the metrics");
      app.add_option("--batch", a->batch, "Sequences per forward pass (default 8)");
      app.add_option("--max-length", a->max_len, "Model input length for tasks (default: the run's data.seq_len)");
      app.add_option("--limit", a->limit, "Score only the first N documents of each task file");
      app.add_option("--lengths", a->lengths,
                     "L[,L…] (4096 or 4K), or 'run' (the run's eval.lengths): token-weighted perplexity over\n"
                     "non-overlapping windows of each length (ppl@L, loss@L), and the --niah tasks at each length");
      app.add_option("--corpus", a->corpus, "Prepared data folder for --lengths (default: the run's own data)");
      app.add_option("--split", a->split, "Split of the corpus for --lengths: val (default) or train");
      app.add_option("--max-windows", a->max_windows, "Windows per length at most (default 64; 0 = all)");
      app.add_option("--niah", a->niah,
                     "TASK[,TASK…]: sniah, sniah:passkey|number|uuid, mkniah, mkniah:uuid… at each --lengths\n"
                     "(<task>[_<needle>]_acc@L, on the trainer's held-out samples)");
      app.add_option("--niah-samples", a->niah_samples, "Haystacks per task and length (default 32)");
      app.add_flag("--disable-ccq", a->disable_ccq, "CCQ off at inference (model.ccq.disable_at_eval = true)");
      app.add_flag("--speed", a->speed, "Measure prefill latency and decode tokens/s (prefill_ms, decode_tok_s)");
      app.add_option("--speed-batch", a->speed_batch, "Batch size of --speed (default 8)");
      app.add_option("--prompt-len", a->prompt_len, "Prefill length of --speed (default: the run's data.seq_len)");
      app.add_option("--decode-tokens", a->decode_tokens, "Tokens decoded per row by --speed (default 64)");
      app.add_option("--repeats", a->repeats, "Timed repeats of --speed, median reported (default 3)");
      app.add_option("--backend", a->backend, "cpu | cuda | auto (default: the run's, resolved as by lar train)");
      app.add_option("--threads", a->threads, "CPU threads (default: the run's `threads`)");
      app.add_option("--samples", a->samples_out, "Write every scored request (log-likelihood, greedy) to this JSONL file");
      app.add_option("--average", a->averages,
                     "NAME=KEY,KEY,…: record NAME = the mean of these recorded metrics (e.g. avg7=piqa_acc,…),\n"
                     "after this call's tasks (repeatable)");
      app.add_flag("--no-record", a->no_record, "Print the results without recording them");
      app.add_option("-f,--format", a->format, "text | json");
      app.footer(
          "Scores the run's newest intact checkpoint with its own tokenizer. Results are recorded as scalars\n"
          "of the run's summary (NAME_acc, NAME_acc_norm, NAME_ppl, ppl@L, sniah_acc@L, prefill_ms, …; shown by\n"
          "`lar show`, read by paper-table columns of the same name), with each file's SHA-256 under\n"
          "summary.eval_files, and as a metrics line at the checkpoint step. See docs/eval.md.\n"
          "Example: lar eval ccq-table2/gla.ccq.s0 --task data/tasks/hellaswag.jsonl --task wikitext=wiki.txt");
      return [a] { return run_eval(*a); };
    }};
