// Runs files through the fuzz target without libFuzzer (any compiler):
//   fuzz_replay FILE_OR_DIR...     each file once, printing what became of it. A seed-checkpoint-*
//                                  file must load both ways, a seed-state-dict-* file as a state
//                                  dict; any other may load or be refused with a CheckpointError; a
//                                  crash ends the process.
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
    const ddp::fuzz::Outcomes before = ddp::fuzz::outcomes;
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    const bool as_checkpoint = ddp::fuzz::outcomes.loaded_checkpoint > before.loaded_checkpoint;
    const bool as_state_dict = ddp::fuzz::outcomes.loaded_state_dict > before.loaded_state_dict;
    const std::string name = file.filename().string();
    std::cout << name << ": checkpoint " << (as_checkpoint ? "loaded" : "refused") << ", state dict "
              << (as_state_dict ? "loaded" : "refused")
              << (ddp::fuzz::outcomes.refused > before.refused ? " (last refusal: " + ddp::fuzz::outcomes.last_error + ")" : "")
              << "\n";
    if ((name.rfind("seed-checkpoint-", 0) == 0 && !as_checkpoint) || (name.rfind("seed-", 0) == 0 && !as_state_dict)) {
      std::cerr << "a seed-checkpoint-* file must load both ways, a seed-state-dict-* file as a state dict\n";
      return 1;
    }
  }
  std::cout << files.size() << " inputs, each loaded twice: " << ddp::fuzz::outcomes.loaded_checkpoint
            << " loaded as checkpoints, " << ddp::fuzz::outcomes.loaded_state_dict << " as state dicts, "
            << ddp::fuzz::outcomes.refused << " loads refused with a CheckpointError, none crashed\n";
  return 0;
}
