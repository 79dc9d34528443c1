#include "serve/text.hpp"

#include <fmt/format.h>

#include <charconv>
#include <cmath>

#include "serve/http_error.hpp"

namespace lar::serve {

std::string html_escape(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 16);
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string url_encode(std::string_view s) {
  static const char* hex = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return out;
}

namespace {
bool name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
         c == '+' || c == '=' || c == ':' || c == '@' || c == ',' || c == '-';
}
}  // namespace

bool valid_name(std::string_view s, size_t max_len) {
  if (s.empty() || s.size() > max_len) return false;
  for (char c : s)
    if (!name_char(c)) return false;
  return true;
}

bool valid_value(std::string_view s, size_t max_len) {
  if (s.empty() || s.size() > max_len) return false;
  for (char c : s)
    if (!name_char(c) && c != '/' && c != ' ' && c != '%') return false;
  return true;
}

size_t parse_count(const std::string& text, size_t max, const char* what) {
  size_t v = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || p != text.data() + text.size() || v > max)
    throw HttpError(400, fmt::format("bad {} '{}': expected an integer from 0 to {}", what, text.substr(0, 40), max));
  return v;
}

std::string num_text(double v, int digits) {
  if (!std::isfinite(v)) return "-";
  return fmt::format("{:.{}g}", v, digits);
}

}  // namespace lar::serve
