#pragma once
#include <string>
#include <string_view>

namespace lar {
// SHA-256 of the bytes, as 64 lowercase hex digits (OpenSSL).
std::string sha256_hex(std::string_view bytes);
}  // namespace lar
