#pragma once
// Starting the real `lar` binary (LAR_BINARY) from a test, as a user would.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>

#include <filesystem>
#include <string>
#include <vector>

extern char** environ;

namespace lar::test {

// Starts `lar args…` with stdout+stderr to `log`; returns the pid.
inline pid_t spawn_lar(const std::vector<std::string>& args, const std::filesystem::path& log) {
  std::vector<std::string> all = {LAR_BINARY};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  pid_t pid = 0;
  EXPECT_EQ(posix_spawn(&pid, LAR_BINARY, &fa, nullptr, argv.data(), environ), 0);
  posix_spawn_file_actions_destroy(&fa);
  return pid;
}

// Waits for the process; its exit code, or 128 + the signal that killed it.
inline int wait_exit(pid_t pid) {
  int st = 0;
  ::waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

}  // namespace lar::test
