// Fashion-MNIST reader: the real files of Debian's dataset-fashion-mnist, and broken copies.
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <zlib.h>

#include "fashion_mnist.h"

#include "multiprocess.h"
#include "error_of.h"

namespace {

using Split = examples::FashionMNIST::Split;
const std::string kDir = examples::FashionMNIST::kDefaultDir;

std::vector<uint8_t> gunzip(const std::string& path) {
  gzFile file = gzopen(path.c_str(), "rb");
  EXPECT_NE(file, nullptr) << path;
  std::vector<uint8_t> bytes;
  uint8_t chunk[65536];
  for (int n; (n = gzread(file, chunk, sizeof(chunk))) > 0;) bytes.insert(bytes.end(), chunk, chunk + n);
  gzclose(file);
  return bytes;
}

void gzip_to(const std::string& path, const std::vector<uint8_t>& bytes) {
  gzFile file = gzopen(path.c_str(), "wb1");
  ASSERT_NE(file, nullptr) << path;
  ASSERT_EQ(gzwrite(file, bytes.data(), static_cast<unsigned>(bytes.size())), static_cast<int>(bytes.size()));
  gzclose(file);
}

TEST(FashionMNIST, ReadsTheRealTrainAndTestSplits) {
  examples::FashionMNIST train(Split::kTrain);
  examples::FashionMNIST test(Split::kTest, kDir);
  ASSERT_EQ(train.size().value(), 60000u);
  ASSERT_EQ(test.size().value(), 10000u);
  EXPECT_EQ(train.images().sizes(), (torch::IntArrayRef{60000, 1, 28, 28}));
  EXPECT_EQ(train.images().dtype(), torch::kFloat32);
  EXPECT_EQ(train.labels().dtype(), torch::kInt64);
  // Balanced classes: 6,000 per class in train, 1,000 in test; the first labels are known.
  EXPECT_TRUE(torch::equal(torch::bincount(train.labels()), torch::full({10}, 6000, torch::kInt64)));
  EXPECT_TRUE(torch::equal(torch::bincount(test.labels()), torch::full({10}, 1000, torch::kInt64)));
  EXPECT_TRUE(torch::equal(train.labels().narrow(0, 0, 6), torch::tensor({9, 0, 0, 3, 0, 2}, torch::kInt64)));
  EXPECT_TRUE(torch::equal(test.labels().narrow(0, 0, 6), torch::tensor({9, 2, 1, 1, 6, 1}, torch::kInt64)));
  // Normalized with the training statistics: mean 0, standard deviation 1.
  EXPECT_NEAR(train.images().mean().item<double>(), 0.0, 1e-3);
  EXPECT_NEAR(train.images().std().item<double>(), 1.0, 1e-3);
  // A raw zero pixel maps to -mean/std.
  EXPECT_NEAR(train.images().min().item<float>(), -examples::FashionMNIST::kMean / examples::FashionMNIST::kStd, 1e-6);

  auto example = test.get(3);
  EXPECT_EQ(example.data.sizes(), (torch::IntArrayRef{1, 28, 28}));
  EXPECT_EQ(example.target.item<int64_t>(), 1);
  EXPECT_EQ(train.head(100).size().value(), 100u);
  EXPECT_EQ(train.get(99).target.item<int64_t>(), train.labels()[99].item<int64_t>());
}

class BrokenFiles : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = ddp::test::make_temp_dir("fashion_mnist"); }
  void TearDown() override { ddp::test::remove_tree(dir_); }
  // A copy of the test split, with the images' bytes edited by `edit`.
  void write_test_split(const std::function<void(std::vector<uint8_t>&)>& edit) {
    auto images = gunzip(kDir + "/t10k-images-idx3-ubyte.gz");
    edit(images);
    gzip_to(dir_ + "/t10k-images-idx3-ubyte.gz", images);
    gzip_to(dir_ + "/t10k-labels-idx1-ubyte.gz", gunzip(kDir + "/t10k-labels-idx1-ubyte.gz"));
  }
  std::string dir_;
};

TEST_F(BrokenFiles, MissingFileNamesThePathAndThePackage) {
  EXPECT_EQ(ddp::test::error_of<std::runtime_error>([&] { examples::FashionMNIST(Split::kTrain, dir_); }),
            "Fashion-MNIST: cannot open " + dir_ +
                "/train-images-idx3-ubyte.gz; install Debian's dataset-fashion-mnist package (apt-get "
                "install dataset-fashion-mnist) or point the data directory (--data-dir) at a folder "
                "holding the four *-ubyte.gz files");
}

TEST_F(BrokenFiles, TruncatedFileNamesExpectedAndActualSize) {
  write_test_split([](std::vector<uint8_t>& bytes) { bytes.resize(bytes.size() - 100); });
  EXPECT_EQ(ddp::test::error_of<std::runtime_error>([&] { examples::FashionMNIST(Split::kTest, dir_); }),
            "Fashion-MNIST: " + dir_ +
                "/t10k-images-idx3-ubyte.gz is truncated: expected 7840016 bytes (header + 10000 images), got 7839916");
  write_test_split([](std::vector<uint8_t>& bytes) { bytes.resize(10); });
  EXPECT_EQ(ddp::test::error_of<std::runtime_error>([&] { examples::FashionMNIST(Split::kTest, dir_); }),
            "Fashion-MNIST: " + dir_ + "/t10k-images-idx3-ubyte.gz is truncated: 10 bytes, less than its 16-byte header");
}

TEST_F(BrokenFiles, WrongMagicNamesExpectedAndActual) {
  // A labels file where the images should be.
  write_test_split([](std::vector<uint8_t>& bytes) { bytes[3] = 0x01; });
  EXPECT_EQ(ddp::test::error_of<std::runtime_error>([&] { examples::FashionMNIST(Split::kTest, dir_); }),
            "Fashion-MNIST: " + dir_ +
                "/t10k-images-idx3-ubyte.gz has magic number 0x00000801, expected 0x00000803 (an IDX image file)");
}

// A label outside 0..9 would reach cross_entropy as a class index and end the job in LibTorch's
// backtrace ("Target 255 is out of bounds"); the reader names the file, the sample and the value.
TEST_F(BrokenFiles, LabelOutOfRangeIsNamed) {
  auto labels = gunzip(kDir + "/t10k-labels-idx1-ubyte.gz");
  labels[8 + 7] = 255;  // sample 7, after the 8-byte header
  gzip_to(dir_ + "/t10k-images-idx3-ubyte.gz", gunzip(kDir + "/t10k-images-idx3-ubyte.gz"));
  gzip_to(dir_ + "/t10k-labels-idx1-ubyte.gz", labels);
  EXPECT_EQ(ddp::test::error_of<std::runtime_error>([&] { examples::FashionMNIST(Split::kTest, dir_); }),
            "Fashion-MNIST: " + dir_ + "/t10k-labels-idx1-ubyte.gz: sample 7 has label 255, but the classes are "
            "0..9: the file is damaged or is not Fashion-MNIST's; reinstall dataset-fashion-mnist or point "
            "--data-dir at the original files");
}

}  // namespace
