#pragma once
// Plain-text output for the registry commands: aligned tables and RFC-4180 CSV.
#include <string>
#include <vector>

namespace lar::registry {

struct TextTable {
  std::vector<std::string> headers;
  std::vector<std::vector<std::string>> rows;
  std::vector<bool> right_align;  // per column; numbers read better right-aligned

  std::string to_table() const;   // columns padded to their widest cell (UTF-8 aware)
  std::string to_csv() const;     // quoted where needed
};

// Compact number formatting for tables: up to `digits` significant digits, "nan", "-".
std::string fmt_num(double v, int digits = 4);
// Seconds since the epoch → "2026-11-29 18:44:04" (UTC); "-" for 0.
std::string fmt_time(double unix_seconds);

}  // namespace lar::registry
