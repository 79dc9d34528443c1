#pragma once
// Test helpers: write spec files into a fresh temporary folder and load them.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "core/error.hpp"
#include "experiments/cell.hpp"

namespace lar::experiments::testing {

class SpecDir {
 public:
  SpecDir() {
    static int n = 0;
    dir_ = std::filesystem::temp_directory_path() /
           ("lar-exp-test-" + std::to_string(::getpid()) + "-" + std::to_string(n++));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  ~SpecDir() { std::filesystem::remove_all(dir_); }
  const std::filesystem::path& dir() const { return dir_; }

  std::filesystem::path write(const std::string& name, const std::string& text) const {
    auto p = dir_ / name;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p) << text;
    return p;
  }

  Plan load(const std::string& text, const std::string& scale = "") const {
    return load_plan(write("spec.yaml", text), scale);
  }

  // The UserError message with the folder stripped ("spec.yaml:3:5: error: ..."), or
  // "no error".
  std::string error(const std::string& text, const std::string& scale = "") const {
    return error_of([&] { load(text, scale); });
  }

  template <class F>
  std::string error_of(F f) const {
    try {
      f();
    } catch (const UserError& e) {
      return strip(e.what());
    }
    return "no error";
  }

  std::string strip(std::string s) const {
    std::string prefix = dir_.string() + "/";
    for (size_t p; (p = s.find(prefix)) != std::string::npos;) s.erase(p, prefix.size());
    return s;
  }

 private:
  std::filesystem::path dir_;
};

inline std::vector<std::string> ids(const Plan& p) {
  std::vector<std::string> out;
  for (const auto& c : p.cells) out.push_back(c.id);
  return out;
}

}  // namespace lar::experiments::testing
