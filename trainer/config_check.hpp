#pragma once
// The one set of rules a run config must satisfy. `lar train` applies it before it trains;
// `lar plan`, `lar launch` and `lar reproduce` apply it to every cell of a spec before
// anything is written, so that a mistake is reported at the spec line that made it
// instead of as one failed run per cell (docs/specs.md, "Validation").
#include <string>
#include <vector>

#include "core/json.hpp"

namespace lar::trainer {

struct CheckOptions {
  // false: an lm config whose prepared shards are not on this machine is not an error
  // (planning for a cluster, or before `lar data prepare`); a note says so instead.
  bool require_data = true;
};

// Every check that depends on the config alone: value ranges, shape consistency, the
// layer kinds and their options (architecture × stack × routing × CCQ × CARVE), the
// optimiser, the schedule, the batch split and what the data needs. `config` has the
// schema's defaults filled in and passes validate_config. Throws UserError whose message
// names the offending keys by their dotted paths (config_keys_named finds them); returns
// the notes that are not errors. What depends on the machine (the backend built here,
// the GPU present) is checked where the run starts (prepare_config).
std::vector<std::string> check_config(const json& config, const CheckOptions& options = {});

// The data part of check_config alone, and the part of a config it reads: cells with equal
// data_check_key pass or fail check_data alike (a plan checks each distinct one once).
std::vector<std::string> check_data(const json& config, const CheckOptions& options = {});
json data_check_key(const json& config);
void check_config_without_data(const json& config);

// The config keys (dotted schema paths, e.g. "model.n_heads") a message names, in order
// of first appearance. Every message of check_config starts with the key it is about.
std::vector<std::string> config_keys_named(const std::string& message);

}  // namespace lar::trainer
