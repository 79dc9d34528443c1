#pragma once
// Token shards (docs/spec.md §6): one binary file holds a run of token ids behind a small header.
// Readers memory-map the file, so a corpus larger than RAM costs nothing until touched.
//
// Layout, little-endian (docs/data.md):
//   offset  size  field
//        0     8  magic "LARSHARD"
//        8     4  format version (kShardVersion)
//       12     4  dtype = bytes per token: 2 (uint16) or 4 (uint32)
//       16     8  token count
//       24     4  vocab size of the tokenizer (every token id is below it)
//       28     4  header size in bytes = offset of the first token (a multiple of 64)
//       32     4  length of the tokenizer id string
//       36     4  length of the data-slice id string
//       40    24  reserved, zero
//       64     …  tokenizer id, then slice id (UTF-8, no terminators), zero padding
//   header size   token ids, `token count` of them, each `dtype` bytes
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace lar::data {

inline constexpr char kShardMagic[8] = {'L', 'A', 'R', 'S', 'H', 'A', 'R', 'D'};
inline constexpr uint32_t kShardVersion = 1;

struct ShardInfo {
  uint32_t version = kShardVersion;
  uint32_t dtype_bytes = 2;  // 2 = uint16, 4 = uint32
  uint64_t tokens = 0;
  uint32_t vocab_size = 0;
  std::string tokenizer_id;
  std::string slice_id;
};

// The narrowest dtype that holds every id below `vocab_size`.
uint32_t dtype_for_vocab(uint64_t vocab_size);

// Streams tokens into a new shard file. The token count is patched into the header by
// finish(); until then it reads UINT64_MAX, so a writer destroyed without finish()
// leaves a file that every reader rejects as unfinished.
class ShardWriter {
 public:
  ShardWriter(const std::filesystem::path& path, uint32_t vocab_size, const std::string& tokenizer_id,
              const std::string& slice_id);
  ~ShardWriter();
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  void append(const int32_t* ids, size_t n);  // RuntimeError for an id outside the vocab
  void append(const std::vector<int32_t>& ids) { append(ids.data(), ids.size()); }
  uint64_t tokens() const { return count_; }
  void finish();  // patch the header, flush, fsync, close

 private:
  void flush_buffer();
  std::filesystem::path path_;
  int fd_ = -1;
  uint32_t vocab_ = 0, dtype_ = 2;
  uint64_t count_ = 0;
  std::vector<unsigned char> buf_;
};

// Read-only memory map of one shard. Throws UserError naming the file for anything that
// is not a complete shard of a version this build reads.
class ShardReader {
 public:
  explicit ShardReader(const std::filesystem::path& path);
  ~ShardReader();
  ShardReader(ShardReader&& other) noexcept;
  ShardReader& operator=(ShardReader&&) = delete;
  ShardReader(const ShardReader&) = delete;
  ShardReader& operator=(const ShardReader&) = delete;

  const ShardInfo& info() const { return info_; }
  const std::filesystem::path& path() const { return path_; }
  uint64_t size() const { return info_.tokens; }
  int32_t operator[](uint64_t i) const {
    return info_.dtype_bytes == 2 ? static_cast<const uint16_t*>(data_)[i] : static_cast<int32_t>(static_cast<const uint32_t*>(data_)[i]);
  }
  // Copy tokens [begin, begin+n) into out (bounds are the caller's duty).
  void copy(uint64_t begin, uint64_t n, int32_t* out) const;

 private:
  std::filesystem::path path_;
  ShardInfo info_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const void* data_ = nullptr;
};

// Header alone (no mapping of the tokens): for `lar data info` and validation.
ShardInfo read_shard_info(const std::filesystem::path& path);

}  // namespace lar::data
