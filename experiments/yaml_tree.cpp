#include "experiments/yaml_tree.hpp"

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/exceptions.h>
#include <yaml-cpp/mark.h>
#include <yaml-cpp/parser.h>

#include <charconv>
#include <fstream>
#include <map>
#include <sstream>

namespace lar::experiments {

const std::pair<YPtr, YPtr>* YNode::entry(std::string_view key) const {
  if (kind != Kind::map) return nullptr;
  for (const auto& e : entries)
    if (e.first->text == key) return &e;
  return nullptr;
}

const YNode* YNode::get(std::string_view key) const {
  const auto* e = entry(key);
  return e ? e->second.get() : nullptr;
}

json YNode::to_json() const {
  switch (kind) {
    case Kind::null: return nullptr;
    case Kind::scalar: return scalar_value(text, plain, tag);
    case Kind::seq: {
      json a = json::array();
      for (const auto& i : items) a.push_back(i->to_json());
      return a;
    }
    case Kind::map: {
      json o = json::object();
      for (const auto& [k, v] : entries) o[k->text] = v->to_json();
      return o;
    }
  }
  return nullptr;
}

std::string YNode::describe() const {
  switch (kind) {
    case Kind::null: return "nothing (null)";
    case Kind::seq: return "a list";
    case Kind::map: return "a map";
    case Kind::scalar: {
      json v = to_json();
      if (v.is_string()) return "the string '" + text + "'";
      if (v.is_boolean()) return "the boolean " + text;
      if (v.is_null()) return "nothing (null)";
      return "the number " + text;
    }
  }
  return "?";
}

namespace {

bool is_digits(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  return true;
}

// YAML 1.2 core schema float: [-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?
bool is_core_float(std::string_view s) {
  size_t i = 0;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
  size_t int_start = i;
  while (i < s.size() && s[i] >= '0' && s[i] <= '9') ++i;
  bool has_int = i > int_start;
  bool has_frac = false;
  if (i < s.size() && s[i] == '.') {
    ++i;
    size_t f = i;
    while (i < s.size() && s[i] >= '0' && s[i] <= '9') ++i;
    has_frac = i > f;
  }
  if (!has_int && !has_frac) return false;
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    ++i;
    if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
    if (!is_digits(s.substr(i))) return false;
    i = s.size();
  }
  return i == s.size();
}

SourceLoc loc_of(const std::string& file, const YAML::Mark& m) {
  return SourceLoc{file, m.line + 1, m.column + 1};
}

// Builds the tree from parser events.
class TreeBuilder : public YAML::EventHandler {
 public:
  explicit TreeBuilder(std::string file) : file_(std::move(file)) {}
  YPtr root() const { return root_; }
  int documents() const { return documents_; }

  void OnDocumentStart(const YAML::Mark&) override { ++documents_; }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark& m, YAML::anchor_t anchor) override {
    auto n = std::make_shared<YNode>();
    n->kind = YNode::Kind::null;
    n->loc = loc_of(file_, m);
    // An empty value ("key:") is reported at its key: the parser's mark points past it.
    if (!stack_.empty() && stack_.back().node->is_map() && stack_.back().pending_key)
      n->loc = stack_.back().pending_key->loc;
    add(n, anchor);
  }
  void OnAlias(const YAML::Mark& m, YAML::anchor_t anchor) override {
    auto it = anchors_.find(anchor);
    if (it == anchors_.end()) throw UserError(loc_of(file_, m), "unknown alias");
    add_node(it->second);
  }
  void OnScalar(const YAML::Mark& m, const std::string& tag, YAML::anchor_t anchor,
                const std::string& value) override {
    auto n = std::make_shared<YNode>();
    n->kind = YNode::Kind::scalar;
    n->text = value;
    n->plain = tag == "?";
    if (tag != "?" && tag != "!") n->tag = tag;
    n->loc = loc_of(file_, m);
    add(n, anchor);
  }
  void OnSequenceStart(const YAML::Mark& m, const std::string&, YAML::anchor_t anchor,
                       YAML::EmitterStyle::value) override {
    auto n = std::make_shared<YNode>();
    n->kind = YNode::Kind::seq;
    n->loc = loc_of(file_, m);
    add(n, anchor);
    stack_.push_back({n, nullptr});
  }
  void OnSequenceEnd() override { stack_.pop_back(); }
  void OnMapStart(const YAML::Mark& m, const std::string&, YAML::anchor_t anchor,
                  YAML::EmitterStyle::value) override {
    auto n = std::make_shared<YNode>();
    n->kind = YNode::Kind::map;
    n->loc = loc_of(file_, m);
    add(n, anchor);
    stack_.push_back({n, nullptr});
  }
  void OnMapEnd() override { stack_.pop_back(); }

 private:
  struct Frame {
    std::shared_ptr<YNode> node;
    YPtr pending_key;  // maps: the key whose value comes next
  };

  void add(const std::shared_ptr<YNode>& n, YAML::anchor_t anchor) {
    if (anchor != 0) anchors_[anchor] = n;
    add_node(n);
  }

  void add_node(const YPtr& n) {
    if (stack_.empty()) {
      root_ = n;
      return;
    }
    Frame& top = stack_.back();
    if (top.node->is_seq()) {
      top.node->items.push_back(n);
      return;
    }
    if (top.pending_key) {
      top.node->entries.emplace_back(top.pending_key, n);
      top.pending_key = nullptr;
      return;
    }
    // n is a key.
    if (!n->is_scalar()) throw UserError(n->loc, "a map key must be a plain word, not " + n->describe());
    if (n->text == "<<" && n->plain)
      throw UserError(n->loc, "YAML merge keys ('<<') are not supported; use 'extends:' to share settings");
    for (const auto& [k, v] : top.node->entries)
      if (k->text == n->text)
        throw UserError(n->loc, "duplicate key '" + n->text + "' (first defined at " +
                                    std::to_string(k->loc.line) + ":" + std::to_string(k->loc.column) + ")");
    top.pending_key = n;
  }

  std::string file_;
  std::vector<Frame> stack_;
  std::map<YAML::anchor_t, YPtr> anchors_;
  YPtr root_;
  int documents_ = 0;
};

YPtr parse_stream(std::istream& in, const std::string& name) {
  TreeBuilder builder(name);
  try {
    YAML::Parser parser(in);
    while (parser.HandleNextDocument(builder)) {
      if (builder.documents() > 1) throw UserError(SourceLoc{name, 0, 0}, "a spec holds one YAML document, found several ('---')");
    }
  } catch (const YAML::Exception& e) {
    throw UserError(loc_of(name, e.mark), "YAML syntax: " + e.msg);
  }
  YPtr root = builder.root();
  if (!root || root->is_null()) throw UserError(SourceLoc{name, 1, 1}, "the spec is empty");
  return root;
}

}  // namespace

json scalar_value(const std::string& s, bool plain, const std::string& tag) {
  if (!tag.empty()) {
    if (tag == "tag:yaml.org,2002:str") return s;
    if (tag == "tag:yaml.org,2002:float" || tag == "tag:yaml.org,2002:int") {
      json v = scalar_value(s, true, "");
      if (v.is_number()) return tag == "tag:yaml.org,2002:float" ? json(v.get<double>()) : v;
    }
    return s;
  }
  if (!plain) return s;
  if (s.empty() || s == "~" || s == "null" || s == "Null" || s == "NULL") return nullptr;
  if (s == "true" || s == "True" || s == "TRUE") return true;
  if (s == "false" || s == "False" || s == "FALSE") return false;
  std::string_view v = s;
  std::string_view digits = (v[0] == '+' || v[0] == '-') ? v.substr(1) : v;
  if (is_digits(digits)) {
    long long out = 0;
    const char* first = v.data() + (v[0] == '+' ? 1 : 0);
    auto [p, ec] = std::from_chars(first, v.data() + v.size(), out);
    if (ec == std::errc() && p == v.data() + v.size()) return out;
    double d = 0;  // too large for an integer
    auto [p2, ec2] = std::from_chars(first, v.data() + v.size(), d);
    if (ec2 == std::errc() && p2 == v.data() + v.size()) return d;
    return s;
  }
  if (is_core_float(v)) {
    double d = 0;
    const char* first = v.data() + (v[0] == '+' ? 1 : 0);
    auto [p, ec] = std::from_chars(first, v.data() + v.size(), d);
    if (ec == std::errc() && p == v.data() + v.size()) return d;
    return s;  // out of range: stays a string, so validation reports the value
  }
  return s;
}

YPtr parse_yaml_file(const std::filesystem::path& path, const std::string& display_name) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UserError("cannot read spec '" + display_name + "': no such file or not readable");
  return parse_stream(in, display_name);
}

YPtr parse_yaml_string(const std::string& text, const std::string& display_name) {
  std::istringstream in(text);
  return parse_stream(in, display_name);
}

YPtr deep_merge(const YPtr& base, const YPtr& overlay) {
  if (!base || !base->is_map() || !overlay->is_map()) return overlay;
  auto out = std::make_shared<YNode>(*overlay);
  out->entries.clear();
  for (const auto& [k, v] : base->entries) {
    const auto* o = overlay->entry(k->text);
    if (o)
      out->entries.emplace_back(o->first, deep_merge(v, o->second));
    else
      out->entries.emplace_back(k, v);
  }
  for (const auto& e : overlay->entries)
    if (!base->entry(e.first->text)) out->entries.push_back(e);
  return out;
}

}  // namespace lar::experiments
