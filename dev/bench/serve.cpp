// `lar-bench serve`: the dashboard's performance goal — every page and API response in
// under 100 ms for a registry of 10,000 runs and 1,000,000 metric rows. Builds such a
// registry (run directories + `sync`), starts the server on a free loopback port and
// times each endpoint with a real HTTP client (median and worst of N requests).
#include <fcntl.h>
#include <sys/resource.h>
#include <fmt/format.h>
#include <httplib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <thread>

#include "core/config_schema.hpp"
#include "core/error.hpp"
#include "core/hash.hpp"
#include "core/run_dir.hpp"
#include "dev/bench/bench.hpp"
#include "registry/registry.hpp"
#include "registry/text_table.hpp"
#include "serve/server.hpp"

namespace lar::serve {

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// CPU seconds of this process (server threads + the client): printed beside wall time
// because this machine's cores are shared, and wall time then measures the neighbours.
double cpu_seconds() {
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

// Plain writes: generating the input is not what is measured.
void put_file(const fs::path& p, const std::string& text) {
  int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  bool ok = fd >= 0 && ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  if (fd >= 0) ::close(fd);
  if (!ok) throw RuntimeError("cannot write " + p.string());
}

// A run directory as the trainer leaves it: config, status, `lines` train lines of six
// metrics each (loss, lr, grad_norm, tokens_per_s, iter_time, peak_mem_mb).
void write_run(const fs::path& runs, const std::string& exp, const std::string& cell, const json& axes, const json& config,
               long lines, RunState state, double final_loss) {
  const fs::path d = runs / exp / cell;
  fs::create_directories(d);
  put_file(d / "config.json", json{{"experiment", exp}, {"cell_id", cell}, {"hash", sha256_hex(canonical_dump(config))}, {"axes", axes},
                                   {"role", "main"}, {"baseline", nullptr}, {"config", config}}
                                  .dump(2));
  RunStatus st;
  st.attempt = 1;
  st.total_steps = std::max(lines, 1L);
  st.step = state == RunState::completed ? st.total_steps : st.total_steps / 2;
  if (state == RunState::completed) st.summary = {{"final_loss", final_loss}, {"tokens_per_s", 12345.0}};
  st.state = state;
  st.updated_at = unix_now();
  st.history.push_back({RunState::running, st.updated_at, 0, "", 1});
  if (state != RunState::running) st.history.push_back({state, st.updated_at, st.step, "", 1});
  put_file(d / "status.json", st.to_json().dump(2));
  std::string buf;
  buf.reserve(static_cast<size_t>(lines) * 170);
  for (long s = 0; s < lines; ++s)
    buf += fmt::format(
        "{{\"step\":{},\"tokens\":{},\"wall_time\":{:.3f},\"loss\":{:.6f},\"lr\":{:.6g},\"grad_norm\":{:.5f},"
        "\"tokens_per_s\":{:.1f},\"iter_time\":{:.5f},\"peak_mem_mb\":{:.1f}}}\n",
        s, s * 8192, 0.05 * static_cast<double>(s), 10.0 / (1.0 + 0.001 * static_cast<double>(s)),
        3e-4 * std::min(1.0, static_cast<double>(s + 1) / 100.0), 1.0 + 0.1 * static_cast<double>(s % 7),
        163840.0 + static_cast<double>(s % 13), 0.05, 1024.0);
  put_file(d / "metrics.jsonl", buf);
}

struct Endpoint {
  std::string what;
  std::string path;
};

struct ServeBenchOptions {
  int runs = 10000;
  long rows = 1000000;  // metric rows in all (4 long runs hold about a quarter of them)
  int repeats = 15;     // requests per endpoint
  std::string dir;      // work folder (default: a temp folder, removed afterwards)
  bool keep = false;
};

// Prints the table; returns 0 (1 when a response was not 200).
int run_serve_bench(const ServeBenchOptions& o) {
  if (o.runs < 8) throw UserError("--runs must be at least 8");
  const fs::path home = o.dir.empty() ? fs::temp_directory_path() / fmt::format("lar_bench_serve_{}", ::getpid()) : fs::path(o.dir);
  fs::remove_all(home);
  fs::create_directories(home);
  // Four long runs (the charts' worst case) hold a quarter of the rows; the rest share
  // the remainder evenly.
  const int metrics_per_line = 6, long_runs = 4;
  const long long_lines = std::max(1L, o.rows / 4 / (long_runs * metrics_per_line));
  const long rest_div = static_cast<long>(o.runs - long_runs) * metrics_per_line;
  const long short_lines = std::max(1L, (o.rows - long_lines * long_runs * metrics_per_line + rest_div - 1) / rest_div);
  const std::vector<std::string> archs = {"gdn", "deltanet", "mamba2", "softmax", "gla"};
  const std::vector<double> lrs = {1e-3, 3e-4, 1e-4, 3e-3};
  auto t0 = Clock::now();
  std::vector<std::string> long_ids;
  for (int i = 0; i < o.runs; ++i) {
    const std::string& arch = archs[static_cast<size_t>(i) % archs.size()];
    const double lr = lrs[static_cast<size_t>(i / 5) % lrs.size()];
    const json config = with_defaults({{"model", {{"architecture", arch}}}, {"optimizer", {{"lr", lr}}}, {"seed", i}});
    const std::string exp = fmt::format("sweep{}", i % 4), cell = fmt::format("{}.lr{:g}.s{}", arch, lr, i);
    const RunState state = i % 10 == 0 ? RunState::running : RunState::completed;
    const bool is_long = i < long_runs;
    if (is_long) long_ids.push_back(exp + "/" + cell);
    write_run(home / "runs", exp, cell, {{"architecture", arch}, {"lr", lr}, {"seed", i}}, config, is_long ? long_lines : short_lines,
              state, 3.0 + 0.0001 * (i % 997));
  }
  const double gen = seconds_since(t0);
  long long rows = 0;
  double sync_s = 0;
  {
    auto reg = registry::Registry::open(home / "lar.db");
    t0 = Clock::now();
    auto st = reg.sync(home / "runs");
    sync_s = seconds_since(t0);
    rows = reg.metric_row_count();
    if (st.runs_seen != o.runs) throw RuntimeError(fmt::format("serve bench: synced {} of {} runs", st.runs_seen, o.runs));
  }
  std::cout << fmt::format("serve: {} runs, {} metric rows (4 runs of {} steps, the rest {} steps); written in {:.1f} s, synced in {:.1f} s\n",
                           o.runs, rows, long_lines, short_lines, gen, sync_s);

  Server server({.db = home / "lar.db", .host = "127.0.0.1", .port = 0});
  const int port = server.bind();
  std::thread th([&] { server.run(); });
  httplib::Client cli("127.0.0.1", port);
  cli.set_keep_alive(true);
  cli.set_tcp_nodelay(true);
  cli.set_read_timeout(30, 0);

  const std::string L0 = long_ids[0], L1 = long_ids[1], L2 = long_ids[2], L3 = long_ids[3];
  const std::vector<Endpoint> endpoints = {
      {"page: experiments", "/"},
      {"page: runs (first 50 of all)", "/runs"},
      {"page: runs, axis + status filter", "/runs?experiment=sweep1&axis.architecture=gdn&axis.lr=0.0003&status=completed"},
      {"page: runs, last page", fmt::format("/runs?offset={}", std::max(0, o.runs - 50))},
      {"page: runs sorted by final_loss", "/runs?sort=-final_loss"},
      {fmt::format("page: run detail ({} steps, 3 charts)", long_lines), "/runs/" + L0},
      {"page: compare 4 long runs", fmt::format("/compare?run={}&run={}&run={}&run={}", L0, L1, L2, L3)},
      {"page: paper table laa/table2", "/tables/laa/table2"},
      {"api: experiments", "/api/experiments"},
      {"api: runs limit=500", "/api/runs?limit=500"},
      {"api: runs filtered", "/api/runs?axis.architecture=gdn&status=running"},
      {"api: run detail", "/api/runs/" + L0},
      {"api: metrics (10,000 points max)", "/api/runs/" + L0 + "/metrics?name=loss&max_points=10000"},
      {"api: audit laa/table2", "/api/audit/laa/table2"},
      {"api: version (live-update poll)", "/api/version"},
  };
  registry::TextTable t;
  t.headers = {"request", "median", "worst", "cpu/request", "bytes", "goal (median)", "ok"};
  t.right_align = {false, true, true, true, true, true, false};
  int bad = 0;
  for (const auto& e : endpoints) {
    std::vector<double> ms;
    size_t bytes = 0;
    double cpu0 = 0;
    for (int r = 0; r < std::max(o.repeats, 1) + 1; ++r) {
      if (r == 1) cpu0 = cpu_seconds();
      auto t1 = Clock::now();
      auto res = cli.Get(e.path.c_str());
      const double dt = seconds_since(t1) * 1000;
      if (!res || res->status != 200) {
        std::cerr << "serve bench: GET " << e.path << " -> " << (res ? std::to_string(res->status) : "no response") << "\n";
        ++bad;
        break;
      }
      bytes = res->body.size();
      if (r > 0) ms.push_back(dt);  // the first request warms the page cache
    }
    if (ms.empty()) continue;
    const double cpu_ms = (cpu_seconds() - cpu0) * 1000 / static_cast<double>(ms.size());
    std::sort(ms.begin(), ms.end());
    const double med = ms[ms.size() / 2];
    t.rows.push_back({e.what, fmt::format("{:.1f} ms", med), fmt::format("{:.1f} ms", ms.back()), fmt::format("{:.1f} ms", cpu_ms),
                      std::to_string(bytes), "100 ms", med <= 100 ? "yes" : "NO"});
  }
  server.stop();
  th.join();
  std::cout << t.to_table();
  if (!o.keep) fs::remove_all(home);
  return bad ? 1 : 0;
}

}  // namespace

}  // namespace lar::serve

static lar::bench::Registration serve_reg{
    "serve", "Dashboard: pages and API over 10,000 runs / 1,000,000 metric rows (goal < 100 ms)",
    [](CLI::App& app) -> lar::bench::Runner {
      auto o = std::make_shared<lar::serve::ServeBenchOptions>();
      app.add_option("--runs", o->runs, "Runs in the registry");
      app.add_option("--rows", o->rows, "Metric rows in all");
      app.add_option("--repeats", o->repeats, "Requests per endpoint (median and worst reported)");
      app.add_option("--dir", o->dir, "Work folder (default: a temp folder, removed afterwards)");
      app.add_flag("--keep", o->keep, "Keep the work folder");
      return [o] { return lar::serve::run_serve_bench(*o); };
    }};
