#include "runner/devices.hpp"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <regex>
#include <sstream>

namespace lar::runner {

std::vector<std::string> visible_gpus() {
  std::vector<std::string> out;
  if (const char* env = std::getenv("CUDA_VISIBLE_DEVICES")) {
    std::stringstream in(env);
    for (std::string item; std::getline(in, item, ',');) {
      item.erase(0, item.find_first_not_of(" \t"));
      item.erase(item.find_last_not_of(" \t") + 1);
      if (item.empty() || item[0] == '-' || item == "NoDevFiles") break;
      out.push_back(item);
    }
    return out;
  }
  std::vector<int> ids;
  std::error_code ec;
  static const std::regex dev("nvidia([0-9]+)");
  for (const auto& e : std::filesystem::directory_iterator("/dev", ec)) {
    std::smatch m;
    std::string name = e.path().filename().string();
    if (std::regex_match(name, m, dev)) ids.push_back(std::stoi(m[1]));
  }
  std::sort(ids.begin(), ids.end());
  for (int i : ids) out.push_back(std::to_string(i));
  return out;
}

bool uses_gpu(const experiments::Cell& cell, bool gpu_present) {
  std::string backend = "auto";
  if (cell.config.is_object() && cell.config.contains("backend") && cell.config["backend"].is_string())
    backend = cell.config["backend"].get<std::string>();
  return backend == "cuda" || (backend == "auto" && gpu_present);
}

int default_parallelism(const experiments::Plan& plan) {
  auto gpus = visible_gpus();
  bool any_gpu = std::any_of(plan.cells.begin(), plan.cells.end(),
                             [&](const auto& c) { return uses_gpu(c, !gpus.empty()); });
  if (any_gpu && !gpus.empty()) return static_cast<int>(gpus.size());
  return 1;
}

std::vector<std::string> gpu_slots(int parallelism) {
  auto gpus = visible_gpus();
  std::vector<std::string> slots;
  if (gpus.empty()) return slots;
  for (int k = 0; k < parallelism; ++k) slots.push_back(gpus[k % gpus.size()]);
  return slots;
}

}  // namespace lar::runner
