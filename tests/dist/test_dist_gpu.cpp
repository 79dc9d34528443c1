// Data-parallel training on 2 GPUs through the real `lar train --nproc 2` (label gpu; needs
// 2 GPUs and NCCL): bit-identity with 1 GPU × 2 micro-batches in deterministic mode, the
// same losses as 1 GPU on the whole batch within bf16 tolerance, preemption by signal, and
// a killed rank ending the launch within 60 s with the failure recorded; ZeRO-1's NCCL
// communicator (dist/nccl_communicator.hpp) on device and host buffers, and ZeroOptimizer and
// DeviceZeroOptimizer over it against the unsharded optimisers (2 ranks: a + b is the same
// float in either order).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "core/fs.hpp"
#include "core/json.hpp"
#include "core/run_dir.hpp"
#include "dist/nccl_data_parallel.hpp"
#include "trainer/optim/device_optimizer.hpp"
#include "trainer/optim/device_zero.hpp"
#include "trainer/optim/zero.hpp"

using namespace lar;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

fs::path temp(const std::string& tag) {
  fs::path p = fs::temp_directory_path() / ("lar_dist_gpu_" + std::to_string(::getpid()) + "_" + tag);
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

json run_config(json overrides = json::object()) {
  json c = {{"seed", 11},
            {"backend", "cuda"},
            {"deterministic", true},
            {"model", {{"n_layers", 2}, {"d_model", 128}, {"n_heads", 2}, {"n_kv_heads", 2}, {"vocab_size", 512}}},
            {"data", {{"task", "mqar"}, {"seq_len", 256}, {"batch_size", 8}, {"num_kv_pairs", 16}}},
            {"optimizer", {{"lr", 3e-3}}},
            {"schedule", {{"warmup_steps", 2}}},
            {"budget", {{"steps", 8}}},
            {"eval", {{"every", 4}, {"batches", 2}}},
            {"log", {{"every", 1}}},
            {"checkpoint", {{"every", 0}, {"keep", 2}}}};
  c.merge_patch(overrides);
  return c;
}

fs::path write_config(const fs::path& dir, const json& cfg) {
  fs::path f = dir / "run.json";
  std::ofstream(f) << cfg.dump();
  return f;
}

pid_t spawn(const std::vector<std::string>& args) {
  pid_t pid = ::fork();
  if (pid == 0) {
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  return pid;
}

int wait_rc(pid_t pid) {
  int st = 0;
  ::waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

int lar_train(const fs::path& cfg, const fs::path& run, int nproc, std::vector<std::string> extra = {}) {
  std::vector<std::string> a = {LAR_BINARY, "train", "--config", cfg.string(), "--run-dir", run.string(),
                                "--no-progress", "--nproc", std::to_string(nproc)};
  a.insert(a.end(), extra.begin(), extra.end());
  return wait_rc(spawn(a));
}

std::vector<json> metrics(const fs::path& run) { return read_metrics(RunDir(run).metrics_path()).lines; }

std::vector<std::string> values(const fs::path& run) {
  std::vector<std::string> out;
  for (auto l : metrics(run)) {
    for (const char* k : {"wall_time", "tokens_per_s", "iter_time", "peak_mem_mb", "gpu_peak_mem_mb"}) l.erase(k);
    out.push_back(l.dump());
  }
  return out;
}

// The children of `parent` whose environment says LAR_RANK=<rank>.
pid_t rank_pid(pid_t parent, int rank) {
  for (auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(e.path() / "stat");
    std::string line;
    std::getline(stat, line);
    auto close = line.rfind(')');
    if (close == std::string::npos) continue;
    int ppid = 0;
    char state;
    if (std::sscanf(line.c_str() + close + 2, "%c %d", &state, &ppid) != 2 || ppid != parent) continue;
    std::ifstream env(e.path() / "environ", std::ios::binary);
    std::string s((std::istreambuf_iterator<char>(env)), {});
    if (s.find("LAR_RANK=" + std::to_string(rank) + '\0') != std::string::npos) return std::stoi(name);
  }
  return -1;
}

class DistGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (dist::visible_gpus() < 2) GTEST_SKIP() << "needs 2 GPUs";
    ::setenv("NCCL_NVLS_ENABLE", "0", 1);
  }
};

}  // namespace

TEST_F(DistGpu, TwoGpusGiveTheBitsOfOneGpuWithTwoMicroBatches) {
  fs::path d = temp("bits");
  ASSERT_EQ(lar_train(write_config(d, run_config({{"data", {{"micro_batches", 2}}}})), d / "one", 1), 0);
  ASSERT_EQ(lar_train(write_config(d, run_config()), d / "two", 2), 0);
  auto a = values(d / "one"), b = values(d / "two");
  ASSERT_GE(a.size(), 10u);  // 8 train lines and the evaluations
  EXPECT_EQ(a, b);
  auto st = RunDir(d / "two").read_status();
  EXPECT_EQ(st->state, RunState::completed);
  EXPECT_EQ(st->summary.at("world_size"), 2);
  fs::remove_all(d);
}

TEST_F(DistGpu, TwoGpusTrackOneGpuOnTheWholeBatch) {
  fs::path d = temp("tol");
  json fast = run_config({{"deterministic", false}, {"budget", {{"steps", 20}}}});
  ASSERT_EQ(lar_train(write_config(d, fast), d / "one", 1), 0);
  ASSERT_EQ(lar_train(write_config(d, fast), d / "two", 2), 0);
  auto a = metrics(d / "one"), b = metrics(d / "two");
  ASSERT_EQ(a.size(), b.size());
  int compared = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    for (const char* k : {"loss", "val_loss"}) {
      if (!a[i].contains(k)) continue;
      const double x = a[i][k], y = b[i][k];
      EXPECT_NEAR(x, y, 2e-2 * std::fabs(x)) << k << " at step " << a[i]["step"];
      ++compared;
    }
  }
  EXPECT_GE(compared, 20);
  fs::remove_all(d);
}

TEST_F(DistGpu, PreemptionReachesEveryRankAndResumes) {
  fs::path d = temp("preempt");
  fs::path cfg = write_config(d, run_config({{"budget", {{"steps", 5000}}}}));
  pid_t pid = spawn({LAR_BINARY, "train", "--config", cfg.string(), "--run-dir", (d / "r").string(), "--no-progress",
                     "--nproc", "2"});
  const auto t0 = Clock::now();
  while (metrics(d / "r").size() < 3 && Clock::now() - t0 < std::chrono::seconds(60))
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ::kill(pid, SIGUSR2);
  EXPECT_EQ(wait_rc(pid), 3);
  auto st = RunDir(d / "r").read_status();
  ASSERT_TRUE(st);
  EXPECT_EQ(st->state, RunState::preempted);
  EXPECT_NE(st->reason.find("SIGUSR2"), std::string::npos) << st->reason;
  EXPECT_TRUE(fs::exists(d / "r" / "checkpoints" / ("step_" + [&] {
                            char b[16];
                            std::snprintf(b, sizeof b, "%08ld", st->step);
                            return std::string(b);
                          }() + ".ckpt")));
  // Resume on 2 ranks for a few steps more.
  EXPECT_EQ(lar_train(cfg, d / "r", 2, {"--stop-after", "3"}), 3);
  EXPECT_EQ(RunDir(d / "r").read_status()->step, st->step + 3);
  fs::remove_all(d);
}

TEST_F(DistGpu, AKilledRankEndsTheLaunchWithinAMinute) {
  fs::path d = temp("kill");
  fs::path cfg = write_config(d, run_config({{"budget", {{"steps", 100000}}}}));
  pid_t pid = spawn({LAR_BINARY, "train", "--config", cfg.string(), "--run-dir", (d / "r").string(), "--no-progress",
                     "--nproc", "2"});
  const auto t0 = Clock::now();
  while (metrics(d / "r").size() < 3 && Clock::now() - t0 < std::chrono::seconds(60))
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  pid_t victim = rank_pid(pid, 1);
  ASSERT_GT(victim, 0);
  ::kill(victim, SIGKILL);
  const auto killed = Clock::now();
  const int rc = wait_rc(pid);
  const double s = std::chrono::duration<double>(Clock::now() - killed).count();
  std::printf("launch ended %.1f s after rank 1 was killed\n", s);
  EXPECT_EQ(rc, 1);
  EXPECT_LT(s, 60.0);
  auto st = RunDir(d / "r").read_status();
  ASSERT_TRUE(st);
  EXPECT_EQ(st->state, RunState::failed);
  EXPECT_EQ(st->reason.rfind("rank 1 was killed by SIGKILL (signal 9)", 0), 0u) << st->reason;
  std::printf("recorded: %s\n", st->reason.c_str());
  fs::remove_all(d);
}

// ---- ZeRO-1 over NCCL: two processes (this binary re-executed as rank 0 and 1) --------

namespace {

std::vector<optim::ParamView> zero_table(std::size_t* total) {
  std::vector<optim::ParamView> t;
  std::size_t off = 0;
  auto add = [&](const char* name, int rows, int cols, optim::ParamKind kind) {
    optim::ParamView v;
    v.name = name, v.offset = off, v.rows = rows, v.cols = cols, v.kind = kind;
    off += v.size();
    t.push_back(v);
  };
  add("embed", 1201, 97, optim::ParamKind::embedding);
  add("norm", 1, 97, optim::ParamKind::norm);
  add("q", 97, 97, optim::ParamKind::matrix_hidden);
  add("up", 97, 61, optim::ParamKind::matrix_hidden);
  add("down", 61, 97, optim::ParamKind::matrix_hidden);
  add("head", 353, 97, optim::ParamKind::head);
  *total = off;
  return t;
}

std::vector<float> zero_grads(std::size_t n, int rank, int step) {
  std::vector<float> g(n);
  for (std::size_t i = 0; i < n; ++i)
    g[i] = static_cast<float>(std::sin(0.37 * double(i) + 1.3 * rank + 0.7 * step)) * (step % 2 ? 1e-4f : 5e-3f);
  return g;
}

// One rank's checks; returns "" or what failed.
std::string zero_worker(int rank, const fs::path& dir) {
  auto be = dist::make_rank_backend(rank);
  dist::NcclOptions o;
  o.rank = rank, o.world = 2, o.id_file = dir / "nccl-id", o.deterministic = true;
  dist::NcclDataParallel dp(*be, o);
  optim::Communicator* comm = dp.communicator();
  // Collectives on device buffers: integers in floats, so every sum is exact.
  const std::size_t n = 1000;
  const std::vector<optim::Segment> segs = {{0, 300, 1}, {300, 450, 0}, {750, 250, 1}};
  std::vector<float> h(n);
  for (std::size_t i = 0; i < n; ++i) h[i] = static_cast<float>(i * (rank + 1));
  kernels::Tensor t(be->alloc_bytes(n * sizeof(float)), kernels::DType::f32, {static_cast<int64_t>(n)});
  be->upload(h.data(), t);
  comm->reduce_scatter(t.ptr<float>(), segs);
  std::vector<float> back(n);
  be->download(t, back.data());
  for (const optim::Segment& s : segs)
    if (s.owner == rank)
      for (std::size_t i = s.offset; i < s.offset + s.count; ++i)
        if (back[i] != static_cast<float>(3 * i)) return "reduce_scatter: element " + std::to_string(i);
  for (std::size_t i = 0; i < n; ++i) back[i] = static_cast<float>(i + 7 * rank);
  be->upload(back.data(), t);
  comm->all_gather(t.ptr<float>(), segs);
  be->download(t, back.data());
  for (const optim::Segment& s : segs)
    for (std::size_t i = s.offset; i < s.offset + s.count; ++i)
      if (back[i] != static_cast<float>(i + 7 * s.owner)) return "all_gather: element " + std::to_string(i);
  std::vector<double> d = {1.0 + rank, 0.5};
  comm->all_reduce(d.data(), d.size());  // a host buffer, staged
  if (d[0] != 3.0 || d[1] != 1.0) return "all_reduce(double) on the host";
  be->free_bytes(t.data);

  // ZeroOptimizer (host buffers) against the unsharded optimiser on a + b.
  std::size_t total = 0;
  const std::vector<optim::ParamView> table = zero_table(&total);
  for (optim::OptimizerName name : {optim::OptimizerName::adamw, optim::OptimizerName::normuon}) {
    optim::OptimizerConfig cfg;
    cfg.name = name;
    cfg.lr = 2e-2;
    cfg.scalar_lr = name == optim::OptimizerName::adamw ? 0.0 : 3e-2;
    std::vector<float> p(total, 0.01f), ref(total, 0.01f);
    optim::ZeroOptimizer zero(cfg, table, total, *comm);
    optim::Optimizer plain(cfg, table, total);
    for (int s = 0; s < 3; ++s) {
      std::vector<float> g = zero_grads(total, rank, s), sum = zero_grads(total, 0, s);
      const std::vector<float> g1 = zero_grads(total, 1, s);
      for (std::size_t i = 0; i < total; ++i) sum[i] += g1[i];
      zero.reduce_gradients(g.data());
      const double a = zero.clip_gradients(g.data()), b = plain.clip_gradients(sum.data());
      if (a != b) return "grad norm differs at step " + std::to_string(s);
      zero.step(p.data(), g.data(), 1.0, 1.0);
      plain.step(ref.data(), sum.data(), 1.0, 1.0);
    }
    if (std::memcmp(p.data(), ref.data(), total * sizeof(float)) != 0) return "ZeroOptimizer parameters differ";
    if (zero.save_state() != plain.save_state()) return "ZeroOptimizer state differs";
  }

  // DeviceZeroOptimizer (device buffers through NCCL in place) against the unsharded
  // blocked-norm DeviceOptimizer on a + b, on this rank's GPU.
  for (optim::OptimizerName name : {optim::OptimizerName::adamw, optim::OptimizerName::normuon}) {
    optim::OptimizerConfig cfg;
    cfg.name = name;
    cfg.lr = 2e-2;
    cfg.scalar_lr = name == optim::OptimizerName::adamw ? 0.0 : 3e-2;
    const auto n = static_cast<int64_t>(total);
    kernels::Tensor P(be->alloc_bytes(total * 4), kernels::DType::f32, {n}), G(be->alloc_bytes(total * 4), kernels::DType::f32, {n});
    kernels::Tensor RP(be->alloc_bytes(total * 4), kernels::DType::f32, {n}), RG(be->alloc_bytes(total * 4), kernels::DType::f32, {n});
    const std::vector<float> p0(total, 0.01f);
    be->upload(p0.data(), P);
    be->upload(p0.data(), RP);
    std::string why;
    {
      optim::DeviceZeroOptimizer zero(*be, cfg, table, total, *comm);
      optim::DeviceOptimizer plain(*be, cfg, table, total, /*blocked_norm=*/true);
      for (int s = 0; s < 3; ++s) {  // every step on every rank: the collectives stay in step
        std::vector<float> g = zero_grads(total, rank, s), sum = zero_grads(total, 0, s);
        const std::vector<float> g1 = zero_grads(total, 1, s);
        for (std::size_t i = 0; i < total; ++i) sum[i] += g1[i];
        be->upload(g.data(), G);
        be->upload(sum.data(), RG);
        zero.reduce_gradients(G);
        const double a = zero.clip_gradients(G), b = plain.clip_gradients(RG);
        if (a != b && why.empty()) why = "DeviceZeroOptimizer grad norm differs at step " + std::to_string(s);
        zero.step(P, G, 1.0, 1.0);
        plain.step(RP, RG, 1.0, 1.0);
      }
      std::vector<float> got(total), want(total);
      be->download(P, got.data());
      be->download(RP, want.data());
      if (why.empty() && std::memcmp(got.data(), want.data(), total * sizeof(float)) != 0)
        why = "DeviceZeroOptimizer parameters differ";
      const std::string zs = zero.save_state();  // collective: every rank, whatever failed
      if (why.empty() && zs != plain.save_state()) why = "DeviceZeroOptimizer state differs";
    }
    for (void* q : {P.data, G.data, RP.data, RG.data}) be->free_bytes(q);
    if (!why.empty()) return why;
  }
  return "";
}

}  // namespace

// Not a test by itself: the body of one rank of the test below (skipped unless it set
// LAR_ZERO_WORKER).
TEST(DistGpuZeroWorker, Rank) {
  const char* rank = std::getenv("LAR_ZERO_WORKER");
  if (!rank) GTEST_SKIP() << "a rank of DistGpu.ZeroOverNccl";
  const std::string why = zero_worker(std::atoi(rank), std::getenv("LAR_ZERO_DIR"));
  EXPECT_EQ(why, "");
}

TEST_F(DistGpu, ZeroOverNcclMatchesTheUnshardedOptimiser) {
  const fs::path d = temp("zero");
  std::vector<pid_t> pids;
  for (int r = 0; r < 2; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::setenv("LAR_ZERO_WORKER", std::to_string(r).c_str(), 1);
      ::setenv("LAR_ZERO_DIR", d.c_str(), 1);
      const std::string exe = fs::read_symlink("/proc/self/exe").string();
      const char* argv[] = {exe.c_str(), "--gtest_filter=DistGpuZeroWorker.Rank", nullptr};
      ::execv(exe.c_str(), const_cast<char**>(argv));
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  for (pid_t pid : pids) EXPECT_EQ(wait_rc(pid), 0);
}

