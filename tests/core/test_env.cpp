#include <gtest/gtest.h>

#include <cstdlib>

#include "core/env.hpp"
#include "core/error.hpp"

using namespace lar;

TEST(EnvNumber, UnsetOrEmptyIsTheFallbackAndAValueIsParsed) {
  ::unsetenv("LAR_TEST_ENV_NUMBER");
  EXPECT_EQ(env_number("LAR_TEST_ENV_NUMBER", 40, "seconds"), 40);
  ::setenv("LAR_TEST_ENV_NUMBER", "", 1);
  EXPECT_EQ(env_number("LAR_TEST_ENV_NUMBER", 40, "seconds"), 40);
  ::setenv("LAR_TEST_ENV_NUMBER", "2.5", 1);
  EXPECT_EQ(env_number("LAR_TEST_ENV_NUMBER", 40, "seconds"), 2.5);
  ::unsetenv("LAR_TEST_ENV_NUMBER");
}

TEST(EnvNumber, NotANumberNamesVariableValueAndUnit) {
  ::setenv("LAR_TEST_ENV_NUMBER", "soon", 1);
  try {
    env_number("LAR_TEST_ENV_NUMBER", 40, "MiB");
    FAIL() << "no error";
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(), "LAR_TEST_ENV_NUMBER=soon: not a number of MiB");
  }
  ::unsetenv("LAR_TEST_ENV_NUMBER");
}

namespace {
// The UserError message of f(), or "no error".
template <class F>
std::string user_error(F f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "no error";
}
struct ScopedVar {
  ScopedVar(const char* v) { v ? ::setenv(kName, v, 1) : ::unsetenv(kName); }
  ~ScopedVar() { ::unsetenv(kName); }
  static constexpr const char* kName = "LAR_TEST_ENV_VAR";
};
}  // namespace

TEST(EnvNumber, TrailingTextIsNotANumber) {
  ScopedVar v("40s");
  EXPECT_EQ(user_error([] { env_number(ScopedVar::kName, 1, "seconds"); }),
            "LAR_TEST_ENV_VAR=40s: not a number of seconds");
}

TEST(EnvString, UnsetAndEmptyAreAbsent) {
  {
    ScopedVar v(nullptr);
    EXPECT_FALSE(env_string(ScopedVar::kName).has_value());
    EXPECT_EQ(env_string(ScopedVar::kName, "dflt"), "dflt");
  }
  {
    ScopedVar v("");
    EXPECT_FALSE(env_string(ScopedVar::kName).has_value());
    EXPECT_EQ(env_string(ScopedVar::kName, "dflt"), "dflt");
  }
  ScopedVar v("/data/x y");
  EXPECT_EQ(env_string(ScopedVar::kName).value(), "/data/x y");
  EXPECT_EQ(env_string(ScopedVar::kName, "dflt"), "/data/x y");
}

TEST(EnvInt, ParsesWithinTheRangeAndNamesVariableAndValueOtherwise) {
  {
    ScopedVar v(nullptr);
    EXPECT_EQ(env_int(ScopedVar::kName, 25, 0, 100), 25);
  }
  {
    ScopedVar v("7");
    EXPECT_EQ(env_int(ScopedVar::kName, 25, 0, 100), 7);
  }
  {
    ScopedVar v("-3");
    EXPECT_EQ(env_int(ScopedVar::kName, 25, -5, 100), -3);
  }
  for (const char* bad : {"x", "7.5", "8x", "101", "-1", " ", "99999999999999999999"}) {
    ScopedVar v(bad);
    EXPECT_EQ(user_error([] { env_int(ScopedVar::kName, 25, 0, 100); }),
              std::string("LAR_TEST_ENV_VAR=") + bad + ": expected an integer from 0 to 100")
        << bad;
  }
}

TEST(EnvChoice, OneOfTheAllowedValues) {
  {
    ScopedVar v(nullptr);
    EXPECT_EQ(env_choice(ScopedVar::kName, {"a", "b"}, "a"), "a");
  }
  {
    ScopedVar v("b");
    EXPECT_EQ(env_choice(ScopedVar::kName, {"a", "b"}, "a"), "b");
  }
  ScopedVar v("c");
  EXPECT_EQ(user_error([] { env_choice(ScopedVar::kName, {"a", "b"}, "a"); }),
            "LAR_TEST_ENV_VAR=c: expected one of a, b");
}

TEST(EnvFlag, OneIsOnZeroIsOffAnythingElseIsAnError) {
  {
    ScopedVar v(nullptr);
    EXPECT_FALSE(env_flag(ScopedVar::kName));
    EXPECT_TRUE(env_flag(ScopedVar::kName, true));
  }
  {
    ScopedVar v("1");
    EXPECT_TRUE(env_flag(ScopedVar::kName));
  }
  {
    ScopedVar v("0");
    EXPECT_FALSE(env_flag(ScopedVar::kName, true));
  }
  for (const char* bad : {"yes", "true", "2", "on"}) {
    ScopedVar v(bad);
    EXPECT_EQ(user_error([] { env_flag(ScopedVar::kName); }), std::string("LAR_TEST_ENV_VAR=") + bad + ": expected 0 or 1")
        << bad;
  }
}
