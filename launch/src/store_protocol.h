#pragma once
// What the launchers' store says, apart from its sockets, so it can be tested and fuzzed alone.
// One request line and one reply line each ('\n'-terminated, at most kMaxStoreLine bytes; keys
// have no spaces, values no newlines):
//   SET key value -> OK        GET key -> VALUE value | NONE        ADD key n -> the new number
// Anything else gets "ERROR <why>". Requests are taken only on a connection that proved it knows
// the job's token (store.h).
#include <cstddef>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "number.h"

namespace ddprun {

constexpr size_t kMaxStoreLine = 4096;
constexpr long long kMaxStoreNumber = 1000000000000LL;  // counters and ADD amounts stay within +-1e12

// Cuts a byte stream into lines. Each byte is scanned once, however the stream arrives; a line
// longer than kMaxStoreLine marks the stream bad (its connection is dropped).
class LineReader {
 public:
  void append(const char* data, size_t size);
  // The next complete line, without its '\n'.
  std::optional<std::string> next();
  bool too_long() const { return too_long_; }

 private:
  std::string buffer_;
  size_t start_ = 0;    // where the next line begins
  size_t scanned_ = 0;  // bytes before this hold no '\n' after start_
  bool too_long_ = false;
};

// The store's keys and values.
class StoreTable {
 public:
  // Applies one request line; returns the reply line (without '\n').
  std::string apply(std::string_view request);

 private:
  std::map<std::string, std::string, std::less<>> data_;
};

}  // namespace ddprun
