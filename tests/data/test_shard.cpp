#include <gtest/gtest.h>

#include <fstream>

#include "core/error.hpp"
#include "tests/temp_dir.hpp"
#include "trainer/data/shard.hpp"

using namespace lar::data;

namespace {
std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}
void spit(const std::filesystem::path& p, const std::string& s) { std::ofstream(p, std::ios::binary) << s; }
template <class F>
std::string user_error(F f) {
  try {
    f();
  } catch (const lar::UserError& e) {
    return e.what();
  }
  return "(no UserError)";
}
}  // namespace

TEST(Shard, RoundTripUint16) {
  TempDir t;
  std::vector<int32_t> ids;
  for (int i = 0; i < 5000; ++i) ids.push_back((i * 37) % 256);
  {
    ShardWriter w(t.path / "a.bin", 256, "byte", "slice123");
    w.append(ids.data(), 1000);
    w.append(ids.data() + 1000, ids.size() - 1000);
    EXPECT_EQ(w.tokens(), 5000u);
    w.finish();
  }
  EXPECT_EQ(std::filesystem::file_size(t.path / "a.bin"), 128u + 2 * 5000);  // header 64 + strings, rounded to 128
  ShardReader r(t.path / "a.bin");
  EXPECT_EQ(r.size(), 5000u);
  EXPECT_EQ(r.info().dtype_bytes, 2u);
  EXPECT_EQ(r.info().vocab_size, 256u);
  EXPECT_EQ(r.info().tokenizer_id, "byte");
  EXPECT_EQ(r.info().slice_id, "slice123");
  for (int i = 0; i < 5000; ++i) ASSERT_EQ(r[i], ids[i]) << i;
  std::vector<int32_t> out(10);
  r.copy(4990, 10, out.data());
  EXPECT_EQ(out, std::vector<int32_t>(ids.begin() + 4990, ids.end()));
}

TEST(Shard, RoundTripUint32ForLargeVocab) {
  TempDir t;
  std::vector<int32_t> ids = {0, 65535, 65536, 99999, 7};
  EXPECT_EQ(dtype_for_vocab(65536), 2u);
  EXPECT_EQ(dtype_for_vocab(65537), 4u);
  ShardWriter w(t.path / "b.bin", 100000, "spm-abc", "s");
  w.append(ids);
  w.finish();
  ShardReader r(t.path / "b.bin");
  EXPECT_EQ(r.info().dtype_bytes, 4u);
  std::vector<int32_t> out(5);
  r.copy(0, 5, out.data());
  EXPECT_EQ(out, ids);
}

TEST(Shard, WriterRejectsIdOutsideVocab) {
  TempDir t;
  ShardWriter w(t.path / "c.bin", 256, "byte", "s");
  std::vector<int32_t> bad = {1, 256};
  EXPECT_THROW(w.append(bad), lar::RuntimeError);
}

TEST(Shard, HeaderValidation) {
  TempDir t;
  {
    ShardWriter w(t.path / "ok.bin", 256, "byte", "s");
    w.append(std::vector<int32_t>{1, 2, 3});
    w.finish();
  }
  const std::string good = slurp(t.path / "ok.bin");

  std::string bad_magic = good;
  bad_magic[0] = 'X';
  spit(t.path / "magic.bin", bad_magic);
  EXPECT_NE(user_error([&] { ShardReader r(t.path / "magic.bin"); }).find("magic.bin: not a lar token shard (bad magic"),
            std::string::npos);

  std::string bad_version = good;
  bad_version[8] = 9;
  spit(t.path / "version.bin", bad_version);
  EXPECT_NE(user_error([&] { ShardReader r(t.path / "version.bin"); }).find("unsupported shard version 9 (this lar reads version 1)"),
            std::string::npos);

  std::string bad_dtype = good;
  bad_dtype[12] = 3;
  spit(t.path / "dtype.bin", bad_dtype);
  EXPECT_NE(user_error([&] { ShardReader r(t.path / "dtype.bin"); }).find("bad token dtype 3"), std::string::npos);

  spit(t.path / "trunc.bin", good.substr(0, good.size() - 1));
  EXPECT_NE(user_error([&] { ShardReader r(t.path / "trunc.bin"); }).find("header says 3 tokens"), std::string::npos);

  spit(t.path / "tiny.bin", "LARS");
  EXPECT_NE(user_error([&] { ShardReader r(t.path / "tiny.bin"); }).find("not a lar token shard"), std::string::npos);

  EXPECT_NE(user_error([&] { ShardReader r(t.path / "absent.bin"); }).find("absent.bin: cannot open token shard"),
            std::string::npos);
}

TEST(Shard, UnfinishedWriterLeavesRejectedFile) {
  TempDir t;
  {
    ShardWriter w(t.path / "u.bin", 256, "byte", "s");
    w.append(std::vector<int32_t>(10, 5));
    // no finish()
  }
  EXPECT_NE(user_error([&] { ShardReader r(t.path / "u.bin"); }).find("u.bin: unfinished shard"), std::string::npos);
}

TEST(Shard, ReaderIsMovable) {
  TempDir t;
  {
    ShardWriter w(t.path / "m.bin", 256, "byte", "s");
    w.append(std::vector<int32_t>{9, 8, 7});
    w.finish();
  }
  std::vector<ShardReader> v;
  v.push_back(ShardReader(t.path / "m.bin"));
  v.push_back(ShardReader(t.path / "m.bin"));
  EXPECT_EQ(v[0][2], 7);
  EXPECT_EQ(v[1][0], 9);
}
