#pragma once
// Run a program (no shell) and collect what it prints: for the results folder's figures
// (`lar export figure`), the source commit (`git`) and the bundles (`tar`).
#include <string>
#include <vector>

namespace lar::report {

struct ProcessResult {
  int rc = -1;         // exit status; 127 when the program cannot be started
  std::string output;  // stdout and stderr together
};

// argv[0] is looked up on PATH. Never throws for a failing program (rc says it).
ProcessResult run_program(const std::vector<std::string>& argv);

}  // namespace lar::report
