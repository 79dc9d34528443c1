#pragma once
// Reading documents from the inputs of `lar data prepare` / `lar data tokenizer train`.
//   text  — a whole file is one document;
//   jsonl — one JSON object per line, the document is its string field "text"; blank
//           lines are skipped. `auto` picks jsonl for *.jsonl / *.json, text otherwise.
// Every problem is a UserError naming file:line (missing file, bad JSON, no "text",
// a NUL byte, which the byte tokenizer reserves as the document separator).
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

namespace lar::data {

struct Document {
  std::string text;
  std::string file;
  long line = 0;  // 1-based line where it starts
};

enum class InputFormat { text, jsonl };
InputFormat input_format(const std::filesystem::path& file, const std::string& format);  // format: auto|text|jsonl

// Calls fn for every non-empty document of `file`, in order.
void for_each_document(const std::filesystem::path& file, InputFormat format,
                       const std::function<void(Document&&)>& fn);

// Throws UserError when a file is missing or not a regular file.
void check_inputs_exist(const std::vector<std::filesystem::path>& inputs);

}  // namespace lar::data
