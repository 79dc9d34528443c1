#pragma once
// The one reader of lar's environment variables (docs/env.md lists every one). Whatever
// changes what a run computes is a run-config key instead (the `cuda` keys, `precision`,
// `deterministic`), recorded and hashed with the run; the environment keeps paths, the
// distributed rendezvous and its deadlines, and measuring switches.
//
// Every helper treats an unset or empty variable as absent (the fallback). A value it cannot
// read is a UserError (exit 2) naming the variable and the value: `LAR_X=v: expected …`.
#include <initializer_list>
#include <optional>
#include <string>

namespace lar {

// The value, or nullopt when unset or empty.
std::optional<std::string> env_string(const char* name);
// The value, or `fallback` when unset or empty.
std::string env_string(const char* name, const std::string& fallback);
// A number; `unit` names what is expected ("seconds", "MiB").
double env_number(const char* name, double fallback, const std::string& unit);
// An integer in [min, max].
long env_int(const char* name, long fallback, long min, long max);
// One of `allowed` (the fallback need not be one of them).
std::string env_choice(const char* name, std::initializer_list<const char*> allowed, const std::string& fallback);
// A switch: 1 is on, 0 is off.
bool env_flag(const char* name, bool fallback = false);

}  // namespace lar
