#include "core/env.hpp"

#include <cstdlib>

#include "core/error.hpp"

namespace lar {

double env_number(const char* name, double fallback, const std::string& unit) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  try {
    return std::stod(v);
  } catch (...) {
    throw UserError(std::string(name) + "=" + v + ": not a number of " + unit);
  }
}

}  // namespace lar
