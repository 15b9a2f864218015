#pragma once
// An exception's message for our own error messages: LibTorch's c10::Error appends a C++
// backtrace to what(), which tells a user nothing about their file or job.
#include <exception>
#include <string>

#include <c10/util/Exception.h>

namespace ddp {

inline std::string error_text(const std::exception& error) {
  if (const auto* torch_error = dynamic_cast<const c10::Error*>(&error)) return torch_error->what_without_backtrace();
  return error.what();
}

}  // namespace ddp
