#pragma once
// LibTorch's errors run to paragraphs (the dispatcher's list of backends, "If you are a Facebook
// employee using PyTorch on mobile ..."): a checkpoint's error names the file and the fault, then
// quotes only the first line of LibTorch's text. Our own messages are kept whole.
#include <exception>
#include <string>

#include <c10/util/Exception.h>

#include "ddp/internal/diagnostics/error_text.h"

namespace ddp {

inline std::string error_line(const std::exception& error) {
  const std::string text = error_text(error);
  if (dynamic_cast<const c10::Error*>(&error) == nullptr) return text;
  const std::size_t start = text.find_first_not_of('\n');
  if (start == std::string::npos) return text;
  return text.substr(start, text.find('\n', start) - start);
}

}  // namespace ddp
