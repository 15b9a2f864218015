// Runs files through the fuzz target without libFuzzer (any compiler):
//   fuzz_replay FILE_OR_DIR...     each file once, printing what became of it. A file named seed-*
//                                  must load; any other may load or be refused with a
//                                  CheckpointError; a crash ends the process.
//   fuzz_replay --write-seed FILE  writes a seed input (load_checkpoint_fuzzer.h)
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "load_checkpoint_fuzzer.h"

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--write-seed") {
    ddp::fuzz::write_seed(argv[2]);
    return 0;
  }
  std::vector<std::filesystem::path> files;
  for (int i = 1; i < argc; ++i) {
    if (std::filesystem::is_directory(argv[i])) {
      for (const auto& entry : std::filesystem::directory_iterator(argv[i])) files.push_back(entry.path());
    } else {
      files.emplace_back(argv[i]);
    }
  }
  if (files.empty()) {
    std::cerr << "usage: fuzz_replay FILE_OR_DIR... | --write-seed FILE\n";
    return 2;
  }
  std::sort(files.begin(), files.end());
  for (const auto& file : files) {
    std::ifstream in(file, std::ios::binary);
    const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const int loaded_before = ddp::fuzz::outcomes.loaded;
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    const bool loaded = ddp::fuzz::outcomes.loaded > loaded_before;
    std::cout << file.filename().string() << ": " << (loaded ? "loaded" : "refused: " + ddp::fuzz::outcomes.last_error) << "\n";
    if (file.filename().string().rfind("seed-", 0) == 0 && !loaded) {
      std::cerr << "a seed must load\n";
      return 1;
    }
  }
  std::cout << files.size() << " inputs: " << ddp::fuzz::outcomes.loaded << " loaded, " << ddp::fuzz::outcomes.refused
            << " refused with a CheckpointError, none crashed\n";
  return 0;
}
