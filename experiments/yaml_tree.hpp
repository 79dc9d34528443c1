#pragma once
// A small immutable YAML tree that remembers where every node came from.
//
// yaml-cpp's Node API drops duplicate keys silently and gives no typed scalars, so specs
// are read through yaml-cpp's event parser into this tree instead: every node carries
// its file:line:col, a duplicate key is an error at its second occurrence, and scalars
// are typed by the YAML 1.2 core schema (3e-4 is a number, "3e-4" a string).
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "core/json.hpp"

namespace lar::experiments {

struct YNode;
using YPtr = std::shared_ptr<const YNode>;

struct YNode {
  enum class Kind { null, scalar, seq, map };
  Kind kind = Kind::null;
  std::string text;      // scalar text (as written, without quotes)
  bool plain = true;     // an unquoted, untagged scalar (typed by the core schema)
  std::string tag;       // explicit tag of a scalar, e.g. "tag:yaml.org,2002:str"
  SourceLoc loc;         // 1-based
  std::vector<YPtr> items;                     // seq
  std::vector<std::pair<YPtr, YPtr>> entries;  // map: key (scalar) → value, in file order

  bool is_map() const { return kind == Kind::map; }
  bool is_seq() const { return kind == Kind::seq; }
  bool is_scalar() const { return kind == Kind::scalar; }
  bool is_null() const { return kind == Kind::null; }
  // Map lookup by key text; nullptr when absent (or not a map).
  const YNode* get(std::string_view key) const;
  const std::pair<YPtr, YPtr>* entry(std::string_view key) const;
  // The typed value of a scalar (null, bool, integer, float or string); whole subtree
  // for maps and sequences.
  json to_json() const;
  // "a map", "a list", "the string 'x'", "the number 3" — for error messages.
  std::string describe() const;
};

// Parse one YAML document. `display_name` is the file name used in locations.
// Throws UserError on unreadable files, YAML syntax errors, duplicate keys, several
// documents, anchors/aliases misuse and merge keys ('<<').
YPtr parse_yaml_file(const std::filesystem::path& path, const std::string& display_name);
YPtr parse_yaml_string(const std::string& text, const std::string& display_name);

// Typed value of a plain scalar by the YAML 1.2 core schema.
json scalar_value(const std::string& text, bool plain, const std::string& tag);

// Deep merge for `extends:`: maps merge key by key (overlay wins), everything else
// (lists, scalars) is replaced by the overlay.
YPtr deep_merge(const YPtr& base, const YPtr& overlay);

}  // namespace lar::experiments
