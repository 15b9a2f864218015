#pragma once
// An exception's message for our own error messages: LibTorch's c10::Error appends a C++
// backtrace to what(), which tells a user nothing about their file or job.
#include <exception>
#include <stdexcept>
#include <string>

#include <c10/util/Exception.h>

namespace ddp {

// The one rule for the library's own errors: "<who>: <what was wrong and what to do>", <who> being
// the API the user called (ddp::init_process_group, DistributedDataParallel, ...). Bad arguments
// and environments throw std::invalid_argument, a call at the wrong moment or a failed step
// std::runtime_error (or a subclass: CheckpointError), a failed collective CollectiveError.
template <typename Error>
[[noreturn]] void raise(const char* who, const std::string& what) {
  throw Error(std::string(who) + ": " + what);
}

inline std::string error_text(const std::exception& error) {
  if (const auto* torch_error = dynamic_cast<const c10::Error*>(&error)) return torch_error->what_without_backtrace();
  return error.what();
}

}  // namespace ddp
