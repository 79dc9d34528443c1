#include "core/env.hpp"

#include <cerrno>
#include <cstdlib>

#include "core/error.hpp"

namespace lar {

namespace {
[[noreturn]] void bad(const char* name, const std::string& v, const std::string& expected) {
  throw UserError(std::string(name) + "=" + v + ": " + expected);
}
}  // namespace

std::optional<std::string> env_string(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  return std::string(v);
}

std::string env_string(const char* name, const std::string& fallback) {
  return env_string(name).value_or(fallback);
}

double env_number(const char* name, double fallback, const std::string& unit) {
  const auto v = env_string(name);
  if (!v) return fallback;
  size_t used = 0;
  double d = 0;
  try {
    d = std::stod(*v, &used);
  } catch (...) {
    used = 0;
  }
  if (used == 0 || used != v->size()) bad(name, *v, "not a number of " + unit);
  return d;
}

long env_int(const char* name, long fallback, long min, long max) {
  const auto v = env_string(name);
  if (!v) return fallback;
  char* end = nullptr;
  errno = 0;
  const long n = std::strtol(v->c_str(), &end, 10);
  const std::string range = "expected an integer from " + std::to_string(min) + " to " + std::to_string(max);
  if (end == v->c_str() || *end != '\0' || errno == ERANGE || n < min || n > max) bad(name, *v, range);
  return n;
}

std::string env_choice(const char* name, std::initializer_list<const char*> allowed, const std::string& fallback) {
  const auto v = env_string(name);
  if (!v) return fallback;
  std::string list;
  for (const char* a : allowed) {
    if (*v == a) return *v;
    list += (list.empty() ? "" : ", ") + std::string(a);
  }
  bad(name, *v, "expected one of " + list);
}

bool env_flag(const char* name, bool fallback) {
  const auto v = env_string(name);
  if (!v) return fallback;
  if (*v == "1") return true;
  if (*v == "0") return false;
  bad(name, *v, "expected 0 or 1");
}

}  // namespace lar
