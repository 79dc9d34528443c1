#pragma once
// Text forms of a Report: the paper table (Markdown, LaTeX/booktabs, CSV, JSON) and the
// audit (Markdown, JSON). Pure functions of the Report, so golden-string tests pin them.
#include <string>

#include "core/json.hpp"
#include "registry/report/report.hpp"

namespace lar::report {

std::string table_markdown(const Report& r);
std::string table_latex(const Report& r);
std::string table_csv(const Report& r);
json table_json(const Report& r);

std::string audit_markdown(const Report& r);
// The audit's claims section (empty when the spec declares none) and its JSON form.
std::string claims_markdown(const Report& r);
json claims_json(const Report& r);
json audit_json(const Report& r);

// Dispatch on "md" | "latex" | "csv" | "json"; throws lar::UserError naming the format.
std::string render_table(const Report& r, const std::string& format);
std::string render_audit(const Report& r, const std::string& format);  // "md" | "json"

// "2.413 ± 0.004 (n=3)", "2.413 (1 seed)", "—" — the cell text used by every format.
std::string format_value(const MetricValue& v, int decimals);
std::string format_delta(const Delta& d, int decimals);

}  // namespace lar::report
