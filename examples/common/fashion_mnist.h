#pragma once
// Fashion-MNIST (60,000 training and 10,000 test 28x28 grayscale images in 10 classes), read from
// the gzipped IDX files that Debian's dataset-fashion-mnist package installs.
//
//   examples::FashionMNIST train(examples::FashionMNIST::Split::kTrain);          // default directory
//   examples::FashionMNIST test(examples::FashionMNIST::Split::kTest, "/my/dir"); // or your own copy
//
// Each example is {image, label}: image a float tensor [1, 28, 28], normalized as
// (pixel / 255 - kMean) / kStd with the training set's mean and standard deviation, so inputs are
// roughly zero-mean and unit-variance; label an int64 scalar in [0, 9].
// Errors (missing file, wrong magic number, truncated file) throw std::runtime_error naming the
// file and what was expected.
#include <cstddef>
#include <string>

#include <torch/data/datasets/base.h>
#include <torch/data/example.h>
#include <torch/types.h>

namespace examples {

class FashionMNIST : public torch::data::datasets::Dataset<FashionMNIST> {
 public:
  enum class Split { kTrain, kTest };
  // Where dataset-fashion-mnist puts the files.
  static constexpr const char* kDefaultDir = "/usr/share/datasets/fashion-mnist";
  // Mean and standard deviation of the training pixels scaled to [0, 1].
  static constexpr float kMean = 0.2860f;
  static constexpr float kStd = 0.3530f;
  static constexpr int64_t kClasses = 10;
  static constexpr int64_t kTrainSamples = 60000;  // in the training split
  // What to do when the files are missing.
  static constexpr const char* kWhereToGetIt =
      "install Debian's dataset-fashion-mnist package (apt-get install dataset-fashion-mnist) or point the data "
      "directory (--data-dir) at a folder holding the four *-ubyte.gz files";

  explicit FashionMNIST(Split split, const std::string& data_dir = kDefaultDir);

  torch::data::Example<> get(size_t index) override;
  c10::optional<size_t> size() const override;

  // Keeps only the first n examples (all of them when n is 0 or at least size()).
  FashionMNIST& head(size_t n);

  const torch::Tensor& images() const { return images_; }  // [N, 1, 28, 28] float, normalized
  const torch::Tensor& labels() const { return labels_; }  // [N] int64

  // The two file names of a split, e.g. "train-images-idx3-ubyte.gz".
  static std::string images_file(Split split);
  static std::string labels_file(Split split);

 private:
  torch::Tensor images_;
  torch::Tensor labels_;
};

}  // namespace examples
