#pragma once
// Text helpers of the dashboard: HTML escaping, URL encoding, and the validation of
// request values (names, numbers) that reach the registry.
#include <cstddef>
#include <string>
#include <string_view>

namespace lar::serve {

// & < > " ' → entities. Everything that reaches a page from the registry, the spec files
// or the request passes through this (or through svg_text for SVG).
std::string html_escape(std::string_view s);

// Percent-encodes everything but unreserved characters (RFC 3986): safe inside a path
// segment or a query value.
std::string url_encode(std::string_view s);

// An identifier-like request value (experiment, cell id, axis name, metric name, paper,
// table, scale): 1..max_len characters from [A-Za-z0-9._+=:@,-]. Keeps quotes, slashes,
// spaces and control characters out of everything the server looks up.
bool valid_name(std::string_view s, size_t max_len = 128);

// A filter value (axis value): like valid_name, plus '/', ' ' and '%' (1..max_len).
bool valid_value(std::string_view s, size_t max_len = 128);

// Parses a non-negative integer ≤ max; throws HttpError 400 naming `what` otherwise.
size_t parse_count(const std::string& text, size_t max, const char* what);

// 12345.678 → "1.235e+04"-style compact text for tables ("-" for NaN).
std::string num_text(double v, int digits = 4);

}  // namespace lar::serve
