#include "trainer/data/shard.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstring>

#include "core/error.hpp"

namespace lar::data {

static_assert(std::endian::native == std::endian::little, "token shards are little-endian; this build assumes a little-endian host");

namespace {

constexpr size_t kFixedHeader = 64;
constexpr size_t kBufferBytes = 1 << 20;

std::string errno_text() { return std::strerror(errno); }

template <class T>
void put(unsigned char* p, T v) { std::memcpy(p, &v, sizeof v); }
template <class T>
T get(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

uint32_t header_size_for(const std::string& tokenizer_id, const std::string& slice_id) {
  const size_t raw = kFixedHeader + tokenizer_id.size() + slice_id.size();
  return static_cast<uint32_t>((raw + 63) / 64 * 64);
}

std::vector<unsigned char> encode_header(const ShardInfo& h) {
  std::vector<unsigned char> out(header_size_for(h.tokenizer_id, h.slice_id), 0);
  std::memcpy(out.data(), kShardMagic, 8);
  put<uint32_t>(&out[8], h.version);
  put<uint32_t>(&out[12], h.dtype_bytes);
  put<uint64_t>(&out[16], h.tokens);
  put<uint32_t>(&out[24], h.vocab_size);
  put<uint32_t>(&out[28], static_cast<uint32_t>(out.size()));
  put<uint32_t>(&out[32], static_cast<uint32_t>(h.tokenizer_id.size()));
  put<uint32_t>(&out[36], static_cast<uint32_t>(h.slice_id.size()));
  std::memcpy(&out[kFixedHeader], h.tokenizer_id.data(), h.tokenizer_id.size());
  std::memcpy(&out[kFixedHeader + h.tokenizer_id.size()], h.slice_id.data(), h.slice_id.size());
  return out;
}

// Parse and validate a header against the file size. `bytes` holds at least the first
// min(file_size, header) bytes.
ShardInfo decode_header(const std::filesystem::path& path, const unsigned char* bytes, size_t available,
                        uint64_t file_size, uint32_t* header_bytes) {
  const std::string where = path.string() + ": ";
  if (available < kFixedHeader || std::memcmp(bytes, kShardMagic, 8) != 0)
    throw UserError(where + "not a lar token shard (bad magic; expected \"LARSHARD\")");
  ShardInfo h;
  h.version = get<uint32_t>(bytes + 8);
  if (h.version != kShardVersion)
    throw UserError(where + "unsupported shard version " + std::to_string(h.version) + " (this lar reads version " +
                    std::to_string(kShardVersion) + "); prepare the data again with `lar data prepare`");
  h.dtype_bytes = get<uint32_t>(bytes + 12);
  if (h.dtype_bytes != 2 && h.dtype_bytes != 4)
    throw UserError(where + "bad token dtype " + std::to_string(h.dtype_bytes) + " (expected 2 = uint16 or 4 = uint32)");
  h.tokens = get<uint64_t>(bytes + 16);
  h.vocab_size = get<uint32_t>(bytes + 24);
  const uint32_t hdr = get<uint32_t>(bytes + 28);
  const uint32_t tok_len = get<uint32_t>(bytes + 32), slice_len = get<uint32_t>(bytes + 36);
  if (hdr % 64 != 0 || hdr < kFixedHeader + uint64_t(tok_len) + slice_len || hdr > available)
    throw UserError(where + "corrupt shard header (header size " + std::to_string(hdr) + ")");
  if (h.tokens == UINT64_MAX)
    throw UserError(where + "unfinished shard (its writer never completed; prepare the data again)");
  if (file_size != hdr + h.tokens * h.dtype_bytes)
    throw UserError(where + "truncated or corrupt shard: header says " + std::to_string(h.tokens) + " tokens (" +
                    std::to_string(hdr + h.tokens * h.dtype_bytes) + " bytes) but the file has " +
                    std::to_string(file_size) + " bytes");
  h.tokenizer_id.assign(reinterpret_cast<const char*>(bytes + kFixedHeader), tok_len);
  h.slice_id.assign(reinterpret_cast<const char*>(bytes + kFixedHeader + tok_len), slice_len);
  *header_bytes = hdr;
  return h;
}

void write_all(int fd, const void* data, size_t n, const std::filesystem::path& path) {
  auto* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw RuntimeError("cannot write " + path.string() + ": " + errno_text());
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

}  // namespace

uint32_t dtype_for_vocab(uint64_t vocab_size) { return vocab_size <= 65536 ? 2 : 4; }

// ---------------------------------------------------------------------------------------
ShardWriter::ShardWriter(const std::filesystem::path& path, uint32_t vocab_size, const std::string& tokenizer_id,
                         const std::string& slice_id)
    : path_(path), vocab_(vocab_size), dtype_(dtype_for_vocab(vocab_size)) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) throw RuntimeError("cannot create " + path.string() + ": " + errno_text());
  ShardInfo h;
  h.dtype_bytes = dtype_;
  h.vocab_size = vocab_;
  h.tokenizer_id = tokenizer_id;
  h.slice_id = slice_id;
  // An unfinished shard says "all ones" tokens, which no file size can match, so a
  // writer that dies before finish() leaves a file every reader rejects.
  h.tokens = UINT64_MAX;
  auto hdr = encode_header(h);
  write_all(fd_, hdr.data(), hdr.size(), path_);
  buf_.reserve(kBufferBytes);
}

ShardWriter::~ShardWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void ShardWriter::append(const int32_t* ids, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const int32_t id = ids[i];
    if (id < 0 || static_cast<uint32_t>(id) >= vocab_)
      throw RuntimeError(path_.string() + ": token id " + std::to_string(id) + " outside the vocabulary [0, " +
                         std::to_string(vocab_) + ")");
    unsigned char b[4];
    if (dtype_ == 2) {
      put<uint16_t>(b, static_cast<uint16_t>(id));
    } else {
      put<uint32_t>(b, static_cast<uint32_t>(id));
    }
    buf_.insert(buf_.end(), b, b + dtype_);
    if (buf_.size() >= kBufferBytes) flush_buffer();
  }
  count_ += n;
}

void ShardWriter::flush_buffer() {
  write_all(fd_, buf_.data(), buf_.size(), path_);
  buf_.clear();
}

void ShardWriter::finish() {
  if (fd_ < 0) return;
  flush_buffer();
  unsigned char cnt[8];
  put<uint64_t>(cnt, count_);
  if (::pwrite(fd_, cnt, 8, 16) != 8) throw RuntimeError("cannot write " + path_.string() + ": " + errno_text());
  if (::fsync(fd_) != 0) throw RuntimeError("cannot fsync " + path_.string() + ": " + errno_text());
  ::close(fd_);
  fd_ = -1;
}

// ---------------------------------------------------------------------------------------
ShardReader::ShardReader(const std::filesystem::path& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw UserError(path.string() + ": cannot open token shard: " + errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    throw RuntimeError("cannot stat " + path.string() + ": " + errno_text());
  }
  map_bytes_ = static_cast<size_t>(st.st_size);
  if (map_bytes_ < kFixedHeader) {
    ::close(fd);
    throw UserError(path.string() + ": not a lar token shard (bad magic; expected \"LARSHARD\"; file has only " +
                    std::to_string(map_bytes_) + " bytes)");
  }
  map_ = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);  // the mapping keeps the file alive
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    throw RuntimeError("cannot mmap " + path.string() + ": " + errno_text());
  }
  try {
    uint32_t hdr = 0;
    info_ = decode_header(path, static_cast<const unsigned char*>(map_), map_bytes_, map_bytes_, &hdr);
    data_ = static_cast<const unsigned char*>(map_) + hdr;
  } catch (...) {
    ::munmap(map_, map_bytes_);
    map_ = nullptr;
    throw;
  }
  // Training reads random windows; tell the kernel not to read ahead wastefully.
  ::madvise(map_, map_bytes_, MADV_RANDOM);
}

ShardReader::ShardReader(ShardReader&& o) noexcept
    : path_(std::move(o.path_)), info_(std::move(o.info_)), map_(o.map_), map_bytes_(o.map_bytes_), data_(o.data_) {
  o.map_ = nullptr;
  o.data_ = nullptr;
  o.map_bytes_ = 0;
}

ShardReader::~ShardReader() {
  if (map_) ::munmap(map_, map_bytes_);
}

void ShardReader::copy(uint64_t begin, uint64_t n, int32_t* out) const {
  if (info_.dtype_bytes == 2) {
    const auto* p = static_cast<const uint16_t*>(data_) + begin;
    for (uint64_t i = 0; i < n; ++i) out[i] = p[i];
  } else {
    const auto* p = static_cast<const uint32_t*>(data_) + begin;
    for (uint64_t i = 0; i < n; ++i) out[i] = static_cast<int32_t>(p[i]);
  }
}

ShardInfo read_shard_info(const std::filesystem::path& path) {
  ShardReader r(path);
  return r.info();
}

}  // namespace lar::data
