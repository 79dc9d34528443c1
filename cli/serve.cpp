// `lar serve` — a local read-only web dashboard over the registry (pages + JSON API). Logic
// lives in serve/; its response-time benchmark is `lar-bench serve` (dev/bench/serve.cpp).
#include <iostream>
#include <memory>

#include "cli/command.hpp"
#include "core/paths.hpp"
#include "serve/server.hpp"

namespace {

struct ServeArgs {
  std::string db;
  std::string host = "127.0.0.1";
  int port = 8765;
  bool allow_remote = false;
  int threads = 8;
};

int run_serve(const ServeArgs& a) {
  using namespace lar;
  serve::ServeOptions o;
  o.db = a.db.empty() ? default_db_path() : std::filesystem::path(a.db);
  o.host = a.host;
  o.port = a.port;
  o.allow_remote = a.allow_remote;
  o.threads = a.threads;
  serve::Server server(o);
  server.bind();
  if (!serve::is_loopback(a.host))
    std::cerr << "lar serve: WARNING: listening on " << a.host
              << ", reachable from other machines; the dashboard has no authentication and shows every run\n";
  // Tests and scripts read the URL from this line.
  std::cout << "lar serve: " << server.url() << " (read-only view of " << o.db.string() << "; Ctrl-C stops)" << std::endl;
  server.run();
  return 0;
}

}  // namespace

static lar::cli::CommandRegistration reg{
    "serve", "Local read-only web dashboard over the registry (pages + JSON API)", 65,
    [](CLI::App& app) -> lar::cli::Runner {
      auto a = std::make_shared<ServeArgs>();
      app.add_option("--db", a->db, "Registry database (default: $LAR_DB or $LAR_HOME/lar.db)");
      app.add_option("--port", a->port, "TCP port; 0 picks a free one (the URL is printed)")->check(CLI::Range(0, 65535));
      app.add_option("--host", a->host, "Address to bind (default 127.0.0.1, loopback only)");
      app.add_flag("--allow-remote", a->allow_remote, "Allow binding a non-loopback address (no authentication!)");
      app.add_option("--threads", a->threads, "Request workers")->check(CLI::Range(1, 64));
      app.footer("Opens the registry read-only; run `lar sync` (or lar launch/reproduce) to ingest new results,\n"
                 "open pages follow them. See docs/serve.md.");
      return [a] { return run_serve(*a); };
    }};
