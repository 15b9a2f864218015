// Damaged or mismatched checkpoints: each gives an error that names the file and the problem.
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/checkpoint.h>

#include "models.h"
#include "multiprocess.h"

namespace {

using ckpt_test::contains;
using ckpt_test::ToyModel;

class Corruption : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ddp::test::make_temp_dir("ckpt-corrupt");
    path_ = dir_ + "/ckpt.pt";
    torch::optim::Adam optimizer(model_->parameters());
    ddp::save_checkpoint(path_, *model_, &optimizer, {});
    size_ = std::filesystem::file_size(path_);
  }
  void TearDown() override { ddp::test::remove_tree(dir_); }

  std::string load_error(const std::string& path) {
    ToyModel target;
    try {
      ddp::load_checkpoint(path, *target, nullptr);
    } catch (const ddp::CheckpointError& error) {
      return error.what();
    }
    return "no error";
  }
  std::string copy_truncated(std::uintmax_t size) {
    const std::string copy = dir_ + "/cut-" + std::to_string(size) + ".pt";
    std::filesystem::copy_file(path_, copy);
    std::filesystem::resize_file(copy, size);
    return copy;
  }
  void flip_byte(const std::string& path, std::uintmax_t offset) {
    std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(static_cast<std::streamoff>(offset));
    char byte = 0;
    file.read(&byte, 1);
    byte = static_cast<char>(byte ^ 0x01);
    file.seekp(static_cast<std::streamoff>(offset));
    file.write(&byte, 1);
  }

  ToyModel model_;
  std::string dir_, path_;
  std::uintmax_t size_ = 0;
};

TEST_F(Corruption, TruncatedFilesNameTheByteWhereTheyEnd) {
  for (std::uintmax_t size : {std::uintmax_t{0}, std::uintmax_t{10}, size_ / 2, size_ - 1}) {
    const std::string cut = copy_truncated(size);
    EXPECT_EQ(load_error(cut), "checkpoint " + cut + " is truncated at byte " + std::to_string(size) +
                                   ": its end-of-checkpoint trailer is missing (an interrupted write or a cut copy)");
  }
}

TEST_F(Corruption, FlippedBytesAreChecksumMismatches) {
  // Anywhere: tensor data, zip headers, the zip directory.
  for (std::uintmax_t offset : {std::uintmax_t{0}, size_ / 3, size_ / 2, size_ - 100}) {
    const std::string copy = dir_ + "/flip-" + std::to_string(offset) + ".pt";
    std::filesystem::copy_file(path_, copy);
    flip_byte(copy, offset);
    const std::string message = load_error(copy);
    EXPECT_TRUE(contains(message, "checksum mismatch in " + copy + ": stored crc32 ")) << message;
    EXPECT_TRUE(contains(message, "(the file is corrupted)")) << message;
  }
  // Inside the trailer's numbers: still a checksum error, never a crash.
  const std::string copy = dir_ + "/flip-trailer.pt";
  std::filesystem::copy_file(path_, copy);
  flip_byte(copy, size_ - 3);  // a hex digit of the stored CRC ('0'..'9' ^ 1 stays a digit)
  EXPECT_TRUE(contains(load_error(copy), "checksum mismatch in " + copy)) << load_error(copy);
  std::filesystem::copy_file(path_, dir_ + "/size.pt");
  {
    std::fstream file(dir_ + "/size.pt", std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(static_cast<std::streamoff>(size_ - 20));  // inside "bytes=<16 hex>"
    file.write("zz", 2);
  }
  EXPECT_EQ(load_error(dir_ + "/size.pt"), "checksum mismatch in " + dir_ + "/size.pt: its trailer is damaged");
}

TEST_F(Corruption, WrongModelListsEveryMismatch) {
  ckpt_test::OtherModel other;
  try {
    ddp::load_checkpoint(path_, *other, nullptr);
    FAIL() << "loaded into a different model";
  } catch (const ddp::CheckpointError& error) {
    EXPECT_EQ(std::string(error.what()),
              "checkpoint " + path_ + " does not match the model:"
              "\n  shape mismatch: net2.weight is [5, 10] in checkpoint " + path_ + ", [7, 10] in the model, "
              "net2.bias is [5] in checkpoint " + path_ + ", [7] in the model"
              "\n  missing in checkpoint " + path_ + ": extra");
  }
  // Nothing was half-loaded: the model keeps its own values when the check fails.
  const auto before = other->net1->weight.clone();
  EXPECT_THROW(ddp::load_checkpoint(path_, *other, nullptr), ddp::CheckpointError);
  EXPECT_TRUE(torch::equal(other->net1->weight, before));
}

TEST_F(Corruption, UnexpectedNamesAreListed) {
  struct Smaller : torch::nn::Module {
    Smaller() { net1 = register_module("net1", torch::nn::Linear(10, 10)); }
    torch::nn::Linear net1{nullptr};
  } smaller;
  try {
    ddp::load_checkpoint(path_, smaller, nullptr);
    FAIL() << "loaded into a smaller model";
  } catch (const ddp::CheckpointError& error) {
    EXPECT_TRUE(contains(error.what(), "unexpected in checkpoint " + path_ + " (not in the model): net2.weight, net2.bias"))
        << error.what();
  }
}

TEST_F(Corruption, OptimizerMismatchesAreNamed) {
  ToyModel target;
  torch::optim::SGD sgd(target->parameters(), torch::optim::SGDOptions(0.1));
  try {
    ddp::load_checkpoint(path_, *target, &sgd);
    FAIL() << "loaded Adam state into SGD";
  } catch (const ddp::CheckpointError& error) {
    EXPECT_EQ(std::string(error.what()),
              "checkpoint " + path_ + " holds torch::optim::Adam state, the optimizer is torch::optim::SGD");
  }
  const std::string no_optimizer = dir_ + "/no-optimizer.pt";
  ddp::save_checkpoint(no_optimizer, *model_, nullptr, {});
  try {
    ddp::load_checkpoint(no_optimizer, *target, &sgd);
    FAIL() << "loaded missing optimizer state";
  } catch (const ddp::CheckpointError& error) {
    EXPECT_EQ(std::string(error.what()), "checkpoint " + no_optimizer + " holds no optimizer state");
  }
}

TEST_F(Corruption, OtherFilesAreNamedForWhatTheyAre) {
  EXPECT_EQ(load_error(dir_ + "/missing.pt"),
            "cannot open checkpoint " + dir_ + "/missing.pt: No such file or directory");
  // A plain torch.save-style file (LibTorch's pickle_save writes the same format).
  const std::string plain = dir_ + "/plain.pt";
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& item : model_->named_parameters()) dict.insert(item.key(), item.value().detach());
  const auto bytes = torch::pickle_save(c10::IValue(dict));
  std::ofstream(plain, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  EXPECT_EQ(load_error(plain), plain + " is a plain PyTorch file without a torchddp checkpoint trailer "
                                       "(written by torch.save?); read it with ddp::load_state_dict(path)");
  ToyModel from_plain;
  ddp::load_state_dict(*from_plain, ddp::load_state_dict(plain));
  EXPECT_TRUE(ckpt_test::same_state(*from_plain, *model_));
  // A state_dict file has no training state.
  const std::string weights = dir_ + "/weights.pt";
  ddp::save_state_dict(weights, *model_);
  EXPECT_EQ(load_error(weights), weights + " holds a model state but no training state (written by "
                                           "save_state_dict?); read it with ddp::load_state_dict(path)");
  // A text file is named as what it is not, rather than as a cut checkpoint.
  const std::string text = dir_ + "/text.pt";
  std::ofstream(text) << "hello";
  EXPECT_EQ(load_error(text), text + " is not a torchddp checkpoint: it is not a zip archive (its first bytes are "
                                     "68 65 6c 6c, a checkpoint's are 50 4b 03 04)");
}

// Paths that are not checkpoint files at all: each is a CheckpointError naming the path, and no
// read runs away (/dev/zero would otherwise be read until memory ran out).
TEST_F(Corruption, NonFilesAndForeignFilesAreNamedAsSuch) {
  EXPECT_EQ(load_error(dir_), "cannot read checkpoint " + dir_ + ": it is a directory, not a checkpoint file "
                                  "(ddp::latest_checkpoint(dir) finds the newest checkpoint in a directory)");
  EXPECT_EQ(load_error("/dev/zero"), "cannot read checkpoint /dev/zero: it is not a regular file (a device, pipe "
                                     "or socket)");
  EXPECT_TRUE(contains(load_error("/etc/passwd"), "/etc/passwd is not a torchddp checkpoint: it is not a zip archive"))
      << load_error("/etc/passwd");
  const std::string random = dir_ + "/random.pt";
  std::ofstream(random, std::ios::binary).write("\x7f" "ELF\x02\x01\x01\x00", 8);
  EXPECT_EQ(load_error(random), random + " is not a torchddp checkpoint: it is not a zip archive (its first bytes "
                                         "are 7f 45 4c 46, a checkpoint's are 50 4b 03 04)");
  EXPECT_EQ(load_error(dir_ + "/missing.pt"), "cannot open checkpoint " + dir_ + "/missing.pt: No such file or directory");
}

}  // namespace
