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
