#include "registry/text_table.hpp"

#include <cmath>
#include <ctime>
#include <sstream>

#include <fmt/format.h>

namespace lar::registry {

// Display width: count UTF-8 code points (continuation bytes do not advance the cursor).
static size_t display_width(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s)
    if ((c & 0xC0) != 0x80) ++n;
  return n;
}

std::string TextTable::to_table() const {
  std::vector<size_t> w(headers.size(), 0);
  for (size_t i = 0; i < headers.size(); ++i) w[i] = display_width(headers[i]);
  for (const auto& r : rows)
    for (size_t i = 0; i < r.size() && i < w.size(); ++i) w[i] = std::max(w[i], display_width(r[i]));
  auto line = [&](const std::vector<std::string>& cells) {
    std::string out;
    for (size_t i = 0; i < w.size(); ++i) {
      const std::string cell = i < cells.size() ? cells[i] : "";
      std::string pad(w[i] - display_width(cell), ' ');
      bool right = i < right_align.size() && right_align[i];
      bool last = i + 1 == w.size();
      out += right ? pad + cell : (last ? cell : cell + pad);
      if (!last) out += "  ";
    }
    return out + "\n";
  };
  std::string out = line(headers);
  std::vector<std::string> rule;
  for (size_t x : w) rule.push_back(std::string(x, '-'));
  out += line(rule);
  for (const auto& r : rows) out += line(r);
  return out;
}

static std::string csv_cell(const std::string& s) {
  if (s.find_first_of(",\"\n\r") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

std::string TextTable::to_csv() const {
  std::string out;
  auto line = [&](const std::vector<std::string>& cells) {
    for (size_t i = 0; i < cells.size(); ++i) out += (i ? "," : "") + csv_cell(cells[i]);
    out += "\n";
  };
  line(headers);
  for (const auto& r : rows) line(r);
  return out;
}

std::string fmt_num(double v, int digits) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  if (v == std::floor(v) && std::fabs(v) < 1e15) return fmt::format("{:.0f}", v);
  return fmt::format("{:.{}g}", v, digits);
}

std::string fmt_time(double t) {
  if (t <= 0) return "-";
  std::time_t tt = static_cast<std::time_t>(t);
  std::tm tm{};
  gmtime_r(&tt, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", &tm);
  return buf;
}

}  // namespace lar::registry
