#pragma once
// What a call throws, as text: the one helper of the tests that check error messages.
#include <exception>
#include <functional>
#include <string>

namespace ddp::test {

// The message of the E that `action` throws, "" when it throws nothing. An exception of another
// type is not caught: the test fails with it, so checking a message also checks the exception's type.
template <typename E = std::exception>
std::string error_of(const std::function<void()>& action) {
  try {
    action();
  } catch (const E& error) {
    return error.what();
  }
  return "";
}

}  // namespace ddp::test
