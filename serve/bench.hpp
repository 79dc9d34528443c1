#pragma once
// `lar bench serve`: the dashboard's performance goal — every page and API response in
// under 100 ms for a registry of 10,000 runs and 1,000,000 metric rows. Builds such a
// registry (run directories + `sync`), starts the server on a free loopback port and
// times each endpoint with a real HTTP client (median and worst of N requests).
#include <string>

namespace lar::serve {

struct ServeBenchOptions {
  int runs = 10000;
  long rows = 1000000;   // metric rows in all (4 long runs hold about a quarter of them)
  int repeats = 15;      // requests per endpoint
  std::string dir;       // work folder (default: a temp folder, removed afterwards)
  bool keep = false;
};

// Prints the table; returns 0 (1 when a response was not 200).
int run_serve_bench(const ServeBenchOptions& o);

}  // namespace lar::serve
