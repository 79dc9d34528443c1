#include "registry/metrics_reader.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <unordered_map>

#include "core/error.hpp"
#include "core/json.hpp"

namespace lar::registry {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Collects the top-level numeric (and null) fields of one line; nested values and
// strings are skipped.
struct LineSax {
  int depth = 0;
  bool is_object = false;
  bool ok = true;
  std::string current_key;
  std::vector<std::pair<std::string, double>> fields;

  void field(double v) {
    if (depth == 1) fields.emplace_back(current_key, v);
  }
  bool null() { field(kNaN); return true; }
  bool boolean(bool) { return true; }
  bool number_integer(json::number_integer_t v) { field(static_cast<double>(v)); return true; }
  bool number_unsigned(json::number_unsigned_t v) { field(static_cast<double>(v)); return true; }
  bool number_float(json::number_float_t v, const json::string_t&) { field(v); return true; }
  bool string(json::string_t&) { return true; }
  bool binary(json::binary_t&) { return true; }
  bool start_object(std::size_t) {
    if (depth == 0) is_object = true;
    ++depth;
    return true;
  }
  bool key(json::string_t& k) {
    if (depth == 1) current_key = k;
    return true;
  }
  bool end_object() { --depth; return true; }
  bool start_array(std::size_t) { ++depth; return true; }
  bool end_array() { --depth; return true; }
  bool parse_error(std::size_t, const std::string&, const json::exception&) {
    ok = false;
    return false;
  }
};

std::string read_from(const std::filesystem::path& path, uint64_t offset) {
  std::string data;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return data;  // no metrics yet
  char buf[1 << 16];
  off_t pos = static_cast<off_t>(offset);
  while (true) {
    ssize_t n = ::pread(fd, buf, sizeof buf, pos);
    if (n < 0) {
      if (errno == EINTR) continue;
      ::close(fd);
      throw RuntimeError("cannot read " + path.string() + ": " + std::strerror(errno));
    }
    if (n == 0) break;
    data.append(buf, static_cast<size_t>(n));
    pos += n;
  }
  ::close(fd);
  return data;
}

}  // namespace

bool is_eval_metric(const std::string& k) { return k.rfind("val_", 0) == 0 || k.rfind("acc", 0) == 0; }

ParsedMetrics parse_metrics_file(const std::filesystem::path& path, uint64_t offset) {
  ParsedMetrics out;
  out.next_offset = offset;
  const std::string data = read_from(path, offset);
  std::unordered_map<std::string, uint32_t> name_index;
  size_t pos = 0;
  LineSax sax;
  while (pos < data.size()) {
    const char* nl = static_cast<const char*>(std::memchr(data.data() + pos, '\n', data.size() - pos));
    if (!nl) break;  // torn last line: read again once the trainer finishes it
    const size_t end = static_cast<size_t>(nl - data.data());
    const size_t begin = pos;
    pos = end + 1;
    out.next_offset = offset + pos;
    if (end == begin) continue;  // empty line

    sax = LineSax{};
    json::sax_parse(data.begin() + static_cast<std::ptrdiff_t>(begin), data.begin() + static_cast<std::ptrdiff_t>(end), &sax);
    if (!sax.ok || !sax.is_object) {
      ++out.bad_lines;  // a complete but corrupt line can never become valid
      continue;
    }
    long step = 0;
    double tokens = kNaN, wall = kNaN;
    for (const auto& [k, v] : sax.fields) {
      if (k == "step") step = std::isfinite(v) ? static_cast<long>(v) : 0;
      else if (k == "tokens") tokens = v;
      else if (k == "wall_time") wall = v;
    }
    json eval = json::object();
    for (const auto& [k, v] : sax.fields) {
      if (k == "step" || k == "tokens" || k == "wall_time") continue;
      auto [it, inserted] = name_index.try_emplace(k, static_cast<uint32_t>(out.names.size()));
      if (inserted) out.names.push_back(k);
      out.rows.push_back({it->second, step, offset + begin, tokens, v, wall});
      if (is_eval_metric(k)) eval[k] = std::isfinite(v) ? json(v) : json();
    }
    if (!eval.empty()) out.evals.push_back({step, tokens, wall, canonical_dump(eval)});
  }
  return out;
}

}  // namespace lar::registry
