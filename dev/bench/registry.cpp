// `lar-bench ingest` and `lar-bench runs` — the registry's two performance goals:
// ingest 1,000,000 metric rows in under 5 s; `lar runs` over 10,000 runs in under 200 ms
// (the `lar` binary timed as a child process: by default the one beside lar-bench).
#include <fmt/format.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fcntl.h>
#include <iostream>

#include "dev/bench/bench.hpp"
#include "core/config_schema.hpp"
#include "core/error.hpp"
#include "core/hash.hpp"
#include "core/run_dir.hpp"
#include "registry/registry.hpp"
#include "registry/text_table.hpp"

namespace {

namespace fs = std::filesystem;
using lar::json;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

fs::path bench_dir(const std::string& given, const char* name) {
  fs::path d = given.empty() ? fs::temp_directory_path() / fmt::format("lar_bench_{}_{}", name, ::getpid()) : fs::path(given);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// Wall time is the goal; CPU time is printed beside it because this machine's cores
// are often shared, and wall time then measures the neighbours too.
double cpu_seconds_self() {
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

void print_results(const std::vector<std::vector<std::string>>& rows) {
  lar::registry::TextTable t;
  t.headers = {"measure", "wall", "cpu", "goal (wall)", "ok"};
  t.right_align = {false, true, true, true, false};
  t.rows = rows;
  std::cout << t.to_table();
}

std::string verdict(double measured, double goal) { return measured <= goal ? "yes" : "NO"; }

// Plain writes: generating the input is not what is measured (RunDir's atomic writes
// fsync every file, which makes writing 10,000 run directories take minutes).
void put_file(const fs::path& p, const std::string& text) {
  int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0 || ::write(fd, text.data(), text.size()) != static_cast<ssize_t>(text.size()))
    throw lar::RuntimeError("cannot write " + p.string());
  ::close(fd);
}

// A run directory as the trainer leaves it: config, status, `lines` train lines.
void write_run(const fs::path& root, const std::string& exp, const std::string& cell, const json& axes,
               const json& config, long lines, double final_loss, lar::RunState state) {
  lar::RunDir rd(root / exp / cell);
  fs::create_directories(rd.root());
  put_file(rd.config_path(), json{{"experiment", exp}, {"cell_id", cell}, {"hash", lar::sha256_hex(lar::canonical_dump(config))},
                                  {"axes", axes}, {"role", "main"}, {"baseline", nullptr}, {"config", config}}.dump(2));
  lar::RunStatus st;
  st.attempt = 1;
  st.total_steps = std::max(lines, 1L);
  st.step = state == lar::RunState::completed ? st.total_steps : st.total_steps / 2;
  if (state == lar::RunState::completed) st.summary = {{"final_loss", final_loss}, {"tokens_per_s", 12345.0}};
  st.state = state;
  st.updated_at = lar::unix_now();
  st.history.push_back({lar::RunState::running, st.updated_at, 0, "", 1});
  if (state != lar::RunState::running) st.history.push_back({state, st.updated_at, st.step, "", 1});
  put_file(rd.status_path(), st.to_json().dump(2));
  if (lines == 0) return;
  std::string buf;
  buf.reserve(static_cast<size_t>(lines) * 170);
  for (long s = 0; s < lines; ++s)
    buf += fmt::format(
        "{{\"step\":{},\"tokens\":{},\"wall_time\":{:.3f},\"loss\":{:.6f},\"lr\":{:.6g},\"grad_norm\":{:.5f},"
        "\"tokens_per_s\":{:.1f},\"iter_time\":{:.5f},\"peak_mem_mb\":{:.1f}}}\n",
        s, s * 8192, 0.05 * static_cast<double>(s), 10.0 / (1.0 + 0.001 * static_cast<double>(s)), 3e-4,
        1.0 + 0.1 * static_cast<double>(s % 7), 163840.0 + static_cast<double>(s % 13), 0.05, 1024.0);
  put_file(rd.metrics_path(), buf);
}

struct IngestOptions {
  long rows = 1000000;
  int runs = 10;
  std::string dir;
  bool keep = false;
};

int bench_ingest(const IngestOptions& o) {
  const int metrics_per_line = 6;
  const long lines_per_run = (o.rows + static_cast<long>(o.runs) * metrics_per_line - 1) / (o.runs * metrics_per_line);
  fs::path home = bench_dir(o.dir, "ingest");
  auto t0 = Clock::now();
  for (int i = 0; i < o.runs; ++i)
    write_run(home / "runs", "bench", fmt::format("cell{:03d}", i), {{"seed", i}}, {{"seed", i}}, lines_per_run, 2.0,
              lar::RunState::running);
  double gen = seconds_since(t0);

  auto reg = lar::registry::Registry::open(home / "lar.db");
  t0 = Clock::now();
  double c0 = cpu_seconds_self();
  auto st = reg.sync(home / "runs");
  double ingest = seconds_since(t0), ingest_cpu = cpu_seconds_self() - c0;
  t0 = Clock::now();
  auto again = reg.sync(home / "runs");
  double resync = seconds_since(t0);
  long long stored = reg.metric_row_count();
  if (stored != st.metric_rows || again.metric_rows != 0)
    throw lar::RuntimeError(fmt::format("ingest bench: stored {} rows, sync reported {}, re-sync added {}", stored,
                                        st.metric_rows, again.metric_rows));
  std::cout << fmt::format("ingest: {} runs x {} lines x {} metrics = {} rows ({:.1f} MB of JSONL, written in {:.2f} s)\n",
                           o.runs, lines_per_run, metrics_per_line, st.metric_rows,
                           static_cast<double>(lines_per_run * o.runs * 170) / 1e6, gen);
  print_results({{fmt::format("lar sync: {} metric rows", st.metric_rows), fmt::format("{:.2f} s", ingest),
                  fmt::format("{:.2f} s", ingest_cpu), "5 s", verdict(ingest, 5.0)},
                 {"  = rows per second (wall)", fmt::format("{:.0f}", static_cast<double>(st.metric_rows) / ingest), "-",
                  "200000", verdict(200000.0, static_cast<double>(st.metric_rows) / ingest)},
                 {"lar sync again, nothing new", fmt::format("{:.3f} s", resync), "-", "-", "-"}});
  if (!o.keep) fs::remove_all(home);
  return 0;
}

struct RunsOptions {
  int runs = 10000;
  int repeats = 5;
  std::string dir;
  bool keep = false;
  std::string lar;  // the `lar` binary to time; empty = the one beside this program
};

struct Timing {
  double wall = 0, cpu = 0;
};

// The `lar` binary `lar-bench runs` times: --lar, else `lar` in this program's folder.
std::string lar_binary(const std::string& given) {
  const fs::path bin = given.empty() ? fs::read_symlink("/proc/self/exe").parent_path() / "lar" : fs::path(given);
  if (::access(bin.c_str(), X_OK) != 0)
    throw lar::UserError("bench runs: " + bin.string() + ": not an executable `lar` (--lar PATH names one)");
  return bin.string();
}

// Runs `lar ARGS` with stdout to /dev/null.
Timing time_command(const std::string& lar, const std::vector<std::string>& args) {
  std::vector<char*> argv;
  std::string self = lar;
  argv.push_back(self.data());
  std::vector<std::string> copy = args;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  auto t0 = Clock::now();
  pid_t pid = ::fork();
  if (pid == 0) {
    int devnull = ::open("/dev/null", O_WRONLY);
    ::dup2(devnull, STDOUT_FILENO);
    ::execv(self.c_str(), argv.data());
    ::_exit(127);
  }
  int status = 0;
  rusage ru{};
  ::wait4(pid, &status, 0, &ru);
  Timing t;
  t.wall = seconds_since(t0);
  t.cpu = static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
          1e-6 * static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw lar::RuntimeError("benchmark command failed: lar " + args[0]);
  return t;
}

// Median by wall time.
Timing median(std::vector<Timing> v) {
  std::sort(v.begin(), v.end(), [](const Timing& a, const Timing& b) { return a.wall < b.wall; });
  return v[v.size() / 2];
}

int bench_runs(const RunsOptions& o) {
  const std::string lar = lar_binary(o.lar);
  fs::path home = bench_dir(o.dir, "runs");
  const std::vector<std::string> archs = {"gdn", "deltanet", "mamba2", "softmax", "gla"};
  const std::vector<double> lrs = {1e-3, 3e-4, 1e-4, 3e-3};
  auto t0 = Clock::now();
  for (int i = 0; i < o.runs; ++i) {
    const std::string& arch = archs[static_cast<size_t>(i) % archs.size()];
    double lr = lrs[static_cast<size_t>(i / 5) % lrs.size()];
    json partial = {{"model", {{"architecture", arch}}}, {"optimizer", {{"lr", lr}}}, {"seed", i}};
    json config = lar::with_defaults(partial);
    lar::RunState state = i % 10 == 0 ? lar::RunState::running : lar::RunState::completed;
    write_run(home / "runs", fmt::format("sweep{}", i % 4), fmt::format("{}.lr{:g}.s{}", arch, lr, i), 
              {{"architecture", arch}, {"lr", lr}, {"seed", i}}, config, 0, 3.0 + 0.0001 * (i % 997), state);
  }
  double gen = seconds_since(t0);
  double first_sync, resync;
  {
    auto reg = lar::registry::Registry::open(home / "lar.db");
    t0 = Clock::now();
    auto st = reg.sync(home / "runs");
    first_sync = seconds_since(t0);
    t0 = Clock::now();
    reg.sync(home / "runs");
    resync = seconds_since(t0);
    if (st.runs_seen != o.runs) throw lar::RuntimeError(fmt::format("runs bench: synced {} of {} runs", st.runs_seen, o.runs));
  }
  std::string db = (home / "lar.db").string();
  std::vector<Timing> all, filtered, sorted, json_all;
  for (int r = 0; r < o.repeats; ++r) {
    all.push_back(time_command(lar, {"runs", "--db", db}));
    filtered.push_back(time_command(lar, {"runs", "--db", db, "--where", "architecture=gdn", "--where", "lr=3e-4", "--status", "completed"}));
    sorted.push_back(time_command(lar, {"runs", "--db", db, "--sort=-final_loss", "--limit", "20"}));
    json_all.push_back(time_command(lar, {"runs", "--db", db, "--format", "json"}));
  }
  std::cout << fmt::format("runs: {} run directories (written in {:.1f} s); median of {} runs of each command\n", o.runs,
                           gen, o.repeats);
  auto ms = [](double s) { return fmt::format("{:.0f} ms", s * 1000); };
  auto row = [&](const std::string& what, const std::vector<Timing>& t, bool goal) {
    Timing m = median(t);
    return std::vector<std::string>{what, ms(m.wall), ms(m.cpu), goal ? "200 ms" : "-", goal ? verdict(m.wall, 0.2) : "-"};
  };
  print_results({row(fmt::format("lar runs (table, all {})", o.runs), all, true),
                 row("lar runs --where architecture=gdn --where lr=3e-4 --status completed", filtered, true),
                 row("lar runs --sort=-final_loss --limit 20", sorted, true),
                 row("lar runs --format json (full configs)", json_all, false),
                 {fmt::format("lar sync: first sync of {} runs", o.runs), fmt::format("{:.2f} s", first_sync), "-", "-", "-"},
                 {"lar sync again, nothing new", fmt::format("{:.3f} s", resync), "-", "-", "-"}});
  if (!o.keep) fs::remove_all(home);
  return 0;
}

}  // namespace

static lar::bench::Registration ingest_reg{
    "ingest", "Registry: ingest 1,000,000 metric rows (goal < 5 s)", [](CLI::App& app) -> lar::bench::Runner {
      auto o = std::make_shared<IngestOptions>();
      app.add_option("--rows", o->rows, "Metric rows to ingest");
      app.add_option("--runs", o->runs, "Spread over this many run directories");
      app.add_option("--dir", o->dir, "Work folder (default: a temp folder, removed afterwards)");
      app.add_flag("--keep", o->keep, "Keep the work folder");
      return [o] { return bench_ingest(*o); };
    }};

static lar::bench::Registration runs_reg{
    "runs", "Registry: `lar runs` over 10,000 runs (goal < 200 ms)", [](CLI::App& app) -> lar::bench::Runner {
      auto o = std::make_shared<RunsOptions>();
      app.add_option("--runs", o->runs, "Runs in the registry");
      app.add_option("--repeats", o->repeats, "Timed repetitions of each command (median reported)");
      app.add_option("--dir", o->dir, "Work folder (default: a temp folder, removed afterwards)");
      app.add_flag("--keep", o->keep, "Keep the work folder");
      app.add_option("--lar", o->lar, "The `lar` binary to time (default: the one beside lar-bench)");
      return [o] { return bench_runs(*o); };
    }};
