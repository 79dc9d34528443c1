#include <gtest/gtest.h>

#include "core/config_schema.hpp"
#include "core/hash.hpp"

using namespace lar;

TEST(ConfigSchema, DefaultsFillEveryKey) {
  json c = with_defaults(json::object());
  EXPECT_EQ(c["model"]["architecture"], "softmax");
  EXPECT_EQ(c["optimizer"]["ns_coefficients"].size(), 3u);
  EXPECT_DOUBLE_EQ(c["optimizer"]["ns_coefficients"][0].get<double>(), 3.4445);
  EXPECT_EQ(c["model"]["ccq"]["lambda"], "learned");
  EXPECT_TRUE(validate_config(c).empty());
}

TEST(ConfigSchema, UnknownKeyGetsDidYouMean) {
  auto issues = validate_config(json{{"optimizer", {{"lrr", 1e-3}}}});
  ASSERT_EQ(issues.size(), 1u);
  EXPECT_EQ(issues[0].path, "optimizer.lrr");
  EXPECT_TRUE(issues[0].key_problem);
  EXPECT_EQ(issues[0].message, "unknown key 'lrr' (did you mean 'lr'?)");
}

TEST(ConfigSchema, EnumerationAndTypeErrors) {
  auto issues = validate_config(json{{"model", {{"architecture", "gdnn"}, {"d_model", "big"}}}});
  ASSERT_EQ(issues.size(), 2u);
  EXPECT_EQ(issues[0].path, "model.architecture");
  EXPECT_NE(issues[0].message.find("did you mean 'gdn'?"), std::string::npos);
  EXPECT_EQ(issues[1].path, "model.d_model");
  EXPECT_EQ(issues[1].message, "expected integer, got \"big\"");
}

TEST(ConfigSchema, AxisAliases) {
  EXPECT_EQ(resolve_axis("lr"), "optimizer.lr");
  EXPECT_EQ(resolve_axis("model.window"), "model.window");
  EXPECT_NE(schema_lookup("model.carve.content_rank"), nullptr);
  EXPECT_EQ(schema_lookup("model.nope"), nullptr);
}

TEST(Hash, Sha256KnownVector) {
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(CanonicalJson, SortedKeysAndShortestFloats) {
  json a = json::parse(R"({"b": 0.1, "a": 3e-4, "c": 1})");
  EXPECT_EQ(canonical_dump(a), R"({"a":0.0003,"b":0.1,"c":1})");
}
