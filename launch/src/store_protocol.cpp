#include "store_protocol.h"

namespace ddprun {

void LineReader::append(const char* data, size_t size) {
  if (start_ > 0 && start_ * 2 >= buffer_.size()) {  // keep the buffer small: drop what was read
    buffer_.erase(0, start_);
    scanned_ -= start_;
    start_ = 0;
  }
  buffer_.append(data, size);
}

std::optional<std::string> LineReader::next() {
  if (too_long_) return std::nullopt;
  const size_t newline = buffer_.find('\n', scanned_);
  if (newline == std::string::npos) {
    scanned_ = buffer_.size();
    too_long_ = scanned_ - start_ > kMaxStoreLine;
    return std::nullopt;
  }
  if (newline - start_ > kMaxStoreLine) {
    too_long_ = true;
    return std::nullopt;
  }
  std::string line = buffer_.substr(start_, newline - start_);
  start_ = scanned_ = newline + 1;
  return line;
}

std::string StoreTable::apply(std::string_view request) {
  // "<command> <key>[ <value>]": the key ends at the second space; the value is the rest.
  const size_t space = request.find(' ');
  if (space == std::string_view::npos) return "ERROR expected '<command> <key> [value]'";
  const std::string_view command = request.substr(0, space);
  std::string_view key = request.substr(space + 1);
  std::string_view value;
  if (const size_t key_end = key.find(' '); key_end != std::string_view::npos) {
    value = key.substr(key_end + 1);
    key = key.substr(0, key_end);
  }
  if (key.empty()) return "ERROR empty key";
  if (command == "SET") {
    data_.insert_or_assign(std::string(key), std::string(value));
    return "OK";
  }
  const auto it = data_.find(key);
  if (command == "GET") return it == data_.end() ? "NONE" : "VALUE " + it->second;
  if (command != "ADD") return "ERROR unknown command";
  const auto amount = parse_number(value, -kMaxStoreNumber, kMaxStoreNumber);
  if (!amount) return "ERROR ADD needs a whole number within +-1e12";
  const auto current = it == data_.end() ? std::optional<long long>(0)
                                         : parse_number(it->second, -kMaxStoreNumber, kMaxStoreNumber);
  if (!current) return "ERROR the key's value is not a number";
  const long long sum = *current + *amount;
  if (sum < -kMaxStoreNumber || sum > kMaxStoreNumber) return "ERROR the sum would leave +-1e12";
  data_.insert_or_assign(std::string(key), std::to_string(sum));
  return std::to_string(sum);
}

}  // namespace ddprun
