// Rank discovery from the environment (dist/env.hpp), the NCCL id file exchange
// (dist/id_exchange.hpp) and batch sharding (trainer::slice_batch / check_batch_split).
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <map>
#include <thread>

#include "core/error.hpp"
#include "core/fs.hpp"
#include "dist/env.hpp"
#include "dist/id_exchange.hpp"
#include "tests/temp_dir.hpp"
#include "trainer/train.hpp"

using namespace lar;
namespace fs = std::filesystem;

namespace {

dist::DistEnv env_of(const std::map<std::string, std::string>& vars) {
  return dist::dist_env([&](const char* n) -> const char* {
    auto it = vars.find(n);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

std::string user_error(const std::map<std::string, std::string>& vars) {
  try {
    env_of(vars);
  } catch (const UserError& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST(DistEnv, NoVariablesIsOneProcess) {
  auto e = env_of({});
  EXPECT_EQ(e.world, 1);
  EXPECT_EQ(e.rank, 0);
  EXPECT_FALSE(e.distributed());
  EXPECT_EQ(e.source, "");
}

TEST(DistEnv, LarLauncherVariables) {
  auto e = env_of({{"LAR_RANK", "1"}, {"LAR_WORLD_SIZE", "4"}, {"LAR_LOCAL_RANK", "3"}, {"LAR_DIST_TOKEN", "h-12/x"}});
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.world, 4);
  EXPECT_EQ(e.local_rank, 3);
  EXPECT_EQ(e.source, "lar");
  EXPECT_EQ(e.token, "h-12_x");  // safe in a file name
  EXPECT_TRUE(e.distributed());
}

TEST(DistEnv, SlurmStepVariables) {
  auto e = env_of({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"}, {"SLURM_STEP_ID", "0"},
                   {"SLURM_JOB_ID", "777"}, {"SLURM_RESTART_COUNT", "2"}});
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.source, "slurm");
  EXPECT_EQ(e.token, "slurm-777.0.r2");
}

TEST(DistEnv, SlurmBatchStepWithoutSrunIsOneProcess) {
  // `sbatch --ntasks=4` runs the script once: no step id, so not rank 0 of 4.
  auto e = env_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_JOB_ID", "9"}});
  EXPECT_EQ(e.world, 1);
  EXPECT_FALSE(e.distributed());
}

TEST(DistEnv, LarWinsOverSlurm) {
  auto e = env_of({{"LAR_RANK", "0"}, {"LAR_WORLD_SIZE", "2"}, {"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"},
                   {"SLURM_STEP_ID", "1"}});
  EXPECT_EQ(e.world, 2);
  EXPECT_EQ(e.source, "lar");
}

TEST(DistEnv, TimeoutComesFromTheEnvironment) {
  ::unsetenv("LAR_DIST_TIMEOUT");
  EXPECT_EQ(dist::dist_timeout_s(), 40);
  ::setenv("LAR_DIST_TIMEOUT", "7.5", 1);
  EXPECT_EQ(dist::dist_timeout_s(), 7.5);
  ::setenv("LAR_DIST_TIMEOUT", "soon", 1);
  try {
    dist::dist_timeout_s();
    ADD_FAILURE() << "no error";
  } catch (const UserError& e) {
    EXPECT_EQ(std::string(e.what()), "LAR_DIST_TIMEOUT=soon: not a number of seconds");
  }
  ::unsetenv("LAR_DIST_TIMEOUT");
}

TEST(DistEnv, BadValuesNameTheVariable) {
  EXPECT_EQ(user_error({{"LAR_RANK", "x"}, {"LAR_WORLD_SIZE", "2"}}),
            "LAR_RANK='x': expected a non-negative integer");
  EXPECT_EQ(user_error({{"LAR_RANK", "2"}, {"LAR_WORLD_SIZE", "2"}}), "LAR_RANK=2 is not below LAR_WORLD_SIZE=2");
  EXPECT_EQ(user_error({{"LAR_WORLD_SIZE", "2"}}), "LAR_WORLD_SIZE is set but LAR_RANK is not");
  EXPECT_EQ(user_error({{"LAR_RANK", "0"}, {"LAR_WORLD_SIZE", "0"}}),
            "LAR_WORLD_SIZE=0: the world has at least one rank");
  EXPECT_EQ(user_error({{"SLURM_PROCID", "-1"}, {"SLURM_NTASKS", "2"}, {"SLURM_STEP_ID", "0"}}),
            "SLURM_PROCID='-1': expected a non-negative integer");
}


TEST(IdExchange, RankZeroPublishesOthersRead) {
  TempDir t;
  const fs::path f = dist::id_file_path(t.path, "tok1");
  EXPECT_EQ(f, t.path / "dist" / "nccl-id.tok1");
  std::string id(128, '\0');
  for (int i = 0; i < 128; ++i) id[i] = static_cast<char>(i * 7);
  std::thread writer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    dist::publish_id(f, id);
  });
  const auto t0 = std::chrono::steady_clock::now();
  std::string got = dist::wait_for_id(f, 128, 10.0, 0.01);
  writer.join();
  EXPECT_EQ(got, id);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(100));
  // No temp file left beside it (the write was a rename).
  int files = 0;
  for (auto& e : fs::directory_iterator(f.parent_path())) files += e.is_regular_file();
  EXPECT_EQ(files, 1);
}

TEST(IdExchange, TimeoutNamesTheFile) {
  TempDir t;
  const fs::path f = dist::id_file_path(t.path, "never");
  const auto t0 = std::chrono::steady_clock::now();
  try {
    dist::wait_for_id(f, 128, 0.3, 0.01);
    FAIL() << "no timeout";
  } catch (const RuntimeError& e) {
    EXPECT_NE(std::string(e.what()).find("no NCCL id from rank 0 after 0.3 s (" + f.string() + ")"), std::string::npos)
        << e.what();
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(s, 0.3);
  EXPECT_LT(s, 3.0);
}

TEST(IdExchange, WrongSizeIsAnError) {
  TempDir t;
  const fs::path f = dist::id_file_path(t.path, "short");
  dist::publish_id(f, "abc");
  try {
    dist::wait_for_id(f, 128, 1.0);
    FAIL() << "no error";
  } catch (const RuntimeError& e) {
    EXPECT_EQ(std::string(e.what()), f.string() + ": holds 3 bytes, an NCCL id has 128");
  }
}

TEST(BatchShard, SlicesRowsOfEveryField) {
  data::Batch b;
  b.batch = 4;
  b.seq_len = 3;
  for (int i = 0; i < 12; ++i) {
    b.inputs.push_back(i);
    b.targets.push_back(100 + i);
    b.loss_mask.push_back(i % 2 ? 1.0f : 0.0f);
    b.answer_id.push_back(i / 3);
  }
  b.answer_kind = {0, 1, 0, 1};
  data::Batch s = trainer::slice_batch(b, 1, 2);  // rows 2 and 3
  EXPECT_EQ(s.batch, 2);
  EXPECT_EQ(s.seq_len, 3);
  EXPECT_EQ(s.inputs, (std::vector<int32_t>{6, 7, 8, 9, 10, 11}));
  EXPECT_EQ(s.targets, (std::vector<int32_t>{106, 107, 108, 109, 110, 111}));
  EXPECT_EQ(s.loss_mask, (std::vector<float>{0, 1, 0, 1, 0, 1}));
  EXPECT_EQ(s.answer_id, (std::vector<int32_t>{2, 2, 2, 3, 3, 3}));
  EXPECT_EQ(s.answer_kind, b.answer_kind);  // answer ids stay valid
  data::Batch q = trainer::slice_batch(b, 3, 4);
  EXPECT_EQ(q.inputs, (std::vector<int32_t>{9, 10, 11}));
  EXPECT_EQ(trainer::slice_batch(b, 0, 1).inputs, b.inputs);
  // The parts cover the batch exactly once.
  std::vector<int32_t> all;
  for (int p = 0; p < 4; ++p) {
    auto part = trainer::slice_batch(b, p, 4).inputs;
    all.insert(all.end(), part.begin(), part.end());
  }
  EXPECT_EQ(all, b.inputs);
  EXPECT_THROW(trainer::slice_batch(b, 0, 3), RuntimeError);
  EXPECT_THROW(trainer::slice_batch(b, 2, 2), RuntimeError);
}

TEST(BatchShard, BatchSplitCheck) {
  json cfg = {{"data", {{"batch_size", 12}, {"micro_batches", 2}}}};
  EXPECT_NO_THROW(trainer::check_batch_split(cfg, 1));
  EXPECT_NO_THROW(trainer::check_batch_split(cfg, 3));
  try {
    trainer::check_batch_split(cfg, 4);
    FAIL() << "no error";
  } catch (const UserError& e) {
    EXPECT_EQ(std::string(e.what()),
              "data.batch_size 12 does not split into 4 rank(s) × data.micro_batches 2 equal micro-batches");
  }
  cfg["data"]["micro_batches"] = 0;
  EXPECT_THROW(trainer::check_batch_split(cfg, 1), UserError);
}
