// `lar serve-model RUN` — an OpenAI-compatible /v1/completions endpoint over a trained
// run (for lm-evaluation-harness's local-completions model and similar clients). Logic
// lives in eval/completions.cpp; docs/eval.md.
#include <iostream>

#include "cli/command.hpp"
#include "core/error.hpp"
#include "core/paths.hpp"
#include "eval/completions.hpp"
#include "registry/registry.hpp"

namespace {

namespace fs = std::filesystem;

struct ServeModelArgs {
  std::string run, db, backend;
  lar::eval::CompletionsOptions o;
  int threads = -1;
  bool disable_ccq = false;
};

int run_serve_model(ServeModelArgs& a) {
  using namespace lar;
  const fs::path db = a.db.empty() ? default_db_path() : fs::path(a.db);
  fs::path dir = a.run;
  std::error_code ec;
  if (!fs::exists(dir / "config.json", ec)) {
    if (!fs::exists(db, ec))
      throw UserError("'" + a.run + "' is neither a run directory nor a run of a registry (no registry at " + db.string() + ")");
    auto reg = registry::Registry::open(db, true);
    dir = reg.require_run(a.run).run_dir;
  }
  if (a.o.batch < 1) throw UserError("--batch: must be ≥ 1");
  eval::OpenOptions oo;
  oo.backend = a.backend;
  oo.threads = a.threads;
  oo.disable_ccq = a.disable_ccq;
  auto run = eval::LoadedRun::open(dir, oo);
  (void)run->tokenizer();  // a missing data folder is an error now, not at the first request
  if (a.o.model_name.empty()) a.o.model_name = a.run;
  eval::CompletionsServer server(*run, a.o);
  server.bind();
  // Tests and scripts read the URL from this line.
  std::cout << "lar serve-model: " << server.url() << " (model " << a.o.model_name << ", checkpoint step "
            << run->checkpoint_step() << "; Ctrl-C stops)" << std::endl;
  server.run();
  return 0;
}

}  // namespace

static lar::cli::CommandRegistration reg{
    "serve-model", "OpenAI-compatible /v1/completions over a trained run (scoring server)", 66,
    [](CLI::App& app) -> lar::cli::Runner {
      auto a = std::make_shared<ServeModelArgs>();
      app.add_option("run", a->run, "Run id or run directory")->required();
      app.add_option("--db", a->db, "Registry database (default: $LAR_DB or $LAR_HOME/lar.db)");
      app.add_option("--port", a->o.port, "TCP port (default 8000); 0 picks a free one (the URL is printed)")
          ->check(CLI::Range(0, 65535));
      app.add_option("--host", a->o.host, "Address to bind (default 127.0.0.1, loopback only)");
      app.add_flag("--allow-remote", a->o.allow_remote, "Allow a non-loopback --host (no authentication!)");
      app.add_option("--batch", a->o.batch, "Prompts per forward pass (default 8)");
      app.add_option("--max-length", a->o.max_len, "Model input length (default: the run's data.seq_len)");
      app.add_option("--model-name", a->o.model_name, "The \"model\" of replies (default: RUN as given)");
      app.add_option("--backend", a->backend, "cpu | cuda | auto (default: the run's)");
      app.add_option("--threads", a->threads, "CPU threads (default: the run's `threads`)");
      app.add_flag("--disable-ccq", a->disable_ccq, "CCQ off at inference");
      app.footer(
          "POST /v1/completions with prompt (string, strings or token lists), max_tokens (greedy), echo,\n"
          "logprobs (0 or 1), stop; GET /v1/models. lm-eval: --model local-completions --model_args\n"
          "base_url=http://127.0.0.1:8000/v1/completions,tokenized_requests=False. See docs/eval.md.");
      return [a] { return run_serve_model(*a); };
    }};
