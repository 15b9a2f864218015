// Fuzz target for the launchers' store protocol (launch/src/store_protocol.h): any bytes a client
// may send, cut into reads of any size, through the line reader and the table. What must hold:
// no crash, no line over the limit, every reply one line of bounded size, numbers in range.
//   with libFuzzer: scripts/fuzz.sh (store_fuzzer);  without: store_fuzz_replay FILE_OR_DIR...
#include <cstdint>
#include <cstdlib>
#include <string>

#include "store_protocol.h"

namespace {

void check(bool condition) {
  if (!condition) std::abort();  // the fuzzer reports the input that broke a rule
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  // The first byte says how the stream is cut into reads (1 to 256 bytes each).
  const size_t piece = static_cast<size_t>(data[0]) + 1;
  const char* bytes = reinterpret_cast<const char*>(data + 1);
  const size_t length = size - 1;
  ddprun::LineReader reader;
  ddprun::StoreTable table;
  for (size_t at = 0; at < length && !reader.too_long(); at += piece) {
    reader.append(bytes + at, std::min(piece, length - at));
    while (auto line = reader.next()) {
      check(line->size() <= ddprun::kMaxStoreLine && line->find('\n') == std::string::npos);
      const std::string reply = table.apply(*line);
      check(reply.find('\n') == std::string::npos && reply.size() <= ddprun::kMaxStoreLine + 8);
      if (line->rfind("ADD ", 0) == 0 && reply.rfind("ERROR", 0) != 0) {
        check(ddprun::parse_number(reply, -ddprun::kMaxStoreNumber, ddprun::kMaxStoreNumber).has_value());
      }
    }
  }
  return 0;
}

#ifdef STORE_FUZZ_REPLAY
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <vector>

// Each file once through the target; a broken rule aborts.
int main(int argc, char** argv) {
  size_t count = 0;
  for (int i = 1; i < argc; ++i) {
    for (const auto& entry : std::filesystem::directory_iterator(argv[i])) {
      std::ifstream in(entry.path(), std::ios::binary);
      const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
      ++count;
    }
  }
  std::cout << count << " store inputs answered, none broke a rule\n";
  return count > 0 ? 0 : 1;
}
#endif
