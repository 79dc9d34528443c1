#pragma once
// Test helper: run a shell command, return its exit code and its stdout and stderr together.
#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace lar::test {

struct ShellResult {
  int rc = -1;      // exit code; -1 when the command did not exit normally
  std::string out;  // stdout and stderr, interleaved
};

inline ShellResult sh(const std::string& cmd) {
  ShellResult r;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int status = ::pclose(p);
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

}  // namespace lar::test
