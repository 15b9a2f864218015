#include "fashion_mnist.h"

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include <zlib.h>

#include <torch/torch.h>

namespace examples {
namespace {

// IDX magic numbers: two zero bytes, the element type (0x08 = unsigned byte), the number of dims.
constexpr uint32_t kImagesMagic = 0x00000803;
constexpr uint32_t kLabelsMagic = 0x00000801;

std::string hex(uint32_t value) {
  char text[16];
  std::snprintf(text, sizeof(text), "0x%08x", value);
  return text;
}

// The whole decompressed file (zlib also reads an uncompressed file as is).
std::vector<uint8_t> read_gzip(const std::string& path) {
  gzFile file = gzopen(path.c_str(), "rb");
  if (file == nullptr) {
    throw std::runtime_error("Fashion-MNIST: cannot open " + path + "; " + FashionMNIST::kWhereToGetIt);
  }
  std::vector<uint8_t> bytes;
  std::vector<uint8_t> chunk(1 << 20);
  int read = 0;
  while ((read = gzread(file, chunk.data(), static_cast<unsigned>(chunk.size()))) > 0) {
    bytes.insert(bytes.end(), chunk.begin(), chunk.begin() + read);
  }
  if (read < 0) {
    int code = 0;
    const std::string reason = gzerror(file, &code);
    gzclose(file);
    throw std::runtime_error("Fashion-MNIST: " + path + " is not a readable gzip file: " + reason);
  }
  gzclose(file);
  return bytes;
}

uint32_t big_endian(const std::vector<uint8_t>& bytes, size_t offset) {
  return (uint32_t(bytes[offset]) << 24) | (uint32_t(bytes[offset + 1]) << 16) |
         (uint32_t(bytes[offset + 2]) << 8) | uint32_t(bytes[offset + 3]);
}

// Checks the magic number and the size, and returns the dims (count first).
std::vector<int64_t> parse_idx(const std::vector<uint8_t>& bytes, const std::string& path, uint32_t magic,
                               const std::string& what) {
  const size_t dims = magic & 0xff;
  const size_t header = 4 + 4 * dims;
  if (bytes.size() < 4 || big_endian(bytes, 0) != magic) {
    throw std::runtime_error("Fashion-MNIST: " + path + " has magic number " +
                             (bytes.size() < 4 ? std::string("(none, file too short)") : hex(big_endian(bytes, 0))) +
                             ", expected " + hex(magic) + " (an IDX " + what + " file)");
  }
  if (bytes.size() < header) {
    throw std::runtime_error("Fashion-MNIST: " + path + " is truncated: " + std::to_string(bytes.size()) +
                             " bytes, less than its " + std::to_string(header) + "-byte header");
  }
  std::vector<int64_t> shape;
  size_t expected = header;
  size_t elements = 1;
  for (size_t d = 0; d < dims; ++d) {
    shape.push_back(big_endian(bytes, 4 + 4 * d));
    elements *= static_cast<size_t>(shape.back());
  }
  expected += elements;
  if (bytes.size() != expected) {
    throw std::runtime_error("Fashion-MNIST: " + path + (bytes.size() < expected ? " is truncated" : " has extra bytes") +
                             ": expected " + std::to_string(expected) + " bytes (header + " +
                             std::to_string(shape[0]) + " " + what + "s), got " + std::to_string(bytes.size()));
  }
  return shape;
}

torch::Tensor to_tensor(const std::vector<uint8_t>& bytes, size_t header, std::vector<int64_t> shape) {
  auto view = torch::from_blob(const_cast<uint8_t*>(bytes.data() + header), shape, torch::kUInt8);
  return view.clone();  // own the memory: `bytes` goes away
}

}  // namespace

std::string FashionMNIST::images_file(Split split) {
  return split == Split::kTrain ? "train-images-idx3-ubyte.gz" : "t10k-images-idx3-ubyte.gz";
}

std::string FashionMNIST::labels_file(Split split) {
  return split == Split::kTrain ? "train-labels-idx1-ubyte.gz" : "t10k-labels-idx1-ubyte.gz";
}

FashionMNIST::FashionMNIST(Split split, const std::string& data_dir) {
  const std::string images_path = data_dir + "/" + images_file(split);
  const std::string labels_path = data_dir + "/" + labels_file(split);

  const auto image_bytes = read_gzip(images_path);
  const auto image_shape = parse_idx(image_bytes, images_path, kImagesMagic, "image");
  if (image_shape[1] != 28 || image_shape[2] != 28) {
    throw std::runtime_error("Fashion-MNIST: " + images_path + " holds " + std::to_string(image_shape[1]) + "x" +
                             std::to_string(image_shape[2]) + " images, expected 28x28");
  }
  const auto label_bytes = read_gzip(labels_path);
  const auto label_shape = parse_idx(label_bytes, labels_path, kLabelsMagic, "label");
  if (label_shape[0] != image_shape[0]) {
    throw std::runtime_error("Fashion-MNIST: " + images_path + " holds " + std::to_string(image_shape[0]) +
                             " images but " + labels_path + " holds " + std::to_string(label_shape[0]) + " labels");
  }

  const int64_t count = image_shape[0];
  // A label outside the classes would reach the loss as a class index and end the job in
  // LibTorch's backtrace ("Target 255 is out of bounds"); name the file, the sample and the value.
  for (int64_t i = 0; i < count; ++i) {
    const int label = label_bytes[8 + static_cast<size_t>(i)];
    if (label >= kClasses) {
      throw std::runtime_error("Fashion-MNIST: " + labels_path + ": sample " + std::to_string(i) + " has label " +
                               std::to_string(label) + ", but the classes are 0.." + std::to_string(kClasses - 1) +
                               ": the file is damaged or is not Fashion-MNIST's; reinstall dataset-fashion-mnist or "
                               "point --data-dir at the original files");
    }
  }
  images_ = to_tensor(image_bytes, 16, {count, 1, 28, 28}).to(torch::kFloat32).div_(255).sub_(kMean).div_(kStd);
  labels_ = to_tensor(label_bytes, 8, {count}).to(torch::kInt64);
}

torch::data::Example<> FashionMNIST::get(size_t index) {
  return {images_[static_cast<int64_t>(index)], labels_[static_cast<int64_t>(index)]};
}

c10::optional<size_t> FashionMNIST::size() const { return static_cast<size_t>(images_.size(0)); }

FashionMNIST& FashionMNIST::head(size_t n) {
  if (n > 0 && n < static_cast<size_t>(images_.size(0))) {
    images_ = images_.narrow(0, 0, static_cast<int64_t>(n));
    labels_ = labels_.narrow(0, 0, static_cast<int64_t>(n));
  }
  return *this;
}

}  // namespace examples
