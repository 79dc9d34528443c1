#include "trainer/data/documents.hpp"

#include <cstring>
#include <fstream>
#include <sstream>

#include "core/error.hpp"
#include "core/json.hpp"

namespace lar::data {

namespace fs = std::filesystem;

InputFormat input_format(const fs::path& file, const std::string& format) {
  if (format == "text") return InputFormat::text;
  if (format == "jsonl") return InputFormat::jsonl;
  if (format != "auto") throw UserError("unknown input format '" + format + "' (expected auto, text or jsonl)");
  const auto ext = file.extension().string();
  return (ext == ".jsonl" || ext == ".json") ? InputFormat::jsonl : InputFormat::text;
}

void check_inputs_exist(const std::vector<fs::path>& inputs) {
  if (inputs.empty()) throw UserError("no input files given (--input FILE...)");
  for (const auto& f : inputs) {
    std::error_code ec;
    if (!fs::exists(f, ec)) throw UserError(f.string() + ": no such input file");
    if (!fs::is_regular_file(f, ec)) throw UserError(f.string() + ": not a regular file");
  }
}

namespace {

// For text files the reported line is the NUL's own line; for JSONL it is the record's.
void check_no_nul(const std::string& text, const std::string& file, long first_line, bool count_lines) {
  const char* nul = static_cast<const char*>(std::memchr(text.data(), '\0', text.size()));
  if (!nul) return;
  long line = first_line;
  if (count_lines)
    for (const char* p = text.data(); p < nul; ++p) line += (*p == '\n');
  throw UserError(SourceLoc{file, static_cast<int>(line), 0},
                  "NUL byte in the text (id 0 is the document separator of the byte tokenizer; remove it)");
}

}  // namespace

void for_each_document(const fs::path& file, InputFormat format, const std::function<void(Document&&)>& fn) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw UserError(file.string() + ": cannot open input file");
  const std::string name = file.string();
  if (format == InputFormat::text) {
    std::ostringstream ss;
    ss << in.rdbuf();
    Document d{ss.str(), name, 1};
    check_no_nul(d.text, name, 1, true);
    if (!d.text.empty()) fn(std::move(d));
    return;
  }
  std::string line;
  long n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    json j;
    try {
      j = json::parse(line);
    } catch (const json::parse_error& e) {
      // nlohmann reports "[json.exception.parse_error.101] parse error at line 1, column 7: …";
      // keep the part after the position, which says what was wrong.
      std::string what = e.what();
      auto colon = what.find(": ", what.find("column"));
      if (colon != std::string::npos) what = what.substr(colon + 2);
      throw UserError(SourceLoc{name, static_cast<int>(n), static_cast<int>(e.byte)}, "bad JSON line: " + what);
    }
    if (!j.is_object()) throw UserError(SourceLoc{name, static_cast<int>(n), 1}, "JSONL line is not an object");
    auto it = j.find("text");
    if (it == j.end() || !it->is_string())
      throw UserError(SourceLoc{name, static_cast<int>(n), 1}, "JSONL object has no string field \"text\"");
    Document d{it->get<std::string>(), name, n};
    check_no_nul(d.text, name, n, false);
    if (!d.text.empty()) fn(std::move(d));
  }
  if (in.bad()) throw RuntimeError("error reading " + name);
}

}  // namespace lar::data
