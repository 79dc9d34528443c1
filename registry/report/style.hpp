#pragma once
// The visual grammar shared by every figure (gnuplot) and the dashboard's charts (serve):
//  - colour by architecture, one fixed colour per mixer in every figure;
//  - shade and marker by stack (hybrid: the colour, ●; pure: darker, ▲; dense: ■);
//  - line style by the variant the figure compares: optimiser (Muon solid, AdamW dashed,
//    as LAA Fig. 5), else CCQ (backbone solid, +CCQ dashed, as CCQ Fig. 5);
//  - legends in words ("GDN · Muon · hybrid"), naming only the facets that vary;
//  - axis labels with units.
#include <map>
#include <string>
#include <vector>

namespace lar::report {

// What a series is, as display-ready facet values ("architecture" → "gdn", "optimizer" →
// "normuon", "stack" → "hybrid", "ccq" → "true", "lr" → "0.001", …).
using Facets = std::map<std::string, std::string>;

struct Style {
  std::string colour = "#333333";  // "#rrggbb"
  int dash = 1;                    // gnuplot dashtype: 1 solid, 2 dashed, 3 dotted, 4 dash-dot
  int marker = 7;                  // gnuplot pointtype of the filled marker (open = marker - 1)
  int open_marker = 6;
  double width = 2.0;              // line width (points)
};

// Fixed per-architecture colour ("#rrggbb"); unknown architectures get a stable colour
// from a reserve palette by name.
std::string architecture_colour(const std::string& arch);
// Printed names: "gdn" → "GDN", "normuon" → "Muon", "gdn2" → "GDN-2", "deltanet" → "DeltaNet".
std::string architecture_name(const std::string& arch);
std::string optimizer_name(const std::string& opt);
// A facet value in words ("ccq" "true" → "+CCQ", "lr" "0.001" → "lr 1e-3").
std::string facet_words(const std::string& facet, const std::string& value);

// Colour of the i-th value of an ordered numeric sweep (learning rates): a dark-to-warm ramp
// that stays readable on white; i in [0, n).
std::string sweep_colour(size_t i, size_t n);

// Mix a colour with white (t = 0: unchanged, 1: white) or black (shade).
std::string tint(const std::string& colour, double t);
std::string shade(const std::string& colour, double t);

// The style of every series of one figure: facets that vary across `all` are encoded
// (colour: architecture — or, with `colour_by` set, that facet's sweep ramp —, line
// style: optimiser else ccq, shade and marker: stack).
std::vector<Style> styles_for(const std::vector<Facets>& all, const std::string& colour_by = "");

// The legend text of each series: the architecture (it anchors the colour; left out with
// `with_architecture` false, when the colour means another facet) and the facets that
// vary, in words, joined by " · ".
std::vector<std::string> legends_for(const std::vector<Facets>& all, bool with_architecture = true);

// Axis label with units for a metric or axis name ("final_loss" → "final validation loss
// (nats/token)"); unknown names are returned as they are.
std::string axis_label(const std::string& name);

// Short point label for the frontier ("KDA·M·hyb").
std::string short_label(const Facets& f);

}  // namespace lar::report
