#pragma once
// The schema of a run's config (what `lar train` reads, what every experiment cell
// resolves to). One declarative table: experiments/ validates specs against it (with
// file:line:col), the trainer fills defaults from it, `lar train --help-config` prints it.
// Adding a key = one line in config_schema.cpp.
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/json.hpp"

namespace lar {

enum class SchemaType { map, integer, number, boolean, string, enumeration, number_list, integer_list, number_or_learned };

struct SchemaNode {
  SchemaType type = SchemaType::map;
  json default_value;                 // null for maps
  std::vector<std::string> choices;   // for enumeration
  std::string doc;
  std::map<std::string, SchemaNode> children;  // for maps
};

const SchemaNode& config_schema();

// Locate the node for a dotted path ("model.architecture"); nullptr if unknown.
const SchemaNode* schema_lookup(const std::string& dotted_path);

struct SchemaIssue {
  std::string path;     // dotted path of the offending key or value
  std::string message;  // e.g. "unknown key 'lrr' (did you mean 'lr'?)"
  bool key_problem = false;  // true: the key is wrong; false: its value is
};

// Check a (partial) config: unknown keys, wrong types, values outside an enumeration.
std::vector<SchemaIssue> validate_config(const json& config);

// The config with every missing key filled from the schema's defaults.
json with_defaults(const json& config);

// Short axis names used in experiment matrices and run ids → config paths.
// ("architecture" → "model.architecture", "lr" → "optimizer.lr", …)
const std::map<std::string, std::string>& axis_aliases();
std::string resolve_axis(const std::string& axis);  // alias or the dotted path itself

// Human-readable listing of every key with type, default and doc.
std::string describe_schema();

std::string to_string(SchemaType t);

}  // namespace lar
