#include "registry/report/style.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <set>

namespace lar::report {

namespace {

struct Rgb {
  double r, g, b;
};

Rgb parse(const std::string& c) {
  if (c.size() != 7 || c[0] != '#') return {0.2, 0.2, 0.2};
  auto h = [&](size_t i) { return std::strtol(c.substr(i, 2).c_str(), nullptr, 16) / 255.0; };
  return {h(1), h(3), h(5)};
}

std::string hex(Rgb c) {
  auto b = [](double v) { return static_cast<int>(std::lround(std::clamp(v, 0.0, 1.0) * 255)); };
  return fmt::format("#{:02x}{:02x}{:02x}", b(c.r), b(c.g), b(c.b));
}

// The order of the facets in a legend; facets not listed follow in name order.
const std::vector<std::string> kFacetOrder = {"architecture", "optimizer", "stack", "ccq", "lr"};

bool varies(const std::vector<Facets>& all, const std::string& facet) {
  std::set<std::string> values;
  for (const auto& f : all) {
    auto it = f.find(facet);
    values.insert(it == f.end() ? std::string("\x01") : it->second);
  }
  return values.size() > 1;
}

std::vector<std::string> facet_names(const std::vector<Facets>& all) {
  std::set<std::string> names;
  for (const auto& f : all)
    for (const auto& [k, v] : f) names.insert(k);
  std::vector<std::string> out;
  for (const auto& k : kFacetOrder)
    if (names.count(k)) out.push_back(k);
  for (const auto& k : names)
    if (std::find(kFacetOrder.begin(), kFacetOrder.end(), k) == kFacetOrder.end()) out.push_back(k);
  return out;
}

std::string get(const Facets& f, const std::string& k) {
  auto it = f.find(k);
  return it == f.end() ? "" : it->second;
}

// Values of a facet in display order: numbers ascending, the paper's default first.
std::vector<std::string> ordered_values(const std::vector<Facets>& all, const std::string& facet) {
  std::vector<std::string> vals;
  for (const auto& f : all) {
    std::string v = get(f, facet);
    if (std::find(vals.begin(), vals.end(), v) == vals.end()) vals.push_back(v);
  }
  auto rank = [&](const std::string& v) -> int {
    if (facet == "optimizer") return v == "normuon" || v == "muon" ? 0 : v == "adamw" ? 1 : 2;
    if (facet == "ccq") return v == "true" ? 1 : 0;
    if (facet == "stack") return v == "hybrid" ? 0 : v == "pure" ? 1 : 2;
    return 0;
  };
  std::stable_sort(vals.begin(), vals.end(), [&](const std::string& a, const std::string& b) {
    char* ea = nullptr;
    char* eb = nullptr;
    const double na = std::strtod(a.c_str(), &ea), nb = std::strtod(b.c_str(), &eb);
    if (!a.empty() && !b.empty() && *ea == '\0' && *eb == '\0') return na < nb;
    return rank(a) < rank(b);
  });
  return vals;
}

size_t index_of(const std::vector<std::string>& v, const std::string& x) {
  return static_cast<size_t>(std::find(v.begin(), v.end(), x) - v.begin());
}

}  // namespace

std::string architecture_colour(const std::string& arch) {
  // Where the papers colour a mixer, the same hue (CCQ: GLA red, GDN blue; LAA Fig. 6:
  // softmax grey); the rest from a qualitative palette, dark enough for print.
  static const std::map<std::string, std::string> fixed = {
      {"softmax", "#555555"}, {"linear", "#8c564b"}, {"gla", "#d62728"},   {"deltanet", "#7b3fb5"},
      {"gdn", "#1f63b4"},     {"kda", "#f07f0e"},    {"gdn2", "#2a9a2a"},  {"carve", "#c51b8a"},
      {"mamba2", "#8a7a00"},
  };
  if (auto it = fixed.find(arch); it != fixed.end()) return it->second;
  static const char* reserve[] = {"#17a2b8", "#7f7f7f", "#b8860b", "#006d5b"};
  size_t h = 0;
  for (char c : arch) h = h * 31 + static_cast<unsigned char>(c);
  return reserve[h % 4];
}

std::string architecture_name(const std::string& arch) {
  static const std::map<std::string, std::string> names = {
      {"softmax", "Softmax"}, {"linear", "Linear"}, {"gla", "GLA"},   {"deltanet", "DeltaNet"}, {"gdn", "GDN"},
      {"kda", "KDA"},         {"gdn2", "GDN-2"},    {"carve", "CARVE"}, {"mamba2", "Mamba2"},
  };
  auto it = names.find(arch);
  return it == names.end() ? arch : it->second;
}

std::string optimizer_name(const std::string& opt) {
  if (opt == "normuon" || opt == "muon") return "Muon";
  if (opt == "adamw") return "AdamW";
  if (opt == "sgd") return "SGD";
  return opt;
}

std::string facet_words(const std::string& facet, const std::string& value) {
  if (facet == "architecture") return architecture_name(value);
  if (facet == "optimizer") return optimizer_name(value);
  if (facet == "ccq") return value == "true" ? "+CCQ" : "backbone";
  if (facet == "lr") {
    char* end = nullptr;
    const double v = std::strtod(value.c_str(), &end);
    if (end && *end == '\0' && v > 0) {
      const int e = static_cast<int>(std::floor(std::log10(v) + 1e-9));
      const double m = v / std::pow(10.0, e);
      return std::abs(m - 1) < 1e-6 ? fmt::format("lr 1e{}", e) : fmt::format("lr {:g}e{}", m, e);
    }
    return "lr " + value;
  }
  if (facet == "stack") return value;
  if (facet == "seq_len") return value + " tokens";
  const auto dot = facet.rfind('.');
  return (dot == std::string::npos ? facet : facet.substr(dot + 1)) + " " + value;
}

std::string sweep_colour(size_t i, size_t n) {
  static const char* stops[] = {"#08306b", "#6a3d9a", "#c2185b", "#e6550d", "#9a7400", "#2a9a2a"};
  if (n <= 1) return stops[0];
  if (n > 6) return stops[i % 6];
  // Spread over the first five stops: neighbours in the sweep stay far apart in colour.
  const size_t k = n <= 5 ? static_cast<size_t>(std::lround(static_cast<double>(i) * 4.0 / static_cast<double>(n - 1))) : i;
  return stops[std::min<size_t>(k, 5)];
}

std::string tint(const std::string& colour, double t) {
  Rgb c = parse(colour);
  return hex({c.r + (1 - c.r) * t, c.g + (1 - c.g) * t, c.b + (1 - c.b) * t});
}

std::string shade(const std::string& colour, double t) {
  Rgb c = parse(colour);
  return hex({c.r * (1 - t), c.g * (1 - t), c.b * (1 - t)});
}

std::vector<Style> styles_for(const std::vector<Facets>& all, const std::string& colour_by) {
  std::vector<Style> out(all.size());
  const bool stack_varies = varies(all, "stack");
  // The facet drawn as line style: the compared variant.
  std::string dash_facet;
  if (colour_by != "optimizer" && varies(all, "optimizer")) dash_facet = "optimizer";
  else if (colour_by != "ccq" && varies(all, "ccq")) dash_facet = "ccq";
  else
    for (const auto& k : facet_names(all))
      if (k != "architecture" && k != "stack" && k != colour_by && varies(all, k)) {
        dash_facet = k;
        break;
      }
  const auto dash_values = dash_facet.empty() ? std::vector<std::string>{} : ordered_values(all, dash_facet);
  const auto sweep_values = colour_by.empty() ? std::vector<std::string>{} : ordered_values(all, colour_by);
  static const int dashes[] = {1, 2, 4, 3};
  static const int sweep_markers[][2] = {{7, 6}, {9, 8}, {5, 4}, {13, 12}, {11, 10}, {15, 14}};
  for (size_t i = 0; i < all.size(); ++i) {
    const Facets& f = all[i];
    Style& s = out[i];
    s.colour = architecture_colour(get(f, "architecture"));
    const std::string stack = get(f, "stack");
    if (stack == "pure") s.marker = 9, s.open_marker = 8;
    else if (stack == "dense") s.marker = 5, s.open_marker = 4;
    else if (stack == "hybrid" || stack.empty()) s.marker = 7, s.open_marker = 6;
    else s.marker = 13, s.open_marker = 12;
    // Two stacks of one mixer: the pure stack a darker shade of the mixer's colour.
    if (stack_varies && stack == "pure") s.colour = shade(s.colour, 0.38);
    if (!colour_by.empty()) {
      const size_t k = index_of(sweep_values, get(f, colour_by));
      s.colour = sweep_colour(k, sweep_values.size());
      s.marker = sweep_markers[k % 6][0];
      s.open_marker = sweep_markers[k % 6][1];
    }
    if (!dash_facet.empty()) s.dash = dashes[index_of(dash_values, get(f, dash_facet)) % 4];
  }
  return out;
}

std::vector<std::string> legends_for(const std::vector<Facets>& all, bool with_architecture) {
  std::vector<std::string> shown;
  for (const auto& k : facet_names(all))
    if (varies(all, k) || (k == "architecture" && with_architecture)) shown.push_back(k);
  const bool ccq_shown = std::find(shown.begin(), shown.end(), "ccq") != shown.end();
  const bool arch_shown = std::find(shown.begin(), shown.end(), "architecture") != shown.end();
  std::vector<std::string> out;
  for (const auto& f : all) {
    std::vector<std::string> words;
    for (const auto& k : shown) {
      const std::string v = get(f, k);
      if (k == "ccq") continue;  // folded into the mixer's name, as the CCQ paper writes it
      if (k == "architecture" && ccq_shown) {
        words.push_back((get(f, "ccq") == "true" ? "CCQ-" : "") + architecture_name(v));
        continue;
      }
      words.push_back(v.empty() ? "—" : facet_words(k, v));
    }
    if (ccq_shown && !arch_shown)
      words.insert(words.begin(), (get(f, "ccq") == "true" ? "CCQ-" : "") + architecture_name(get(f, "architecture")));
    std::string text;
    for (const auto& w : words) text += (text.empty() ? "" : " · ") + w;
    if (text.empty()) text = f.count("architecture") ? architecture_name(get(f, "architecture")) : "ours";
    out.push_back(text);
  }
  return out;
}

std::string axis_label(const std::string& name) {
  static const std::map<std::string, std::string> labels = {
      {"final_loss", "final validation loss (nats/token)"},
      {"saturation_loss", "saturation loss (nats/token)"},
      {"val_loss", "validation loss (nats/token)"},
      {"loss", "training loss (nats/token)"},
      {"rel_throughput_pct", "relative throughput (%, GDN · AdamW · pure = 100)"},
      {"sec_per_iter", "time per iteration (s)"},
      {"iter_time_s", "time per iteration (s)"},
      {"tokens_per_s", "throughput (tokens/s)"},
      {"tok_s", "throughput (tokens/s)"},
      {"peak_mem_gb", "peak memory (GiB)"},
      {"lr", "peak learning rate"},
      {"seq_len", "sequence length (tokens)"},
      {"context", "context length (tokens)"},
      {"tokens", "training tokens"},
      {"step", "training step"},
      {"ppl", "validation perplexity"},
      {"wiki_ppl", "validation perplexity"},
      {"wikitext_ppl", "validation perplexity"},
  };
  auto it = labels.find(name);
  return it == labels.end() ? name : it->second;
}

std::string short_label(const Facets& f) {
  std::string s = (get(f, "ccq") == "true" ? "CCQ-" : "") + architecture_name(get(f, "architecture"));
  const std::string o = get(f, "optimizer");
  if (!o.empty()) s += "·" + optimizer_name(o).substr(0, 1);
  const std::string st = get(f, "stack");
  if (!st.empty()) s += "·" + st.substr(0, st == "dense" ? 5 : 3);
  return s;
}

}  // namespace lar::report
