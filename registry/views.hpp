#pragma once
// How runs are shown: JSON renderings of registry records and small helpers shared by
// `lar runs/show/compare/metrics` (and anything else that prints runs).
#include <map>
#include <string>
#include <vector>

#include "core/json.hpp"
#include "registry/registry.hpp"

namespace lar::registry {

json to_json(const RunRecord& r);          // every field; config only when loaded
json to_json(const MetricPoint& p);        // NaN → null
json to_json(const StatusEvent& e);

// {"a": {"b": 1}} → {"a.b": 1}; arrays and scalars are leaves.
std::map<std::string, json> flatten(const json& j);

// A JSON value as a table cell: strings unquoted, numbers compact, null → "-".
std::string cell_text(const json& v);

// "completed,failed" or repeated values → states; UserError with did-you-mean otherwise.
std::vector<RunState> parse_states(const std::vector<std::string>& words);

// Output formats of the listing commands; UserError naming the value when unknown.
enum class OutputFormat { table, csv, json };
OutputFormat parse_format(const std::string& s, const std::vector<std::string>& allowed = {"table", "csv", "json"});

}  // namespace lar::registry
