// libFuzzer target: ddp::load_checkpoint on any bytes. The input is a checkpoint's archive (the
// file without its trailer); the target seals it with a fresh, valid trailer first, so damage
// anywhere inside reaches the readers behind the checksum, as it does for a file someone altered
// and re-sealed (issue 17). Each input is loaded twice, as a checkpoint (load_checkpoint) and as a
// model state (load_state_dict). The rule checked: every load succeeds or is refused with a
// ddp::CheckpointError; anything else escaping, or a crash, is a finding.
//
// Built two ways (CMakeLists.txt beside this file): with clang -fsanitize=fuzzer by
// scripts/fuzz.sh, with pickle_mutator.cpp (mutations inside the archive's pickles, the archive
// rewritten around them) and pickle.dict; and with replay_main.cpp as the test
// fuzz.CorpusLoadsOrIsRefused, which runs every file in corpus/ (the seeds, each input a fuzzing
// run once found, and make_nesting_inputs.py's) through this target.
#include "load_checkpoint_fuzzer.h"

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <ddp/checkpoint.h>
#include <ddp/grad_scaler.h>

namespace {

// Small, but with every kind of record a checkpoint holds: parameters, buffers (an int64 one
// among them), Adam's per-parameter state, a GradScaler's snapshot, the RNG state.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    linear = register_module("linear", torch::nn::Linear(4, 3));
    norm = register_module("norm", torch::nn::BatchNorm1d(3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return norm(linear(x)); }
  torch::nn::Linear linear{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
};
TORCH_MODULE(Net);

// The file each input is written to; removed when the process exits normally.
struct ScratchFile {
  ScratchFile() {
    const char* dir = std::getenv("TMPDIR");
    path = std::string(dir && *dir ? dir : "/tmp") + "/torchddp-fuzz-" + std::to_string(::getpid()) + ".pt";
    torch::set_num_threads(1);  // tiny tensors: threads would only cost
  }
  ~ScratchFile() { std::remove(path.c_str()); }
  std::string path;
};

const std::string& scratch_path() {
  static const ScratchFile file;
  return file.path;
}

}  // namespace

namespace ddp::fuzz {

Outcomes outcomes;

void write_seed(const std::string& path) {
  torch::manual_seed(0);
  Net net;
  torch::optim::Adam optimizer(net->parameters());
  net->forward(torch::randn({5, 4})).sum().backward();
  optimizer.step();
  GradScaler scaler;
  const std::string sealed = path + ".sealed";
  save_checkpoint(sealed, *net, &optimizer, TrainingState{1, 2, {}, {{"note", "seed"}}},
                  CheckpointOptions().state("scaler", &scaler));
  const std::vector<char> archive = read_checkpoint_file(sealed);  // verified, trailer removed
  std::ofstream(path, std::ios::binary).write(archive.data(), static_cast<std::streamsize>(archive.size()));
  std::remove(sealed.c_str());
}

}  // namespace ddp::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<char> bytes(reinterpret_cast<const char*>(data), reinterpret_cast<const char*>(data) + size);
  try {
    ddp::seal_archive(bytes);
  } catch (const ddp::CheckpointError&) {
    // Not ending like a zip archive: written as is, for the trailer check to refuse.
  }
  std::ofstream(scratch_path(), std::ios::binary | std::ios::trunc)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  // Refused with a message is the expected outcome for a damaged file; anything else escapes.
  auto attempt = [](int& loaded, const std::function<void()>& load) {
    try {
      load();
      ++loaded;
    } catch (const ddp::CheckpointError& error) {
      ++ddp::fuzz::outcomes.refused;
      ddp::fuzz::outcomes.last_error = error.what();
    }
  };
  // 1. The whole checkpoint, as a resumed job reads it.
  attempt(ddp::fuzz::outcomes.loaded_checkpoint, [] {
    Net net;
    torch::optim::Adam optimizer(net->parameters());
    ddp::GradScaler scaler;
    ddp::load_checkpoint(scratch_path(), *net, &optimizer, ddp::LoadOptions().state("scaler", &scaler));
  });
  // 2. The model state alone, as ddp::load_state_dict reads it: also files from Python's
  //    torch.save, whose pickle is rewritten before LibTorch reads it.
  attempt(ddp::fuzz::outcomes.loaded_state_dict, [] { ddp::load_state_dict(scratch_path()); });
  return 0;
}
