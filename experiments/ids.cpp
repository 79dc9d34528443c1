#include "experiments/ids.hpp"

#include <charconv>

namespace lar::experiments {

namespace {

// "3e-04" → "3e-4", "1e+20" → "1e20"
std::string bare_exponent(std::string s) {
  size_t e = s.find('e');
  if (e == std::string::npos) return s;
  std::string mant = s.substr(0, e), exp = s.substr(e + 1);
  bool neg = !exp.empty() && exp[0] == '-';
  if (!exp.empty() && (exp[0] == '-' || exp[0] == '+')) exp = exp.substr(1);
  size_t nz = exp.find_first_not_of('0');
  exp = nz == std::string::npos ? "0" : exp.substr(nz);
  return mant + "e" + (neg ? "-" : "") + exp;
}

// Characters that are safe in a folder name and in a shell word.
std::string sanitize(const std::string& s) {
  std::string out;
  for (char c : s) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
              c == '-' || c == '+' || c == '.';
    out += ok ? c : '_';
  }
  return out.empty() ? "_" : out;
}

std::string value_text(const json& v) {
  if (v.is_number_integer()) return std::to_string(v.get<long long>());
  if (v.is_number_float()) return id_number(v.get<double>());
  if (v.is_string()) return v.get<std::string>();
  if (v.is_array()) {
    std::string s;
    for (const auto& e : v) s += (s.empty() ? "" : "-") + value_text(e);
    return s.empty() ? "none" : s;
  }
  return v.dump();
}

}  // namespace

std::string id_number(double x) {
  char fixed[64], sci[64];
  auto f = std::to_chars(fixed, fixed + sizeof fixed, x, std::chars_format::fixed);
  auto s = std::to_chars(sci, sci + sizeof sci, x, std::chars_format::scientific);
  std::string a(fixed, f.ptr), b = bare_exponent(std::string(sci, s.ptr));
  return b.size() < a.size() ? b : a;
}

std::string id_part(const std::string& name, const std::string& path, const json& value) {
  std::string axis = name.substr(name.rfind('.') + 1);
  if (value.is_boolean()) return value.get<bool>() ? axis : "no" + axis;
  if (value.is_string()) return sanitize(value.get<std::string>());
  if (path == "seed") return "s" + sanitize(value_text(value));
  return sanitize(axis + value_text(value));
}

}  // namespace lar::experiments
