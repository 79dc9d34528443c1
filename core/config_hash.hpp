#pragma once
// A run's identity: the hash of its config. Every place that names a run by its config
// (the planner's cells, `lar train --config`, reproduce, the registry's adapter) hashes
// through here, so they agree.
#include <string>

#include "core/json.hpp"

namespace lar {

// The part of a (defaults-filled) config that names the run: the config without the `cuda`
// keys that sit at their defaults (an empty `cuda` map dropped too) and without
// `optimizer.zero_stage` (a layout of the optimiser state: same numbers). So a run planned
// before those keys existed keeps its hash, and only a run that asks for other kernels gets
// another.
json hashed_config(const json& config);
// SHA-256 (64 hex) of canonical_dump(hashed_config(config)).
std::string config_hash(const json& config);

}  // namespace lar
