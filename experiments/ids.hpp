#pragma once
// How axis values appear in cell ids (docs/specs.md): `lr` → lr3e-4, `seed` → s0,
// other numeric axes → <axis><value>, strings → the value, booleans → <axis> / no<axis>.
#include <string>

#include "core/json.hpp"

namespace lar::experiments {

// Shortest text of a number that reads back to the same double, in the shorter of
// fixed or exponent notation with a bare exponent: 0.0003 → "3e-4", 0.01 → "0.01",
// 1000.0 → "1e3", 2.5 → "2.5".
std::string id_number(double x);

// The id part of `value` on an axis named `name` (as written in the matrix; a dotted
// name contributes its last component) for config path `path`.
std::string id_part(const std::string& name, const std::string& path, const json& value);

}  // namespace lar::experiments
