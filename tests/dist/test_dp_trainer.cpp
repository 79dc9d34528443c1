// The trainer's data parallelism without a GPU: two ranks as two threads of this process,
// joined by an in-memory DataParallel (sums in rank order, like NCCL's 2-rank ring), on
// the CPU backend. Checks: 2 ranks give the bits of 1 process with 2 micro-batches; only
// rank 0 writes the run directory; a stop on one rank stops both at the same step with
// one checkpoint, and the run resumes; a failing rank fails the run with its cause and
// its peer does not hang.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <thread>

#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/run_dir.hpp"
#include "trainer/checkpoint.hpp"
#include "kernels/backend.hpp"
#include "trainer/optim/device_zero.hpp"
#include "trainer/train.hpp"
#include "tests/dist/fake_group.hpp"
#include "tests/temp_dir.hpp"
#include "tests/trainer/run_test_helpers.hpp"

using namespace lar;
namespace fs = std::filesystem;
using lar::test::metric_values;
using lar::test::write_run;

namespace {

// Two (or more) ranks in one process. Every collective is a rendezvous: each rank posts
// its buffer, the last to arrive sums them in rank order into every buffer.
struct Group {
  int world;
  std::mutex mu;
  std::condition_variable cv;
  long generation = 0;
  int arrived = 0;
  std::vector<float*> fbufs;
  std::vector<double*> dbufs;
  int64_t count = 0;
  bool broken = false;  // a rank failed: the others' next collective times out
  explicit Group(int w) : world(w), fbufs(w), dbufs(w) {}

  template <class T>
  void all_reduce(int rank, T* buf, int64_t n, double timeout_s) {
    std::unique_lock<std::mutex> lk(mu);
    // A broken group answers as NCCL's timeout would: later than the failing rank.
    auto timed_out = [&] {
      lk.unlock();
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      return RuntimeError("collective timed out after " + std::to_string(int(timeout_s)) + " s: a peer died");
    };
    if (broken) throw timed_out();
    const long gen = generation;
    if constexpr (std::is_same_v<T, float>) fbufs[rank] = buf;
    else dbufs[rank] = buf;
    count = n;
    if (++arrived == world) {
      for (int64_t i = 0; i < n; ++i) {
        T s = 0;
        for (int r = 0; r < world; ++r) {
          T v = std::is_same_v<T, float> ? T(fbufs[r][i]) : T(dbufs[r][i]);
          s = r == 0 ? v : s + v;
        }
        for (int r = 0; r < world; ++r) {
          if constexpr (std::is_same_v<T, float>) fbufs[r][i] = s;
          else dbufs[r][i] = s;
        }
      }
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    if (!cv.wait_for(lk, std::chrono::duration<double>(timeout_s), [&] { return generation != gen || broken; }) ||
        generation == gen)
      throw timed_out();
  }
};

class FakeDp final : public trainer::DataParallel {
 public:
  FakeDp(Group& g, int rank, long fail_at_call = -1) : g_(g), rank_(rank), fail_at_(fail_at_call) {}
  int rank() const override { return rank_; }
  int world() const override { return g_.world; }
  void reduce_async(const kernels::Tensor& grads, int64_t offset, int64_t count) override {
    if (++calls_ == fail_at_) {
      {
        std::lock_guard<std::mutex> lk(g_.mu);
        g_.broken = true;
      }
      g_.cv.notify_all();
      throw RuntimeError("injected failure on rank " + std::to_string(rank_));
    }
    g_.all_reduce(rank_, grads.ptr<float>() + offset, count, 2.0);
    ++reduces;
  }
  void wait_reduced() override {}
  std::vector<double> sum(const std::vector<double>& v, double) override {
    std::vector<double> out = v;
    g_.all_reduce(rank_, out.data(), static_cast<int64_t>(out.size()), 2.0);
    return out;
  }
  void abort() override { aborted = true; }
  optim::Communicator* communicator() override { return zero; }
  optim::Communicator* zero = nullptr;  // ZeRO-1's collectives (tests/dist/fake_group.hpp)
  long reduces = 0;
  bool aborted = false;

 private:
  Group& g_;
  int rank_;
  long calls_ = 0, fail_at_;
};

json tiny_run(json overrides = json::object()) {
  json c = {{"seed", 5},
            {"threads", 1},
            {"backend", "cpu"},
            {"model", {{"n_layers", 2}, {"d_model", 32}, {"n_heads", 4}, {"n_kv_heads", 2}, {"vocab_size", 64}}},
            {"data", {{"task", "mqar"}, {"seq_len", 32}, {"batch_size", 4}, {"num_kv_pairs", 4}}},
            {"optimizer", {{"lr", 3e-3}}},
            {"schedule", {{"warmup_steps", 2}}},
            {"budget", {{"steps", 6}}},
            {"eval", {{"every", 3}, {"batches", 1}}},
            {"checkpoint", {{"every", 0}, {"keep", 2}}}};
  c.merge_patch(overrides);
  return c;
}

// The trainer owns the DataParallel it is given: a forwarding shell around the test's.
struct Shell final : trainer::DataParallel {
  FakeDp* d;
  explicit Shell(FakeDp* x) : d(x) {}
  int rank() const override { return d->rank(); }
  int world() const override { return d->world(); }
  void reduce_async(const kernels::Tensor& g, int64_t o, int64_t c) override { d->reduce_async(g, o, c); }
  void wait_reduced() override { d->wait_reduced(); }
  std::vector<double> sum(const std::vector<double>& v, double t) override { return d->sum(v, t); }
  void abort() override { d->abort(); }
  optim::Communicator* communicator() override { return d->communicator(); }
};

struct Ranks {
  std::vector<int> rc;
  std::vector<std::string> errors;  // UserError messages (rc 2)
  std::vector<std::unique_ptr<FakeDp>> dps;
  std::unique_ptr<lar::testing::FakeGroup> zero_group;
  std::vector<std::unique_ptr<optim::Communicator>> zero;
};

// Train `dir` with `world` ranks (threads); per-rank options from `tweak`.
Ranks train_ranks(const fs::path& dir, int world,
                  std::function<void(int, trainer::TrainOptions&, long&)> tweak = {}) {
  Group g(world);
  Ranks out;
  out.rc.assign(world, -1);
  out.errors.assign(world, "");
  out.zero_group = std::make_unique<lar::testing::FakeGroup>(world);
  std::vector<std::thread> th;
  for (int r = 0; r < world; ++r) {
    long fail_at = -1;
    trainer::TrainOptions o;
    if (tweak) tweak(r, o, fail_at);
    out.dps.push_back(std::make_unique<FakeDp>(g, r, fail_at));
    FakeDp* dp = out.dps.back().get();
    out.zero.push_back(out.zero_group->member(r));
    dp->zero = out.zero.back().get();
    o.make_data_parallel = [dp](kernels::Backend&, const json&, const fs::path&) {
      dp->sum({0.0}, 5);  // the ranks meet, as NCCL's communicator forms once all arrive
      return std::unique_ptr<trainer::DataParallel>(new Shell(dp));
    };
    th.emplace_back([&out, &dir, r, o] {
      try {
        out.rc[r] = trainer::train_run(dir, o);
      } catch (const UserError& e) {
        out.rc[r] = 2;
        out.errors[r] = e.what();
      }
    });
  }
  for (auto& t : th) t.join();
  return out;
}

}  // namespace

TEST(DataParallelTrainer, TwoRanksEqualOneProcessWithTwoMicroBatches) {
  TempDir one, two, plain;
  write_run(one.path, tiny_run({{"data", {{"micro_batches", 2}}}}));
  write_run(two.path, tiny_run());
  write_run(plain.path, tiny_run());
  ASSERT_EQ(trainer::train_run(one.path), 0);
  ASSERT_EQ(trainer::train_run(plain.path), 0);
  std::vector<int> rc = train_ranks(two.path, 2).rc;
  EXPECT_EQ(rc, (std::vector<int>{0, 0}));
  auto a = metric_values(one.path), b = metric_values(two.path), c = metric_values(plain.path);
  ASSERT_EQ(a.size(), 9u);  // 6 train lines; evals at 3, 5 (end of the stable phase), 6
  EXPECT_EQ(a, b);          // bit for bit
  // Against the whole batch at once: the same to rounding (another summation order).
  auto final_loss = [](const fs::path& d) { return RunDir(d).read_status()->summary.at("final_train_loss").get<double>(); };
  EXPECT_NEAR(final_loss(one.path), final_loss(plain.path), 1e-4);
  EXPECT_NE(a, c);
  auto st = RunDir(two.path).read_status();
  EXPECT_EQ(st->state, RunState::completed);
  EXPECT_EQ(st->summary.at("world_size"), 2);
  EXPECT_EQ(st->summary.at("tokens"), 6 * 4 * 32);  // the global batch's tokens
  EXPECT_EQ(trainer::list_checkpoints(two.path / "checkpoints").size(), 1u);
  // The log is rank 0's alone: one start line.
  const std::string log = read_file(RunDir(two.path).log_path());
  EXPECT_EQ(log.find("start:"), log.rfind("start:"));
  EXPECT_NE(log.find("2 data-parallel ranks"), std::string::npos) << log;
}

TEST(DataParallelTrainer, GradientsAreSummedInBucketsDuringBackward) {
  TempDir d;
  write_run(d.path, tiny_run({{"budget", {{"steps", 1}}}, {"eval", {{"batches", 0}}}}));
  // LAR_DIST_BUCKET_MB=0: one all-reduce per group backward makes ready (head + final
  // norm, block 1, block 0, embedding), each started during backward.
  ::setenv("LAR_DIST_BUCKET_MB", "0", 1);
  Ranks r = train_ranks(d.path, 2);
  ::unsetenv("LAR_DIST_BUCKET_MB");
  EXPECT_EQ(r.rc, (std::vector<int>{0, 0}));
  EXPECT_EQ(r.dps[0]->reduces, 4);
  EXPECT_EQ(r.dps[1]->reduces, 4);
  // Default buckets (25 MB) hold this whole model: one all-reduce per step.
  TempDir d2;
  write_run(d2.path, tiny_run({{"budget", {{"steps", 1}}}, {"eval", {{"batches", 0}}}}));
  Ranks r2 = train_ranks(d2.path, 2);
  EXPECT_EQ(r2.dps[0]->reduces, 1);
}

TEST(DataParallelTrainer, AStopOnOneRankStopsBothAtTheSameStep) {
  TempDir d;
  write_run(d.path, tiny_run());
  // Only rank 1 is asked to stop after 2 steps; rank 0 learns it through the step's sum.
  auto rc = train_ranks(d.path, 2, [](int r, trainer::TrainOptions& o, long&) {
    if (r == 1) o.stop_after_steps = 2;
  }).rc;
  EXPECT_EQ(rc, (std::vector<int>{3, 3}));
  auto st = RunDir(d.path).read_status();
  EXPECT_EQ(st->state, RunState::preempted);
  EXPECT_EQ(st->step, 2);
  auto cks = trainer::list_checkpoints(d.path / "checkpoints");
  ASSERT_EQ(cks.size(), 1u);
  EXPECT_EQ(trainer::read_checkpoint(cks[0]).state.at("world_size"), 2);
  // Resume on 2 ranks: the same bits as an uninterrupted 2-rank run.
  EXPECT_EQ(train_ranks(d.path, 2).rc, (std::vector<int>{0, 0}));
  TempDir ref;
  write_run(ref.path, tiny_run());
  EXPECT_EQ(train_ranks(ref.path, 2).rc, (std::vector<int>{0, 0}));
  EXPECT_EQ(metric_values(d.path), metric_values(ref.path));
}

TEST(DataParallelTrainer, ResumesOnAnotherWorldSize) {
  TempDir d;
  write_run(d.path, tiny_run());
  auto rc = train_ranks(d.path, 2, [](int, trainer::TrainOptions& o, long&) { o.stop_after_steps = 3; }).rc;
  EXPECT_EQ(rc, (std::vector<int>{3, 3}));
  // One process now: the global batch and the state are the same, so training goes on.
  EXPECT_EQ(trainer::train_run(d.path), 0);
  EXPECT_NE(read_file(RunDir(d.path).log_path()).find("world size 1 (the checkpoint was written by 2 rank(s))"),
            std::string::npos);
  EXPECT_EQ(RunDir(d.path).read_status()->state, RunState::completed);
}

TEST(DataParallelTrainer, AFailingRankFailsTheRunWithItsCause) {
  TempDir d;
  write_run(d.path, tiny_run());
  const auto t0 = std::chrono::steady_clock::now();
  // Rank 1 fails in its 3rd gradient sum (step 3); rank 0's next collective times out.
  Ranks ranks = train_ranks(d.path, 2, [](int r, trainer::TrainOptions&, long& fail_at) {
    if (r == 1) fail_at = 3;
  });
  auto rc = ranks.rc;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20.0);
  EXPECT_EQ(rc, (std::vector<int>{1, 1}));
  auto st = RunDir(d.path).read_status();
  EXPECT_EQ(st->state, RunState::failed);
  EXPECT_EQ(st->reason, "rank 1: injected failure on rank 1");  // the first cause stays
  EXPECT_NE(read_file(RunDir(d.path).log_path()).find("failed: collective timed out"), std::string::npos);
  EXPECT_TRUE(ranks.dps[1]->aborted);  // the failing rank aborts its communicator
  EXPECT_TRUE(ranks.dps[0]->aborted);
}

TEST(DataParallelTrainer, BatchThatDoesNotSplitIsAUserError) {
  TempDir d;
  write_run(d.path, tiny_run({{"data", {{"batch_size", 3}}}}));
  Ranks r = train_ranks(d.path, 2);
  EXPECT_EQ(r.rc, (std::vector<int>{2, 2}));
  EXPECT_EQ(r.errors[0], "data.batch_size 3 does not split into 2 rank(s) × data.micro_batches 1 equal micro-batches");
  EXPECT_FALSE(fs::exists(RunDir(d.path).status_path()));  // nothing written
}

// optimizer.zero_stage: 0 is the default and changes nothing; 2, 3, -1 are user errors
// naming the key and value (exit 2, nothing written).
TEST(DistZeroConfig, StageIsCheckedBeforeAnyWork) {
  auto stage = [](long s) { return tiny_run({{"optimizer", {{"zero_stage", s}}}}); };
  EXPECT_EQ(trainer::prepare_config(tiny_run()), trainer::prepare_config(stage(0)));
  for (long bad : {2L, 3L, -1L}) {
    try {
      trainer::prepare_config(stage(bad));
      ADD_FAILURE() << "zero_stage " << bad << " accepted";
    } catch (const UserError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("optimizer.zero_stage: " + std::to_string(bad)), std::string::npos) << m;
      if (bad > 0) {
        EXPECT_NE(m.find("not implemented"), std::string::npos) << m;
      }
    }
  }
  EXPECT_EQ(trainer::prepare_config(stage(1)).at("optimizer").at("zero_stage"), 1);  // backend cpu
  // On the GPU, ZeRO-1 waits for tests/gpu/test_device_zero: refused by the gate's name.
  if (!optim::kDeviceZeroGpuVerified && kernels::backend_available("cuda")) {
    json gpu = stage(1);
    gpu["backend"] = "cuda";
    try {
      trainer::prepare_config(gpu);
      ADD_FAILURE() << "zero_stage 1 on backend cuda accepted before its GPU check";
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find("kDeviceZeroGpuVerified"), std::string::npos) << e.what();
    }
  }
  // Through the trainer: exit 2, nothing written.
  TempDir d;
  write_run(d.path, tiny_run({{"optimizer", {{"zero_stage", 2}}}}));
  Ranks r = train_ranks(d.path, 2);
  EXPECT_EQ(r.rc, (std::vector<int>{2, 2}));
  EXPECT_FALSE(fs::exists(RunDir(d.path).status_path()));
}

// ZeRO-1 in the trainer (cpu backend, 2 in-process ranks): the bits of zero_stage 0 —
// losses, gradient norms, evaluations — with AdamW and NorMuon, and a run stopped after 3
// steps resumes sharded (the checkpoint holds the unsharded state) to the same bits.
TEST(DistZeroTrainer, ShardedStateGivesTheBitsOfReplicatedState) {
  for (const char* opt : {"adamw", "normuon"}) {
    SCOPED_TRACE(opt);
    TempDir plain, zero, resumed;
    write_run(plain.path, tiny_run({{"optimizer", {{"name", opt}}}}));
    write_run(zero.path, tiny_run({{"optimizer", {{"name", opt}, {"zero_stage", 1}}}}));
    write_run(resumed.path, tiny_run({{"optimizer", {{"name", opt}, {"zero_stage", 1}}}}));
    ASSERT_EQ(train_ranks(plain.path, 2).rc, (std::vector<int>{0, 0}));
    const Ranks z = train_ranks(zero.path, 2);
    ASSERT_EQ(z.rc, (std::vector<int>{0, 0})) << z.errors[0];
    EXPECT_FALSE(metric_values(plain.path).empty());
    EXPECT_EQ(metric_values(zero.path), metric_values(plain.path));
    EXPECT_NE(read_file(RunDir(zero.path).log_path()).find("optimiser state sharded over 2 ranks"), std::string::npos);
    EXPECT_EQ(read_file(RunDir(plain.path).log_path()).find("sharded"), std::string::npos);
    auto stop3 = [](int, trainer::TrainOptions& o, long&) { o.stop_after_steps = 3; };
    ASSERT_EQ(train_ranks(resumed.path, 2, stop3).rc, (std::vector<int>{3, 3}));
    ASSERT_EQ(train_ranks(resumed.path, 2).rc, (std::vector<int>{0, 0}));
    EXPECT_EQ(metric_values(resumed.path), metric_values(plain.path));
    // The final checkpoints hold the same parameters and optimiser state.
    const auto a = trainer::load_latest_checkpoint(RunDir(plain.path).checkpoints_dir());
    const auto b = trainer::load_latest_checkpoint(RunDir(zero.path).checkpoints_dir());
    ASSERT_TRUE(a && b);
    EXPECT_TRUE(a->params == b->params);
    EXPECT_TRUE(a->optimizer == b->optimizer);
  }
}

// A sharded checkpoint resumes in one process (the unsharded optimiser reads it).
TEST(DistZeroTrainer, ResumesInOneProcess) {
  TempDir d;
  write_run(d.path, tiny_run({{"optimizer", {{"name", "normuon"}, {"zero_stage", 1}}}}));
  auto stop3 = [](int, trainer::TrainOptions& o, long&) { o.stop_after_steps = 3; };
  ASSERT_EQ(train_ranks(d.path, 2, stop3).rc, (std::vector<int>{3, 3}));
  EXPECT_EQ(trainer::train_run(d.path), 0);
  EXPECT_EQ(RunDir(d.path).read_status()->state, RunState::completed);
}

