#pragma once
// Two kinds of failure, two exit codes (DESIGN.md, Conventions):
//   UserError    — the user's input is wrong (bad spec, unknown run, bad flag): exit 2,
//                  nothing written. The message names file:line:col or the offending value.
//   RuntimeError — the world failed (I/O, a child crashed): exit 1 with the cause.
#include <stdexcept>
#include <string>
#include <vector>

namespace lar {

struct SourceLoc {
  std::string file;
  int line = 0;    // 1-based; 0 = unknown
  int column = 0;  // 1-based; 0 = unknown
  std::string str() const;  // "file:line:col", or what is known of it
};

class UserError : public std::runtime_error {
 public:
  explicit UserError(const std::string& msg) : std::runtime_error(msg) {}
  UserError(const SourceLoc& loc, const std::string& msg)
      : std::runtime_error(loc.str() + ": error: " + msg) {}
};

class RuntimeError : public std::runtime_error {
 public:
  explicit RuntimeError(const std::string& msg) : std::runtime_error(msg) {}
};

constexpr int kExitOk = 0;
constexpr int kExitRuntime = 1;
constexpr int kExitUser = 2;

// "did you mean 'x'?" for the closest of `candidates` (edit distance ≤ 1/3 of the
// word), or "" when none is close.
std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates);

}  // namespace lar
