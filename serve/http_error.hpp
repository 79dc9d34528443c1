#pragma once
// An error that becomes an HTTP status: 400 bad request, 403 forbidden, 404 not found,
// 413 too large. The message is shown to the client, so it never holds SQL or file
// contents — only the offending request value.
#include <stdexcept>
#include <string>

namespace lar::serve {

class HttpError : public std::runtime_error {
 public:
  HttpError(int status, const std::string& message) : std::runtime_error(message), status_(status) {}
  int status() const { return status_; }

 private:
  int status_;
};

}  // namespace lar::serve
