#pragma once
// Numeric tunables read from the environment (LAR_DIST_TIMEOUT, LAR_DIST_BUCKET_MB, ...).
#include <string>

namespace lar {

// The value of the environment variable `name` as a number, or `fallback` when it is unset
// or empty. A value that is not a number is a UserError naming the variable, the value and
// the unit expected ("seconds", "MiB").
double env_number(const char* name, double fallback, const std::string& unit);

}  // namespace lar
