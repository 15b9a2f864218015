// "Everyone leaves save_checkpoint only when the file is complete": rank 1 checks the moment its
// save_checkpoint returns, with no sleep or extra barrier, while rank 0 wrote ~40 MiB (long enough
// that a missing barrier would let rank 1 see no file, a temporary one, or a short one).
#include <sys/stat.h>

#include <filesystem>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/checkpoint.h>

#include "multiprocess.h"

namespace {

using ddp::test::require;

struct Big : torch::nn::Module {
  Big() { weight = register_parameter("weight", torch::zeros({3200, 3200})); }  // 40.96 MB
  torch::Tensor weight;
};

DDP_WORKER(file_complete_when_save_returns) {
  auto pg = ddp::test::worker_init();
  const int rank = ddp::get_rank();
  const std::string path = ddp::test::shared_dir() + "/big.pt";
  Big model;
  {
    torch::NoGradGuard no_grad;
    model.weight.copy_(torch::arange(3200 * 3200, torch::kFloat).reshape({3200, 3200}));
  }
  ddp::save_checkpoint(path, model, nullptr, {});
  // Right away, as a user's next line would: stat and load.
  struct stat info {};
  const bool exists = ::stat(path.c_str(), &info) == 0;
  const auto size_on_return = static_cast<int64_t>(exists ? info.st_size : -1);
  require(exists, "rank " + std::to_string(rank) + ": " + path + " does not exist when save_checkpoint returns");
  for (const auto& entry : std::filesystem::directory_iterator(ddp::test::shared_dir())) {
    const std::string name = entry.path().filename().string();
    require(name.rfind("big.pt.", 0) != 0, "temporary file " + name + " still there on return");
  }
  require(size_on_return > 40'000'000, "only " + std::to_string(size_on_return) + " bytes on return");
  Big loaded;
  ddp::load_checkpoint(path, loaded, nullptr);
  require(torch::equal(loaded.weight, model.weight), "rank " + std::to_string(rank) + " loaded other values");
  // Rank 0 wrote the file, so its size is the final one: rank 1 must have seen exactly that.
  at::Tensor sizes = torch::tensor({size_on_return, size_on_return});
  ddp::all_reduce(sizes);  // sum of both ranks' sizes
  require(sizes[0].item<int64_t>() == 2 * size_on_return,
          "rank " + std::to_string(rank) + " saw " + std::to_string(size_on_return) + " bytes, the ranks disagree");
}

TEST(SaveCompleteOnReturn, EveryRankFindsTheWholeFileTheMomentSaveReturns) {
  EXPECT_WORKERS_OK(ddp::test::run_workers("file_complete_when_save_returns", 2));
}

}  // namespace
