// load_plan: spec file → validated, expanded Plan (docs/specs.md).
//
// The work is split so that nothing per cell repeats what can be done once:
//   * base ⊕ scale is validated and filled with schema defaults once (the "template");
//   * every axis value is validated, type-normalised, id-formatted and dumped once;
//   * a matrix cell = template + leaf values at the axis paths. Since the schema is a
//     fixed tree of maps and every axis path is a leaf present in the template, setting
//     leaves is exactly what with_defaults(base ⊕ scale ⊕ axes) would produce, and the
//     canonical dump of a cell is the template's dump with the axis values' dumps
//     spliced in. Hashing therefore needs no per-cell serialisation of the whole tree.
#include <openssl/evp.h>

#include <algorithm>
#include <functional>
#include <map>
#include <regex>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "core/config_hash.hpp"
#include "core/config_schema.hpp"
#include "experiments/cell.hpp"
#include "experiments/ids.hpp"
#include "experiments/yaml_tree.hpp"
#include "trainer/config_check.hpp"

namespace lar::experiments {

namespace fs = std::filesystem;

namespace {

// ---------------------------------------------------------------- small helpers

// SHA-256 hex like core's sha256_hex, for the per-cell loop: the digest and its context
// are fetched once instead of per call (a third of the hashing time at 100,000 cells).
class Sha256 {
 public:
  Sha256() : md_(EVP_MD_fetch(nullptr, "SHA256", nullptr)), ctx_(EVP_MD_CTX_new()) {
    if (!md_ || !ctx_) throw RuntimeError("OpenSSL: SHA-256 unavailable");
  }
  ~Sha256() {
    EVP_MD_CTX_free(ctx_);
    EVP_MD_free(md_);
  }
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  std::string hex(std::string_view bytes) {
    unsigned char digest[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    if (EVP_DigestInit_ex2(ctx_, md_, nullptr) != 1 || EVP_DigestUpdate(ctx_, bytes.data(), bytes.size()) != 1 ||
        EVP_DigestFinal_ex(ctx_, digest, &len) != 1)
      throw RuntimeError("OpenSSL: SHA-256 failed");
    static const char* digits = "0123456789abcdef";
    std::string out(2 * len, '0');
    for (unsigned i = 0; i < len; ++i) {
      out[2 * i] = digits[digest[i] >> 4];
      out[2 * i + 1] = digits[digest[i] & 15];
    }
    return out;
  }

 private:
  EVP_MD* md_;
  EVP_MD_CTX* ctx_;
};

[[noreturn]] void fail(const SourceLoc& loc, const std::string& msg) { throw UserError(loc, msg); }

std::string line_col(const SourceLoc& l) { return std::to_string(l.line) + ":" + std::to_string(l.column); }

std::string with_hint(std::string msg, const std::string& word, const std::vector<std::string>& candidates) {
  std::string hint = did_you_mean(word, candidates);
  if (!hint.empty()) msg += " (" + hint + ")";
  return msg;
}

std::string join(const std::vector<std::string>& v, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

const YNode& expect_map(const YNode& n, const std::string& what) {
  if (!n.is_map()) fail(n.loc, what + ": expected a map, got " + n.describe());
  return n;
}

const YNode& expect_seq(const YNode& n, const std::string& what) {
  if (!n.is_seq()) fail(n.loc, what + ": expected a list, got " + n.describe());
  return n;
}

std::string expect_string(const YNode& n, const std::string& what) {
  if (!n.is_scalar() || !n.to_json().is_string()) fail(n.loc, what + ": expected a string, got " + n.describe());
  return n.text;
}

void check_keys(const YNode& map, const std::vector<std::string>& allowed, const std::string& what) {
  for (const auto& [k, v] : map.entries)
    if (std::find(allowed.begin(), allowed.end(), k->text) == allowed.end())
      fail(k->loc, with_hint(what + ": unknown key '" + k->text + "'", k->text, allowed));
}

std::vector<std::string> split_path(const std::string& dotted) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    size_t dot = dotted.find('.', start);
    parts.push_back(dotted.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return parts;
}

json nest(const std::vector<std::string>& parts, const json& leaf) {
  json v = leaf;
  for (size_t i = parts.size(); i-- > 0;) {
    json o = json::object();
    o[parts[i]] = std::move(v);
    v = std::move(o);
  }
  return v;
}

void set_leaf(json& root, const std::vector<std::string>& parts, const json& value) {
  json* p = &root;
  for (size_t i = 0; i + 1 < parts.size(); ++i) p = &(*p)[parts[i]];
  (*p)[parts.back()] = value;
}

const json* get_leaf(const json& root, const std::vector<std::string>& parts) {
  const json* p = &root;
  for (const auto& k : parts) {
    if (!p->is_object()) return nullptr;
    auto it = p->find(k);
    if (it == p->end()) return nullptr;
    p = &*it;
  }
  return p;
}

void merge_json(json& into, const json& over) {
  if (!into.is_object() || !over.is_object()) {
    into = over;
    return;
  }
  for (const auto& [k, v] : over.items()) {
    if (into.contains(k))
      merge_json(into[k], v);
    else
      into[k] = v;
  }
}

// Integers stay integers and numbers become floats, so `lr: 1` and `lr: 1.0` (or
// `steps: 100.0` and `steps: 100`) give the same canonical text and the same hash.
void normalize(json& v, const SchemaNode& n) {
  switch (n.type) {
    case SchemaType::map:
      if (v.is_object())
        for (auto& [k, sub] : v.items()) {
          auto it = n.children.find(k);
          if (it != n.children.end()) normalize(sub, it->second);
        }
      break;
    case SchemaType::integer:
      if (v.is_number_float()) v = static_cast<long long>(v.get<double>());
      break;
    case SchemaType::number:
    case SchemaType::number_or_learned:
      if (v.is_number_integer()) v = static_cast<double>(v.get<long long>());
      break;
    case SchemaType::number_list:
      if (v.is_array())
        for (auto& e : v)
          if (e.is_number_integer()) e = static_cast<double>(e.get<long long>());
      break;
    default: break;
  }
}

void all_leaf_paths(const SchemaNode& n, const std::string& prefix, std::vector<std::string>& out) {
  for (const auto& [k, c] : n.children) {
    std::string p = prefix.empty() ? k : prefix + "." + k;
    if (c.type == SchemaType::map)
      all_leaf_paths(c, p, out);
    else
      out.push_back(p);
  }
}

const std::vector<std::string>& axis_candidates() {
  static const std::vector<std::string> c = [] {
    std::vector<std::string> v;
    for (const auto& [k, p] : axis_aliases()) v.push_back(k);
    all_leaf_paths(config_schema(), "", v);
    return v;
  }();
  return c;
}

// Validate a YAML config fragment (base, a scale's base) with core's schema and report
// the first issue at the offending key or value. `section` prefixes the message.
json validated_config(const YNode* node, const std::string& section) {
  if (!node || node->is_null()) return json::object();
  expect_map(*node, section);
  json j = node->to_json();
  auto issues = validate_config(j);
  if (!issues.empty()) {
    const auto& is = issues.front();
    auto parts = split_path(is.path);
    // Walk to the offending key (and value).
    const YNode* map = node;
    const std::pair<YPtr, YPtr>* e = nullptr;
    for (const auto& part : parts) {
      if (!map || !map->is_map()) break;
      e = map->entry(part);
      if (!e) break;
      map = e->second.get();
    }
    SourceLoc loc = node->loc;
    if (e) loc = is.key_problem ? e->first->loc : e->second->loc;
    std::string parent = section;
    for (size_t i = 0; i + 1 < parts.size(); ++i) parent += "." + parts[i];
    std::string where = is.key_problem ? parent : section + "." + is.path;
    fail(loc, where + ": " + is.message);
  }
  normalize(j, config_schema());
  return j;
}

// One leaf value (axis value, include override, match value): validate at `path` and
// normalise its type. `what` names it in messages (e.g. "matrix.lr").
json leaf_value(const std::vector<std::string>& parts, const YNode& node, const std::string& what) {
  json v = node.to_json();
  auto issues = validate_config(nest(parts, v));
  if (!issues.empty()) fail(node.loc, what + ": " + issues.front().message);
  const SchemaNode* s = &config_schema();
  for (const auto& p : parts) s = &s->children.at(p);
  normalize(v, *s);
  return v;
}

// "unknown axis 'lrr' (did you mean 'lr'?)" or a group-of-keys message; nullptr-free
// resolution of an axis / match key to a schema leaf path.
std::string resolve_leaf(const YNode& key, const std::string& what, const std::string& noun) {
  std::string path = resolve_axis(key.text);
  const SchemaNode* s = schema_lookup(path);
  if (!s) fail(key.loc, with_hint(what + ": unknown " + noun + " '" + key.text + "'", key.text, axis_candidates()));
  if (s->type == SchemaType::map) {
    std::vector<std::string> sub;
    all_leaf_paths(*s, path, sub);
    fail(key.loc, what + ": '" + key.text + "' is a group of settings, not one value; use one of " + join(sub, ", "));
  }
  return path;
}

// ---------------------------------------------------------------- spec tree (extends)

YPtr without_key(const YPtr& map, const std::string& key) {
  if (!map->entry(key)) return map;
  auto out = std::make_shared<YNode>(*map);
  out->entries.erase(std::remove_if(out->entries.begin(), out->entries.end(),
                                    [&](const auto& e) { return e.first->text == key; }),
                     out->entries.end());
  return out;
}

struct Chain {
  std::vector<std::pair<fs::path, std::string>> files;  // canonical path, display name
};

YPtr load_tree(const fs::path& path, const std::string& display, Chain& chain, const SourceLoc* from) {
  fs::path canon = fs::weakly_canonical(path);
  for (size_t i = 0; i < chain.files.size(); ++i)
    if (chain.files[i].first == canon) {
      std::string cycle;
      for (size_t j = i; j < chain.files.size(); ++j) cycle += chain.files[j].second + " -> ";
      fail(*from, "extends cycle: " + cycle + display);
    }
  if (from && !fs::is_regular_file(path)) fail(*from, "extends: cannot read '" + display + "'");
  YPtr root = parse_yaml_file(path, display);
  if (!root->is_map()) fail(root->loc, "a spec is a map of keys (name, base, matrix, ...), got " + root->describe());
  const auto* ext = root->entry("extends");
  if (!ext) return root;
  std::string rel = expect_string(*ext->second, "extends");
  fs::path parent = path.parent_path() / rel;
  std::string parent_display = (fs::path(display).parent_path() / rel).lexically_normal().string();
  chain.files.emplace_back(canon, display);
  YPtr base = load_tree(parent, parent_display, chain, &ext->second->loc);
  chain.files.pop_back();
  return deep_merge(without_key(base, "extends"), without_key(root, "extends"));
}

// ---------------------------------------------------------------- the model

struct AxisValue {
  json value;
  SourceLoc loc;       // where it was first written
  std::string id_part;
  std::string dump;    // canonical_dump(value)
};

struct ValueList {
  std::vector<int> vids;
  SourceLoc loc;
  std::string what;  // "matrix.lr" or "matrix.lr.adamw"
};

struct Axis {
  std::string name;                // as written in the matrix
  std::string path;                // resolved dotted config path
  std::vector<std::string> parts;
  SourceLoc key_loc, value_loc;
  std::vector<AxisValue> values;   // distinct values, interned (vid = index)
  std::vector<ValueList> lists;    // plain axis: lists[0]; conditional: one per branch (+ default)
  int by = -1;                     // conditional on this (earlier) axis
  std::vector<std::pair<const YNode*, int>> branches;  // branch key node → list index
  int default_list = -1;
  std::vector<int> list_cache;     // by-axis vid → list index (-1 none, -2 unknown)
  int zip = -1;
};

struct ZipGroup {
  std::vector<int> axes;  // in matrix order
  SourceLoc loc;
  std::string text;       // "[lr, schedule.warmup_steps]"
};

struct Override {
  std::vector<std::string> parts;
  json value;
  SourceLoc loc;
  std::string id_part;
};

struct Include {
  SourceLoc loc;
  std::string what;                        // "include[0]"
  std::vector<std::pair<int, int>> pins;   // axis → vid
  std::vector<Override> overrides;
};

struct Cond {
  int axis = -1;                      // or a config path:
  std::vector<std::string> parts;
  std::vector<json> values;
  std::vector<char> accept;           // by vid (axis conditions)
};

struct Matcher {
  std::vector<Cond> conds;
  SourceLoc loc;
  std::string what;
  int matched = 0;
};

struct CellDraft {
  size_t at = 0;     // its axis values (vids, one per axis) start at Builder::flat_[at]
  int include = -1;  // index into includes, -1 for matrix cells
};

std::string value_text(const json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); }

class Builder {
 public:
  Builder(const fs::path& spec, const std::string& scale, const LoadOptions& options)
      : spec_path_(spec), scale_arg_(scale), options_(options) {}

  Plan build() {
    Chain chain;
    root_ = load_tree(spec_path_, spec_path_.string(), chain, nullptr);
    file_ = spec_path_.string();
    check_keys(*root_, {"name", "description", "base", "matrix", "zip", "exclude", "include", "scales",
                        "default_scale", "roles", "baselines", "reference", "claims"},
               "spec");
    plan_.spec_path = spec_path_;
    read_name();
    select_scale();
    read_base();
    read_axes();
    read_zip();
    read_includes();
    check_branch_keys();
    read_matchers();
    expand_matrix();
    expand_includes();
    if (drafts_.empty()) fail(matrix_loc(), "the matrix expands to zero cells");
    make_cells();
    if (options_.check) check_cells();
    apply_roles();
    apply_baselines();
    apply_reference();
    if (const YNode* claims = root_->get("claims")) plan_.claims = parse_claims(*claims, plan_, metric_names_);
    warn_unmatched();
    return std::move(plan_);
  }

 private:
  // ---------------------------------------------------------------- header
  void read_name() {
    const YNode* n = root_->get("name");
    if (!n) fail(SourceLoc{file_, 1, 1}, "missing 'name' (the experiment name)");
    std::string name = expect_string(*n, "name");
    static const std::regex ok("[a-z0-9_.-]+");
    if (!std::regex_match(name, ok)) fail(n->loc, "name '" + name + "' may only hold a-z, 0-9, '_', '.', '-'");
    plan_.experiment = name;
    plan_.meta = json::object();
    if (const YNode* d = root_->get("description")) plan_.meta["description"] = expect_string(*d, "description");
  }

  void select_scale() {
    const YNode* scales = root_->get("scales");
    const YNode* dflt = root_->get("default_scale");
    std::vector<std::string> names;
    SourceLoc scales_loc = scales ? root_->entry("scales")->first->loc : SourceLoc{};
    if (scales) {
      expect_map(*scales, "scales");
      for (const auto& [k, v] : scales->entries) {
        names.push_back(k->text);
        expect_map(*v, "scales." + k->text);
        check_keys(*v, {"base", "matrix"}, "scales." + k->text);
      }
      plan_.meta["scales"] = names;
    }
    if (dflt) {
      std::string d = expect_string(*dflt, "default_scale");
      if (std::find(names.begin(), names.end(), d) == names.end())
        fail(dflt->loc, with_hint("default_scale: '" + d + "' is not a scale" +
                                      (names.empty() ? std::string(" (the spec declares none)") : " (scales: " + join(names, ", ") + ")"),
                                  d, names));
      plan_.meta["default_scale"] = d;
    }
    std::string s = scale_arg_;
    if (s.empty() && dflt) s = dflt->text;
    if (s.empty()) {
      if (scales && !names.empty())
        fail(scales_loc, "choose a scale with --scale (scales: " + join(names, ", ") + ") or set default_scale");
      return;
    }
    if (!scales) fail(SourceLoc{file_, 1, 1}, "unknown scale '" + s + "': the spec declares no scales");
    if (std::find(names.begin(), names.end(), s) == names.end())
      fail(scales_loc, with_hint("unknown scale '" + s + "' (scales: " + join(names, ", ") + ")", s, names));
    plan_.scale = s;
    scale_node_ = scales->get(s);
  }

  void read_base() {
    json base = validated_config(root_->get("base"), "base");
    record_set_at(root_->get("base"), "", kSetByBase);
    if (scale_node_) {
      json over = validated_config(scale_node_->get("base"), "scales." + plan_.scale + ".base");
      merge_json(base, over);
      record_set_at(scale_node_->get("base"), "", kSetByScale);
    }
    template_ = with_defaults(base);
    normalize(template_, config_schema());
    auto issues = validate_config(template_);  // defaults + validated parts: must be clean
    if (!issues.empty()) throw RuntimeError("internal: resolved base config invalid at " + issues.front().path);
  }

  // Where each leaf of the template was written (base, possibly in an extended file, or
  // the scale's base), so that a cell's error points at the line that set the value.
  void record_set_at(const YNode* node, const std::string& prefix, int level) {
    if (!node || !node->is_map()) return;
    for (const auto& [k, v] : node->entries) {
      const std::string path = prefix.empty() ? k->text : prefix + "." + k->text;
      const SchemaNode* s = schema_lookup(path);
      if (!s) continue;
      if (s->type == SchemaType::map)
        record_set_at(v.get(), path, level);
      else  // the spec's own base outranks the file it extends
        template_set_at_[path] = {v->loc, level == kSetByBase && v->loc.file != file_ ? kSetByExtended : level};
    }
  }

  SourceLoc matrix_loc() const {
    const auto* e = root_->entry("matrix");
    return e ? e->first->loc : SourceLoc{file_, 1, 1};
  }

  // ---------------------------------------------------------------- axes
  // The matrix, with the scale's matrix axes replacing (or adding to) the spec's.
  std::vector<std::pair<YPtr, YPtr>> matrix_entries() {
    std::vector<std::pair<YPtr, YPtr>> out;
    const YNode* m = root_->get("matrix");
    if (m && !m->is_null()) {
      expect_map(*m, "matrix");
      out = m->entries;
    }
    const YNode* sm = scale_node_ ? scale_node_->get("matrix") : nullptr;
    if (sm && !sm->is_null()) {
      expect_map(*sm, "scales." + plan_.scale + ".matrix");
      for (const auto& e : sm->entries) {
        auto it = std::find_if(out.begin(), out.end(), [&](const auto& o) { return o.first->text == e.first->text; });
        if (it != out.end())
          *it = e;
        else
          out.push_back(e);
      }
    }
    return out;
  }

  int find_axis(const std::string& name) const {
    for (size_t i = 0; i < axes_.size(); ++i)
      if (axes_[i].name == name) return static_cast<int>(i);
    std::string path = resolve_axis(name);
    for (size_t i = 0; i < axes_.size(); ++i)
      if (axes_[i].path == path) return static_cast<int>(i);
    return -1;
  }

  std::vector<std::string> axis_names() const {
    std::vector<std::string> v;
    for (const auto& a : axes_) v.push_back(a.name);
    return v;
  }

  int intern(Axis& ax, const json& v, const SourceLoc& loc) {
    for (size_t i = 0; i < ax.values.size(); ++i)
      if (ax.values[i].value == v) return static_cast<int>(i);
    AxisValue av{v, loc, id_part(ax.name, ax.path, v), canonical_dump(v)};
    ax.values.push_back(std::move(av));
    return static_cast<int>(ax.values.size() - 1);
  }

  ValueList read_list(Axis& ax, const YNode& n, const std::string& what) {
    if (!n.is_seq())
      fail(n.loc, what + ": expected a list of values like [a, b] or {by: AXIS, VALUE: [...], default: [...]}, got " + n.describe());
    if (n.items.empty()) fail(n.loc, what + ": empty list of values");
    ValueList list{{}, n.loc, what};
    for (const auto& item : n.items) {
      json v = leaf_value(ax.parts, *item, what);
      int vid = intern(ax, v, item->loc);
      if (std::find(list.vids.begin(), list.vids.end(), vid) != list.vids.end()) {
        SourceLoc first;
        for (const auto& it2 : n.items)
          if (it2 != item && leaf_value(ax.parts, *it2, what) == v) {
            first = it2->loc;
            break;
          }
        fail(item->loc, what + ": value " + value_text(v) + " is listed twice (first at " + line_col(first) + ")");
      }
      list.vids.push_back(vid);
    }
    return list;
  }

  void read_axes() {
    auto entries = matrix_entries();
    for (const auto& [key, val] : entries) {
      Axis ax;
      ax.name = key->text;
      ax.key_loc = key->loc;
      ax.value_loc = val->loc;
      ax.path = resolve_leaf(*key, "matrix", "axis");
      ax.parts = split_path(ax.path);
      std::string what = "matrix." + ax.name;
      for (const auto& other : axes_)
        if (other.path == ax.path)
          fail(key->loc, what + ": conflicting overrides: '" + ax.name + "' and '" + other.name + "' both set " +
                             ax.path + " (first at " + line_col(other.key_loc) + ")");
      if (val->is_map() && val->get("by")) {
        const YNode& by = *val->get("by");
        std::string by_name = expect_string(by, what + ".by");
        ax.by = find_axis(by_name);
        if (ax.by < 0)
          fail(by.loc, with_hint(what + ": 'by: " + by_name + "' is not an axis declared before '" + ax.name + "'",
                                 by_name, axis_names()));
        for (const auto& [bk, bv] : val->entries) {
          if (bk->text == "by") continue;
          std::string bwhat = what + "." + bk->text;
          ax.lists.push_back(read_list(ax, *bv, bwhat));
          int li = static_cast<int>(ax.lists.size() - 1);
          if (bk->text == "default")
            ax.default_list = li;
          else
            ax.branches.emplace_back(bk.get(), li);
        }
        if (ax.lists.empty()) fail(val->loc, what + ": a conditional axis needs value lists ('VALUE: [...]' or 'default: [...]')");
      } else {
        ax.lists.push_back(read_list(ax, *val, what));
      }
      axes_.push_back(std::move(ax));
    }
    json names = json::array();
    for (const auto& a : axes_) names.push_back(a.name);
    plan_.meta["axes"] = names;
  }

  // Every branch key of a conditional must be a value its `by` axis can take (a typo
  // would otherwise silently never apply).
  void check_branch_keys() {
    for (auto& ax : axes_) {
      if (ax.by < 0) continue;
      const Axis& by = axes_[ax.by];
      std::vector<std::string> known;
      for (const auto& v : by.values) known.push_back(value_text(v.value));
      for (const auto& [key, li] : ax.branches) {
        json kv = key->to_json();
        bool found = false;
        for (const auto& v : by.values) found = found || key_matches(kv, v.value);
        // A spec that extends another may narrow its matrix: the branches it inherits for
        // the values it dropped never apply. Its own branches must name a value (typos).
        if (!found && key->loc.file != file_) continue;
        if (!found)
          fail(key->loc, with_hint("matrix." + ax.name + ": '" + key->text + "' is not a value of axis '" + by.name + "'",
                                   key->text, known));
      }
      ax.list_cache.assign(by.values.size(), -2);
    }
  }

  static bool key_matches(const json& key, const json& value) {
    if (key == value) return true;
    return value.is_string() && key.dump() == value.get<std::string>();  // e.g. key 1 vs "1"
  }

  const ValueList* list_for(Axis& ax, const int* vids) {
    if (const ValueList* l = try_list_for(ax, vids)) return l;
    const Axis& by = axes_[ax.by];
    std::string v = value_text(by.values[vids[ax.by]].value);
    fail(ax.value_loc, "matrix." + ax.name + ": no values for " + by.name + "=" + v + " (add '" + v +
                           ": [...]' or 'default: [...]')");
  }

  // The value list of `ax` for a cell with these values; nullptr when a conditional has
  // no branch (and no default) for the cell's value.
  const ValueList* try_list_for(Axis& ax, const int* vids) {
    if (ax.by < 0) return &ax.lists[0];
    int bv = vids[ax.by];
    if (bv >= static_cast<int>(ax.list_cache.size())) ax.list_cache.resize(bv + 1, -2);
    int& li = ax.list_cache[bv];
    if (li == -2) {
      li = ax.default_list;
      const json& v = axes_[ax.by].values[bv].value;
      for (const auto& [key, l] : ax.branches)
        if (key_matches(key->to_json(), v)) li = l;
    }
    return li < 0 ? nullptr : &ax.lists[li];
  }

  void read_zip() {
    const YNode* z = root_->get("zip");
    if (!z || z->is_null()) return;
    const std::string shape = "zip: expected a list of axis groups like [[lr, schedule.warmup_steps]], got ";
    if (!z->is_seq()) fail(z->loc, shape + z->describe());
    std::vector<SourceLoc> zipped_at(axes_.size());
    for (const auto& g : z->items) {
      if (!g->is_seq()) fail(g->loc, shape + "a group that is " + g->describe());
      if (g->items.size() < 2) fail(g->loc, "zip: a group needs at least two axes");
      ZipGroup group;
      group.loc = g->loc;
      std::vector<std::string> names;
      for (const auto& m : g->items) {
        std::string name = expect_string(*m, "zip");
        int a = find_axis(name);
        if (a < 0) fail(m->loc, with_hint("zip: '" + name + "' is not an axis of the matrix", name, axis_names()));
        if (axes_[a].zip >= 0) fail(m->loc, "zip: axis '" + name + "' is already zipped (at " + line_col(zipped_at[a]) + ")");
        axes_[a].zip = static_cast<int>(zips_.size());
        zipped_at[a] = m->loc;
        group.axes.push_back(a);
        names.push_back(name);
      }
      std::sort(group.axes.begin(), group.axes.end());
      group.text = "[" + join(names, ", ") + "]";
      int first = group.axes.front();
      for (int a : group.axes)
        if (axes_[a].by >= first)
          fail(g->loc, "zip: '" + axes_[a].name + "' depends on '" + axes_[axes_[a].by].name +
                           "' (by:), which must be declared before the group's first axis '" + axes_[first].name + "'");
      zips_.push_back(std::move(group));
    }
  }

  // ---------------------------------------------------------------- include
  void read_includes() {
    const YNode* inc = root_->get("include");
    if (!inc || inc->is_null()) return;
    expect_seq(*inc, "include");
    for (size_t i = 0; i < inc->items.size(); ++i) {
      const YNode& e = *inc->items[i];
      Include in;
      in.loc = e.loc;
      in.what = "include[" + std::to_string(i) + "]";
      expect_map(e, in.what);
      if (e.entries.empty()) fail(e.loc, in.what + ": empty entry");
      std::map<std::string, SourceLoc> set_at;  // leaf path → where
      auto claim = [&](const std::string& path, const SourceLoc& loc) {
        auto it = set_at.find(path);
        if (it != set_at.end())
          fail(loc, in.what + ": conflicting overrides: '" + path + "' is set twice (first at " + line_col(it->second) + ")");
        set_at[path] = loc;
      };
      for (const auto& [k, v] : e.entries) {
        int a = find_axis(k->text);
        if (a >= 0) {
          Axis& ax = axes_[a];
          claim(ax.path, k->loc);
          json val = leaf_value(ax.parts, *v, in.what + "." + k->text);
          in.pins.emplace_back(a, intern(ax, val, v->loc));
          continue;
        }
        std::string path = resolve_axis(k->text);
        const SchemaNode* s = schema_lookup(path);
        if (!s) fail(k->loc, with_hint(in.what + ": unknown axis or config key '" + k->text + "'", k->text, axis_candidates()));
        flatten_override(path, s, *k, *v, in, claim);
      }
      for (const auto& o : in.overrides)
        if (std::find(include_paths_.begin(), include_paths_.end(), o.parts) == include_paths_.end()) {
          include_paths_.push_back(o.parts);
          plan_.meta["axes"].push_back(join(o.parts, "."));
        }
      includes_.push_back(std::move(in));
    }
  }

  template <class Claim>
  void flatten_override(const std::string& path, const SchemaNode* s, const YNode& key, const YNode& val, Include& in,
                        Claim& claim) {
    if (s->type == SchemaType::map) {
      if (!val.is_map()) fail(val.loc, in.what + "." + path + ": expected a map, got " + val.describe());
      for (const auto& [k, v] : val.entries) {
        std::string p = path + "." + k->text;
        const SchemaNode* c = schema_lookup(p);
        if (!c) {
          std::vector<std::string> keys;
          for (const auto& [ck, cv] : s->children) keys.push_back(ck);
          fail(k->loc, with_hint(in.what + "." + path + ": unknown key '" + k->text + "'", k->text, keys));
        }
        flatten_override(p, c, *k, *v, in, claim);
      }
      return;
    }
    claim(path, key.loc);
    Override o;
    o.parts = split_path(path);
    o.value = leaf_value(o.parts, val, in.what + "." + key.text);
    o.loc = val.loc;
    o.id_part = id_part(path.substr(path.rfind('.') + 1), path, o.value);
    in.overrides.push_back(std::move(o));
  }

  // ---------------------------------------------------------------- match rules
  Matcher read_match(const YNode& m, const std::string& what) {
    expect_map(m, what);
    Matcher out;
    out.loc = m.loc;
    out.what = what;
    for (const auto& [k, v] : m.entries) {
      Cond c;
      c.axis = find_axis(k->text);
      std::string cwhat = what + "." + k->text;
      if (c.axis >= 0) {
        c.parts = axes_[c.axis].parts;
      } else {
        std::string path = resolve_axis(k->text);
        const SchemaNode* s = schema_lookup(path);
        if (!s || s->type == SchemaType::map) {
          std::vector<std::string> cand = axis_names();
          for (const auto& x : axis_candidates()) cand.push_back(x);
          fail(k->loc, with_hint(what + ": '" + k->text + "' is not an axis or config value", k->text, cand));
        }
        c.parts = split_path(path);
      }
      const SchemaNode* s = schema_lookup(join(c.parts, "."));
      bool list_leaf = s->type == SchemaType::number_list || s->type == SchemaType::integer_list;
      if (v->is_seq() && !(list_leaf && !v->items.empty() && !v->items[0]->is_seq())) {
        if (v->items.empty()) fail(v->loc, cwhat + ": empty list of values");
        for (const auto& item : v->items) c.values.push_back(leaf_value(c.parts, *item, cwhat));
      } else {
        c.values.push_back(leaf_value(c.parts, *v, cwhat));
      }
      out.conds.push_back(std::move(c));
    }
    return out;
  }

  void compile(Matcher& m) {
    for (auto& c : m.conds) {
      if (c.axis < 0) continue;
      const Axis& ax = axes_[c.axis];
      c.accept.assign(ax.values.size(), 0);
      for (size_t vid = 0; vid < ax.values.size(); ++vid)
        for (const auto& v : c.values)
          if (ax.values[vid].value == v) c.accept[vid] = 1;
    }
  }

  // The value of a config leaf in a cell without building the cell's config: an axis
  // value, an include's override, or the template's value.
  const json& leaf_of(const int* vids, int include, const std::vector<std::string>& parts) const {
    for (size_t a = 0; a < axes_.size(); ++a)
      if (axes_[a].parts == parts) return axes_[a].values[vids[a]].value;
    if (include >= 0)
      for (const auto& o : includes_[include].overrides)
        if (o.parts == parts) return o.value;
    return *get_leaf(template_, parts);
  }

  bool matches(const Matcher& m, const int* vids, int include) const {
    for (const auto& c : m.conds) {
      if (c.axis >= 0) {
        if (!c.accept[vids[c.axis]]) return false;
      } else {
        const json& v = leaf_of(vids, include, c.parts);
        if (std::find(c.values.begin(), c.values.end(), v) == c.values.end()) return false;
      }
    }
    return true;
  }

  void read_matchers() {
    if (const YNode* ex = root_->get("exclude"); ex && !ex->is_null()) {
      expect_seq(*ex, "exclude");
      for (size_t i = 0; i < ex->items.size(); ++i)
        excludes_.push_back(read_match(*ex->items[i], "exclude[" + std::to_string(i) + "]"));
    }
    if (const YNode* r = root_->get("roles"); r && !r->is_null()) {
      expect_seq(*r, "roles");
      for (size_t i = 0; i < r->items.size(); ++i) {
        std::string what = "roles[" + std::to_string(i) + "]";
        const YNode& e = expect_map(*r->items[i], what);
        check_keys(e, {"match", "role"}, what);
        const YNode* match = e.get("match");
        const YNode* role = e.get("role");
        if (!match) fail(e.loc, what + ": missing 'match'");
        if (!role) fail(e.loc, what + ": missing 'role'");
        std::string rn = expect_string(*role, what + ".role");
        if (rn != "main" && rn != "exploratory")
          fail(role->loc, with_hint(what + ".role: unknown role '" + rn + "' (roles: main, exploratory)", rn, {"main", "exploratory"}));
        roles_.emplace_back(read_match(*match, what + ".match"), rn);
        roles_.back().first.loc = e.loc;
        roles_.back().first.what = what;
      }
    }
    if (const YNode* b = root_->get("baselines"); b && !b->is_null()) {
      expect_seq(*b, "baselines");
      for (size_t i = 0; i < b->items.size(); ++i) {
        std::string what = "baselines[" + std::to_string(i) + "]";
        const YNode& e = expect_map(*b->items[i], what);
        check_keys(e, {"match", "baseline"}, what);
        const YNode* match = e.get("match");
        const YNode* base = e.get("baseline");
        if (!match) fail(e.loc, what + ": missing 'match'");
        if (!base) fail(e.loc, what + ": missing 'baseline'");
        expect_map(*base, what + ".baseline");
        if (base->entries.empty()) fail(base->loc, what + ".baseline: empty (name the axis values to replace)");
        BaselineRule rule;
        rule.match = read_match(*match, what + ".match");
        rule.match.loc = e.loc;
        rule.match.what = what;
        for (const auto& [k, v] : base->entries) {
          int a = find_axis(k->text);
          if (a < 0) fail(k->loc, with_hint(what + ".baseline: '" + k->text + "' is not an axis of the matrix", k->text, axis_names()));
          Axis& ax = axes_[a];
          json val = leaf_value(ax.parts, *v, what + ".baseline." + k->text);
          rule.replace.emplace_back(a, val);
        }
        baselines_.push_back(std::move(rule));
      }
    }
    if (const YNode* ref = root_->get("reference"); ref && !ref->is_null()) {
      expect_map(*ref, "reference");
      check_keys(*ref, {"source", "metrics", "rows"}, "reference");
      json meta = json::object();
      if (const YNode* src = ref->get("source")) meta["source"] = expect_map(*src, "reference.source").to_json();
      const YNode* metrics = ref->get("metrics");
      if (!metrics) fail(ref->loc, "reference: missing 'metrics'");
      expect_seq(*metrics, "reference.metrics");
      for (const auto& m : metrics->items) metric_names_.push_back(expect_string(*m, "reference.metrics"));
      meta["metrics"] = metric_names_;
      plan_.meta["reference"] = meta;
      if (const YNode* rows = ref->get("rows"); rows && !rows->is_null()) {
        expect_seq(*rows, "reference.rows");
        for (size_t i = 0; i < rows->items.size(); ++i) {
          std::string what = "reference.rows[" + std::to_string(i) + "]";
          const YNode& e = expect_map(*rows->items[i], what);
          check_keys(e, {"match", "values"}, what);
          const YNode* match = e.get("match");
          const YNode* values = e.get("values");
          if (!match) fail(e.loc, what + ": missing 'match'");
          if (!values) fail(e.loc, what + ": missing 'values'");
          expect_seq(*values, what + ".values");
          if (values->items.size() != metric_names_.size())
            fail(values->loc, what + ".values: " + std::to_string(values->items.size()) + " values for " +
                                  std::to_string(metric_names_.size()) + " metrics (" + join(metric_names_, ", ") + ")");
          json vals = json::object();
          for (size_t j = 0; j < values->items.size(); ++j) {
            json v = values->items[j]->to_json();
            if (!v.is_number() && !v.is_null())
              fail(values->items[j]->loc, what + ".values: expected a number (or null), got " + values->items[j]->describe());
            vals[metric_names_[j]] = v;
          }
          RefRow row{read_match(*match, what + ".match"), vals};
          row.match.loc = e.loc;
          row.match.what = what;
          ref_rows_.push_back(std::move(row));
        }
      }
    }
    for (auto& m : excludes_) compile(m);
    for (auto& [m, r] : roles_) compile(m);
    for (auto& b : baselines_) compile(b.match);
    for (auto& r : ref_rows_) compile(r.match);
  }

  // ---------------------------------------------------------------- expansion
  // Depth-first over the axes in matrix order. `pinned` (include cells) fixes some
  // axes; a zip group with a pinned member is released (its other members expand
  // independently).
  void expand(size_t i, std::vector<int>& vids, const std::vector<int>& pinned, int include) {
    if (i == axes_.size()) {
      if (include < 0) {
        for (auto& m : excludes_)
          if (matches(m, vids.data(), -1)) {
            ++m.matched;
            return;
          }
      }
      drafts_.push_back({flat_.size(), include});
      flat_.insert(flat_.end(), vids.begin(), vids.end());
      return;
    }
    Axis& ax = axes_[i];
    if (pinned[i] >= 0) {
      vids[i] = pinned[i];
      expand(i + 1, vids, pinned, include);
      return;
    }
    bool zipped = ax.zip >= 0;
    if (zipped)
      for (int a : zips_[ax.zip].axes) zipped = zipped && pinned[a] < 0;
    if (!zipped) {
      const ValueList* list = list_for(ax, vids.data());
      for (int v : list->vids) {
        vids[i] = v;
        expand(i + 1, vids, pinned, include);
      }
      return;
    }
    const ZipGroup& g = zips_[ax.zip];
    if (g.axes.front() != static_cast<int>(i)) {  // already set with the group's first axis
      expand(i + 1, vids, pinned, include);
      return;
    }
    std::vector<const ValueList*> lists;
    for (int a : g.axes) lists.push_back(list_for(axes_[a], vids.data()));
    for (size_t k = 1; k < lists.size(); ++k)
      if (lists[k]->vids.size() != lists[0]->vids.size()) {
        std::string ctx;
        for (int a : g.axes)
          if (axes_[a].by >= 0) {
            const Axis& by = axes_[axes_[a].by];
            ctx = " (for " + by.name + "=" + value_text(by.values[vids[axes_[a].by]].value) + ")";
          }
        fail(g.loc, "zip group " + g.text + ": '" + axes_[g.axes[0]].name + "' has " + std::to_string(lists[0]->vids.size()) +
                        " values but '" + axes_[g.axes[k]].name + "' has " + std::to_string(lists[k]->vids.size()) + ctx);
      }
    for (size_t n = 0; n < lists[0]->vids.size(); ++n) {
      for (size_t k = 0; k < lists.size(); ++k) vids[g.axes[k]] = lists[k]->vids[n];
      expand(i + 1, vids, pinned, include);
    }
  }

  void expand_matrix() {
    std::vector<int> vids(axes_.size(), -1), pinned(axes_.size(), -1);
    expand(0, vids, pinned, -1);
  }

  void expand_includes() {
    for (size_t i = 0; i < includes_.size(); ++i) {
      std::vector<int> vids(axes_.size(), -1), pinned(axes_.size(), -1);
      for (auto [a, v] : includes_[i].pins) pinned[a] = v;
      size_t before = drafts_.size();
      expand(0, vids, pinned, static_cast<int>(i));
      if (drafts_.size() == before) fail(includes_[i].loc, includes_[i].what + ": adds no cell");
    }
  }

  // ---------------------------------------------------------------- cells
  // Splits the template's canonical dump at the axis leaves: dump(cell) =
  // seg[0] + dump(value of axis order[0]) + seg[1] + ... Returns false (and the slow
  // path is used) if the sentinel text could be ambiguous.
  bool prepare_splice() {
    const std::string tag = "@@lar-axis-";
    if (canonical_dump(template_).find(tag) != std::string::npos) return false;
    // (an axis over a `cuda` key: whether its value is hashed depends on the value)
    for (const auto& ax : axes_)
      if (!ax.parts.empty() && ax.parts[0] == "cuda") return false;
    json t = template_;
    for (size_t a = 0; a < axes_.size(); ++a) set_leaf(t, axes_[a].parts, tag + std::to_string(a) + "@@");
    std::string d = canonical_dump(hashed_config(t));
    std::vector<std::pair<size_t, int>> at;  // position, axis
    for (size_t a = 0; a < axes_.size(); ++a) {
      std::string s = "\"" + tag + std::to_string(a) + "@@\"";
      size_t p = d.find(s);
      if (p == std::string::npos || d.find(s, p + 1) != std::string::npos) return false;
      at.emplace_back(p, static_cast<int>(a));
    }
    std::sort(at.begin(), at.end());
    size_t prev = 0;
    for (auto [p, a] : at) {
      segments_.push_back(d.substr(prev, p - prev));
      splice_order_.push_back(a);
      prev = p + tag.size() + std::to_string(a).size() + 4;
    }
    segments_.push_back(d.substr(prev));
    return true;
  }

  void make_cells() {
    bool splice = prepare_splice();
    plan_.cells.reserve(drafts_.size());
    int arch = find_path("model.architecture"), stack = find_path("model.stack");
    std::string text;
    Sha256 sha;
    for (const auto& d : drafts_) {
      Cell c;
      c.experiment = plan_.experiment;
      c.axes.reserve(axes_.size());
      std::string id;
      for (size_t a = 0; a < axes_.size(); ++a) {
        const AxisValue& v = axes_[a].values[V(d)[a]];
        c.axes.emplace_back(axes_[a].name, v.value);
        if (a) id += '.';
        id += v.id_part;
      }
      if (d.include >= 0)
        for (const auto& o : includes_[d.include].overrides) id += (id.empty() ? "" : ".") + o.id_part;
      // An include's config keys are axes too, with the template's value on the other cells:
      // CARVE's two Mamba-3 rows differ only in model.mamba3.form, and tables, claims and
      // `lar plan` must tell them apart.
      for (const auto& parts : include_paths_) {
        const json* v = nullptr;
        if (d.include >= 0)
          for (const auto& o : includes_[d.include].overrides)
            if (o.parts == parts) v = &o.value;
        if (!v) v = get_leaf(template_, parts);
        if (v) c.axes.emplace_back(join(parts, "."), *v);
      }
      if (id.empty()) id = "base";
      c.id = std::move(id);
      bool fast_hash = splice && d.include < 0;
      if (options_.configs || options_.check || !fast_hash) {
        c.config = template_;
        for (size_t a = 0; a < axes_.size(); ++a) set_leaf(c.config, axes_[a].parts, axes_[a].values[V(d)[a]].value);
        if (d.include >= 0)
          for (const auto& o : includes_[d.include].overrides) set_leaf(c.config, o.parts, o.value);
      }
      if (fast_hash) {
        text.clear();
        for (size_t k = 0; k < splice_order_.size(); ++k) {
          text += segments_[k];
          text += axes_[splice_order_[k]].values[V(d)[splice_order_[k]]].dump;
        }
        text += segments_.back();
        c.hash = sha.hex(text);
      } else {
        c.hash = sha.hex(canonical_dump(hashed_config(c.config)));
      }
      check_architecture(c, d, arch, stack);
      plan_.cells.push_back(std::move(c));
    }
    if (auto dup = first_duplicate([](const Cell& c) { return c.id; }))
      fail(origin(drafts_[dup->second]), "two cells have the id '" + plan_.cells[dup->second].id + "' (" +
                                             origin_text(drafts_[dup->first]) + " and " + origin_text(drafts_[dup->second]) + ")");
    if (auto dup = first_duplicate([](const Cell& c) { return c.hash; }))
      fail(origin(drafts_[dup->second]), "cells '" + plan_.cells[dup->first].id + "' and '" + plan_.cells[dup->second].id +
                                             "' have identical configs (hash " + plan_.cells[dup->second].short_hash() + ")");
  }

  // The earliest cell whose key (id or hash) an earlier cell already has, as (earlier,
  // later). Sorting 64-bit digests is several times faster than a hash set of strings at
  // 100,000 cells; equal digests are confirmed on the strings.
  template <class Key>
  std::optional<std::pair<size_t, size_t>> first_duplicate(Key key) const {
    const auto& cells = plan_.cells;
    std::vector<std::pair<size_t, size_t>> order(cells.size());  // digest, index
    for (size_t i = 0; i < cells.size(); ++i) order[i] = {std::hash<std::string>{}(key(cells[i])), i};
    std::sort(order.begin(), order.end());
    std::optional<std::pair<size_t, size_t>> best;
    for (size_t i = 0; i < order.size();) {
      size_t j = i;
      while (j < order.size() && order[j].first == order[i].first) ++j;
      for (size_t a = i; a < j; ++a)
        for (size_t b = a + 1; b < j; ++b)
          if (key(cells[order[a].second]) == key(cells[order[b].second]) && (!best || order[b].second < best->second))
            best = std::make_pair(order[a].second, order[b].second);
      i = j;
    }
    return best;
  }

  int find_path(const std::string& path) const {
    for (size_t i = 0; i < axes_.size(); ++i)
      if (axes_[i].path == path) return static_cast<int>(i);
    return -1;
  }

  SourceLoc origin(const CellDraft& d) const { return d.include >= 0 ? includes_[d.include].loc : matrix_loc(); }
  std::string origin_text(const CellDraft& d) const {
    return d.include >= 0 ? includes_[d.include].what + " at " + origin(d).str() : "the matrix at " + origin(d).str();
  }

  // softmax means every layer is softmax (stack dense); a linear architecture in a dense
  // stack would silently train a softmax model. Both are mistakes worth stopping.
  void check_architecture(const Cell& c, const CellDraft& d, int arch_axis, int stack_axis) const {
    static const std::vector<std::string> arch_path{"model", "architecture"}, stack_path{"model", "stack"};
    const std::string& arch = leaf_of(V(d), d.include, arch_path).get_ref<const std::string&>();
    const std::string& stack = leaf_of(V(d), d.include, stack_path).get_ref<const std::string&>();
    bool softmax = arch == "softmax";
    if (softmax == (stack == "dense")) return;
    SourceLoc loc = origin(d);
    if (stack_axis >= 0 && d.include < 0)
      loc = axes_[stack_axis].values[V(d)[stack_axis]].loc;
    else if (arch_axis >= 0 && d.include < 0)
      loc = axes_[arch_axis].values[V(d)[arch_axis]].loc;
    if (softmax)
      fail(loc, "cell '" + c.id + "': architecture 'softmax' needs stack 'dense', not '" + stack +
                    "' (use a conditional axis: stack: {by: architecture, softmax: [dense], default: [hybrid, pure]})");
    fail(loc, "cell '" + c.id + "': architecture '" + arch +
                  "' needs stack 'pure' or 'hybrid' (stack 'dense' makes every layer softmax)");
  }

  // ---------------------------------------------------------------- the trainer's rules
  // Every cell through the trainer's own checks, before anything is written. The error
  // names the line that set the value to blame: of the keys the message names, the one
  // set most specifically (an include, then an axis value, the scale's base, the base).
  void check_cells() {
    const trainer::CheckOptions check{.require_data = options_.require_data};
    auto checked = [&](size_t i, auto&& check_one) {
      try {
        return check_one(plan_.cells[i].config);
      } catch (const UserError& e) {
        fail(blame(drafts_[i], e.what()), "cell '" + plan_.cells[i].id + "': " + e.what());
      }
    };
    // The spec's own mistakes first, over all cells; then what the data on this machine
    // says (opening it is the costly part, and most cells of a sweep share their data).
    for (size_t i = 0; i < plan_.cells.size(); ++i) checked(i, trainer::check_config_without_data);
    std::set<std::string> noted, data_checked;
    for (size_t i = 0; i < plan_.cells.size(); ++i) {
      if (data_checked.insert(canonical_dump(trainer::data_check_key(plan_.cells[i].config))).second)
        for (const auto& n : checked(i, [&](const json& c) { return trainer::check_data(c, check); }))
          if (noted.insert(n).second) plan_.notes.push_back(file_ + ": warning: " + n);
    }
    if (!options_.configs)
      for (auto& c : plan_.cells) c.config = nullptr;
  }

  SourceLoc blame(const CellDraft& d, const std::string& message) const {
    SourceLoc best = origin(d);
    int best_level = kSetByDefault;
    for (const auto& key : trainer::config_keys_named(message)) {
      auto [loc, level] = set_at(d, split_path(key));
      if (level > best_level) {
        best = loc;
        best_level = level;
      }
    }
    return best;
  }

  std::pair<SourceLoc, int> set_at(const CellDraft& d, const std::vector<std::string>& parts) const {
    if (d.include >= 0) {
      for (const auto& o : includes_[d.include].overrides)
        if (o.parts == parts) return {o.loc, kSetByInclude};
      for (const auto& [a, vid] : includes_[d.include].pins)
        if (axes_[a].parts == parts) return {axes_[a].values[vid].loc, kSetByInclude};
    }
    for (size_t a = 0; a < axes_.size(); ++a)
      if (axes_[a].parts == parts) return {axes_[a].values[V(d)[a]].loc, kSetByAxis};
    auto it = template_set_at_.find(join(parts, "."));
    if (it != template_set_at_.end()) return it->second;
    return {SourceLoc{}, kSetByDefault};
  }

  void apply_roles() {
    for (size_t i = 0; i < plan_.cells.size(); ++i)
      for (auto& [m, role] : roles_)
        if (matches(m, V(drafts_[i]), drafts_[i].include)) {
          ++m.matched;
          plan_.cells[i].role = role;  // later rules override earlier ones
        }
  }

  std::string vids_key(const int* vids, int include) const {
    std::string k = std::to_string(include);
    for (size_t a = 0; a < axes_.size(); ++a) k += "," + std::to_string(vids[a]);
    return k;
  }

  void apply_baselines() {
    if (baselines_.empty()) return;
    std::unordered_map<std::string, size_t> index;
    for (size_t i = 0; i < drafts_.size(); ++i) index.emplace(vids_key(V(drafts_[i]), drafts_[i].include), i);
    for (size_t i = 0; i < plan_.cells.size(); ++i) {
      Cell& c = plan_.cells[i];
      for (auto& rule : baselines_) {
        if (!matches(rule.match, V(drafts_[i]), drafts_[i].include)) continue;
        ++rule.match.matched;
        std::vector<int> target(V(drafts_[i]), V(drafts_[i]) + axes_.size());
        std::vector<std::string> parts;
        bool exists = true;
        for (auto& [a, value] : rule.replace) {
          const Axis& ax = axes_[a];
          int vid = -1;
          for (size_t k = 0; k < ax.values.size(); ++k)
            if (ax.values[k].value == value) vid = static_cast<int>(k);
          if (vid < 0) exists = false;
          target[a] = vid;
        }
        // Axes conditional on a replaced axis follow it: they take the value at the same
        // position of their list for the new value (muon's 2nd lr → adamw's 2nd lr).
        for (size_t a = 0; exists && a < axes_.size(); ++a) {
          Axis& ax = axes_[a];
          bool replaced = false;
          for (auto& [ra, value] : rule.replace) replaced = replaced || ra == static_cast<int>(a);
          const int* orig = V(drafts_[i]);
          if (replaced || ax.by < 0 || target[ax.by] == orig[ax.by]) continue;
          const ValueList* old_list = try_list_for(ax, orig);
          const ValueList* new_list = try_list_for(ax, target.data());
          if (!old_list || !new_list) continue;
          auto pos = std::find(old_list->vids.begin(), old_list->vids.end(), orig[a]) - old_list->vids.begin();
          if (pos < static_cast<long>(new_list->vids.size())) target[a] = new_list->vids[pos];
        }
        for (size_t a = 0; a < axes_.size(); ++a) {
          if (target[a] >= 0) {
            parts.push_back(axes_[a].values[target[a]].id_part);
          } else {
            for (auto& [ra, value] : rule.replace)
              if (ra == static_cast<int>(a)) parts.push_back(id_part(axes_[a].name, axes_[a].path, value));
          }
        }
        if (drafts_[i].include >= 0)
          for (const auto& o : includes_[drafts_[i].include].overrides) parts.push_back(o.id_part);
        std::string want = join(parts, ".");
        auto it = exists ? index.find(vids_key(target.data(), drafts_[i].include)) : index.end();
        if (it == index.end())
          fail(rule.match.loc, rule.match.what + ": the baseline of cell '" + c.id + "' would be '" + want +
                                   "', which is not in the plan");
        if (it->second != i) c.baseline = plan_.cells[it->second].id;
      }
    }
  }

  void apply_reference() {
    std::vector<int> matched_by(plan_.cells.size(), -1);
    for (size_t r = 0; r < ref_rows_.size(); ++r) {
      auto& row = ref_rows_[r];
      for (size_t i = 0; i < plan_.cells.size(); ++i) {
        if (!matches(row.match, V(drafts_[i]), drafts_[i].include)) continue;
        ++row.match.matched;
        if (matched_by[i] >= 0)
          fail(row.match.loc, row.match.what + " and " + ref_rows_[matched_by[i]].match.what + " (at " +
                                  line_col(ref_rows_[matched_by[i]].match.loc) + ") both match cell '" +
                                  plan_.cells[i].id + "'");
        matched_by[i] = static_cast<int>(r);
        plan_.cells[i].reference = row.values;
      }
    }
  }

  void warn(const Matcher& m, const std::string& what) {
    if (m.matched == 0) plan_.warnings.push_back(m.loc.str() + ": warning: " + what + " matches no cell");
  }

  void warn_unmatched() {
    for (const auto& m : excludes_) warn(m, m.what);
    for (const auto& [m, r] : roles_) warn(m, m.what);
    for (const auto& b : baselines_) warn(b.match, b.match.what);
    for (const auto& r : ref_rows_) warn(r.match, r.match.what);
  }

  struct BaselineRule {
    Matcher match;
    std::vector<std::pair<int, json>> replace;
  };
  struct RefRow {
    Matcher match;
    json values;
  };

  static constexpr int kSetByDefault = 0, kSetByExtended = 1, kSetByBase = 2, kSetByScale = 3, kSetByAxis = 4,
                       kSetByInclude = 5;
  std::map<std::string, std::pair<SourceLoc, int>> template_set_at_;  // leaf path → where, level

  fs::path spec_path_;
  std::string scale_arg_;
  LoadOptions options_;
  std::string file_;
  YPtr root_;
  const YNode* scale_node_ = nullptr;
  Plan plan_;
  json template_;
  std::vector<Axis> axes_;
  std::vector<ZipGroup> zips_;
  std::vector<Include> includes_;
  std::vector<std::vector<std::string>> include_paths_;  // config keys some include sets, in order
  std::vector<Matcher> excludes_;
  std::vector<std::pair<Matcher, std::string>> roles_;
  std::vector<BaselineRule> baselines_;
  std::vector<std::string> metric_names_;
  std::vector<RefRow> ref_rows_;
  std::vector<CellDraft> drafts_;
  std::vector<int> flat_;
  const int* V(const CellDraft& d) const { return flat_.data() + d.at; }
  std::vector<std::string> segments_;
  std::vector<int> splice_order_;
};

}  // namespace

Plan load_plan(const fs::path& spec, const std::string& scale, const LoadOptions& options) {
  return Builder(spec, scale, options).build();
}

Plan load_plan(const fs::path& spec, const std::string& scale) { return load_plan(spec, scale, LoadOptions{}); }

}  // namespace lar::experiments
