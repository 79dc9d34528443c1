#pragma once
// Test helpers: write spec files into a fresh temporary folder and load them.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "core/error.hpp"
#include "experiments/cell.hpp"
#include "tests/temp_dir.hpp"

namespace lar::experiments::testing {

class SpecDir {
 public:
  const std::filesystem::path& dir() const { return tmp_.path; }

  std::filesystem::path write(const std::string& name, const std::string& text) const {
    return tmp_.write(name, text);
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
    std::string prefix = tmp_.path.string() + "/";
    for (size_t p; (p = s.find(prefix)) != std::string::npos;) s.erase(p, prefix.size());
    return s;
  }

 private:
  TempDir tmp_;  // a fresh folder per SpecDir, removed with it
};

inline std::vector<std::string> ids(const Plan& p) {
  std::vector<std::string> out;
  for (const auto& c : p.cells) out.push_back(c.id);
  return out;
}

}  // namespace lar::experiments::testing
