#pragma once
// JSON is nlohmann::json. Its default object type is a std::map, so keys are always
// sorted, and numbers print as the shortest text that reads back to the same double:
// `canonical_dump` is therefore a stable serialisation across machines and the basis
// of every config hash.
#include <nlohmann/json.hpp>
#include <string>

namespace lar {
using json = nlohmann::json;

// Compact, sorted keys, integers kept as integers, floats shortest round-trip, UTF-8.
inline std::string canonical_dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::strict); }
}  // namespace lar
