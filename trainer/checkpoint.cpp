#include "trainer/checkpoint.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/hash.hpp"

namespace lar::trainer {

namespace fs = std::filesystem;
namespace {
constexpr char kMagic[8] = {'L', 'A', 'R', 'C', 'K', 'P', 'T', '1'};
}

fs::path checkpoint_path(const fs::path& dir, long step) {
  char name[64];
  std::snprintf(name, sizeof name, "step_%08ld.ckpt", step);
  return dir / name;
}

std::vector<fs::path> list_checkpoints(const fs::path& dir) {
  std::vector<fs::path> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("step_", 0) == 0 && e.path().extension() == ".ckpt") out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());  // zero-padded step: lexical = numeric order
  return out;
}

void save_checkpoint(const fs::path& dir, const Checkpoint& ck, int keep) {
  fs::create_directories(dir);
  json header = {{"version", 1},
                 {"step", ck.step},
                 {"state", ck.state},
                 {"params_bytes", ck.params.size()},
                 {"optimizer_bytes", ck.optimizer.size()},
                 {"sha256", sha256_hex(ck.params + ck.optimizer)}};
  const std::string h = header.dump();
  std::string out;
  out.reserve(16 + h.size() + ck.params.size() + ck.optimizer.size());
  out.append(kMagic, 8);
  uint64_t n = h.size();
  out.append(reinterpret_cast<const char*>(&n), 8);
  out += h;
  out += ck.params;
  out += ck.optimizer;
  atomic_write(checkpoint_path(dir, ck.step), out);
  auto all = list_checkpoints(dir);
  for (std::size_t i = 0; i + std::max(keep, 1) < all.size(); ++i) fs::remove(all[i]);
}

Checkpoint read_checkpoint(const fs::path& file) {
  const std::string s = read_file(file);
  auto bad = [&](const std::string& why) { return RuntimeError("checkpoint " + file.string() + ": " + why); };
  if (s.size() < 16 || std::memcmp(s.data(), kMagic, 8) != 0) throw bad("not a lar checkpoint");
  uint64_t n = 0;
  std::memcpy(&n, s.data() + 8, 8);
  if (16 + n > s.size()) throw bad("truncated header");
  json header;
  try {
    header = json::parse(s.substr(16, n));
  } catch (const std::exception& e) {
    throw bad(std::string("bad header: ") + e.what());
  }
  const std::size_t pb = header.at("params_bytes").get<std::size_t>();
  const std::size_t ob = header.at("optimizer_bytes").get<std::size_t>();
  if (16 + n + pb + ob != s.size()) throw bad("size mismatch");
  Checkpoint ck;
  ck.step = header.at("step").get<long>();
  ck.state = header.at("state");
  ck.params = s.substr(16 + n, pb);
  ck.optimizer = s.substr(16 + n + pb, ob);
  if (sha256_hex(ck.params + ck.optimizer) != header.at("sha256").get<std::string>()) throw bad("checksum mismatch");
  return ck;
}

std::optional<Checkpoint> load_latest_checkpoint(const fs::path& dir, std::vector<std::string>* skipped) {
  auto all = list_checkpoints(dir);
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    try {
      return read_checkpoint(*it);
    } catch (const std::exception& e) {
      if (skipped) skipped->push_back(e.what());
    }
  }
  return std::nullopt;
}

}  // namespace lar::trainer
