// Damaged or mismatched checkpoints: each gives an error that names the file and the problem.
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>

#include <gtest/gtest.h>
#include <caffe2/serialize/in_memory_adapter.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/torch.h>
#include <zlib.h>

#include <ddp/checkpoint.h>

#include "error_of.h"
#include "resealed.h"
#include "models.h"
#include "multiprocess.h"

namespace {

using ckpt_test::contains;
using ckpt_test::ToyModel;

struct ResealedCase;

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
  // Each case's crafted file is refused with its message (defined below, with ResealedCase).
  void expect_refused(const std::vector<ResealedCase>& cases);

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

// Damage behind a valid checksum: the file altered, its zip records rewritten (valid zip
// checksums) and re-sealed, as someone crafting a file would. LibTorch's readers trust what they
// read; before the checks in archive_check.cpp each of these crashed the process or read past a
// buffer. Now each is a CheckpointError saying where the file is wrong.
namespace resealed {

using ckpt_test::resealed::rewrite;

void replace(std::string& text, const std::string& from, const std::string& to) {
  const auto at = text.find(from);
  ASSERT_NE(at, std::string::npos) << "no \"" << from << "\" in the record";
  text.replace(at, from.size(), to);
}

std::string repeat(const std::string& part, int times) {
  std::string text;
  for (int i = 0; i < times; ++i) text += part;
  return text;
}

// Pickle opcodes leaving one value on the stack: `depth` containers, each inside the next, as
// LibTorch's unpickler reads them. 'l': lists (EMPTY_LIST, MARK ... APPENDS), 'd': dicts under
// the key 0 (EMPTY_DICT, MARK, BININT1 0 ... SETITEMS), 't': tuples (MARK ... TUPLE).
std::string nested(char kind, int depth) {
  if (kind == 'l') return repeat("](", depth - 1) + "]" + std::string(depth - 1, 'e');
  if (kind == 'd') return repeat(std::string("}(K\0", 4), depth - 1) + "}" + std::string(depth - 1, 'u');
  return std::string(depth, '(') + std::string(depth, 't');
}

// The same depth reached without nesting a full container: `depth` empty lists in the memo,
// then each appended to the one before it, which is already inside a list by then.
std::string nested_by_memo(int depth) {
  auto index = [](int i) { return std::string(reinterpret_cast<const char*>(&i), 4); };  // little endian
  std::string text;
  for (int i = 0; i < depth; ++i) text += "]r" + index(i) + "0";  // EMPTY_LIST, LONG_BINPUT i, POP
  for (int i = 0; i + 1 < depth; ++i) {
    text += "j" + index(i) + "(j" + index(i + 1) + "e0";  // LONG_BINGET i, MARK, LONG_BINGET i+1, APPENDS, POP
  }
  return text + "j" + index(0);
}

// An extra entry "deep" -> `value` in the dict opened by `opening` (the first one in the pickle).
std::function<void(std::string&)> add_entry(const std::string& opening, const std::string& value) {
  return [=](std::string& pickle) { replace(pickle, opening, opening + std::string("X\4\0\0\0deep", 9) + value); };
}

}  // namespace resealed

// A record of the test checkpoint edited, the archive re-sealed (valid CRC-32s), then loaded.
struct ResealedCase {
  const char* name;
  std::string record;
  std::function<void(std::string&)> edit;
  std::string where, what;  // the error is where (% = the file) + (a byte offset, for pickles) + what
};

void Corruption::expect_refused(const std::vector<ResealedCase>& cases) {
  const std::vector<char> archive = ddp::read_checkpoint_file(path_);
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<char> crafted = resealed::rewrite(archive, c.record, c.edit);
    ddp::seal_archive(crafted);
    const std::string file = dir_ + "/resealed-" + c.name + ".pt";
    std::ofstream(file, std::ios::binary).write(crafted.data(), static_cast<std::streamsize>(crafted.size()));
    std::string where = c.where;
    where.replace(where.find('%'), 1, file);
    ToyModel target;
    torch::optim::Adam adam(target->parameters());  // so the optimizer record is read too
    const std::string error =
        ddp::test::error_of<ddp::CheckpointError>([&] { ddp::load_checkpoint(file, *target, &adam); });
    EXPECT_EQ(error.rfind(where, 0), 0u) << error;
    EXPECT_TRUE(contains(error, c.what)) << error;
  }
}

TEST_F(Corruption, DamageBehindAValidChecksumIsRefusedNotRun) {
  const std::vector<ResealedCase> cases = {
      // LibTorch would pop an empty stack (undefined behaviour: a crash, at best).
      {"pop", "data.pkl", [](std::string& p) { p[2] = '0'; },
       "cannot read the model state in %: record data.pkl, byte ", "2: an instruction takes a value from an empty stack"},
      // A storage record shorter than the tensor's elements: LibTorch would read past it.
      {"short-storage", "data/0", [](std::string& d) { d.resize(4); },
       "cannot read the model state in %: record data.pkl, byte ",
       ": storage \"0\" of 100 elements of 4 bytes, but its record holds 4 bytes"},
      // The optimizer record's code, which LibTorch compiles: its type parser crashed on such input.
      {"code", "ddp_optimizer_state/code/__torch__.py",
       [](std::string& code) { resealed::replace(code, "pytorch_version : str", "pytorch_version : Li["); },
       "cannot read the optimizer state in %: record code/__torch__.py, ",
       "line 4: code that is not a class declaration as torch::serialize writes it"},
      // A call of something other than the functions a checkpoint uses.
      {"global", "data.pkl", [](std::string& p) { resealed::replace(p, "_rebuild_tensor_v2", "_rebuild_tensor_v3"); },
       "cannot read the model state in %: record data.pkl, byte ",
       ": the global torch._utils._rebuild_tensor_v3, which no checkpoint uses"},
  };
  expect_refused(cases);
}

// Containers nested a few hundred thousand deep (issue 28): the checker's values, and LibTorch's
// after it, are built and freed recursively, so such a file ended the job with SIGSEGV. Refused
// now before anything nests, in every record that holds a pickle; nesting up to the bound passes
// the checker and LibTorch reads it (the entry is then refused for not being a tensor).
TEST_F(Corruption, DeepNestingIsRefusedBeforeItIsBuilt) {
  constexpr int kDeep = 300000;
  const std::string model_dict = std::string("}(", 2), object_dict = std::string(")\x81}(", 4);
  const std::string too_deep = ": lists, tuples, dicts and objects nested 1001 deep, more than the 1000 levels a "
                               "checkpoint may have (its own nest fewer than 10)";
  const std::vector<ResealedCase> cases = {
      {"model-root", "data.pkl", [&](std::string& p) { p = std::string("\x80\x02", 2) + resealed::nested('l', kDeep) + "."; },
       "cannot read the model state in %: record data.pkl, byte ", too_deep},
      {"model-dict-value", "data.pkl", resealed::add_entry(model_dict, resealed::nested('d', kDeep)),
       "cannot read the model state in %: record data.pkl, byte ", too_deep},
      {"training-state", "ddp_training_state/data.pkl", resealed::add_entry(object_dict, resealed::nested('t', kDeep)),
       "cannot read the training state in %: record data.pkl, byte ", too_deep},
      {"optimizer", "ddp_optimizer_state/data.pkl", resealed::add_entry(object_dict, resealed::nested('l', kDeep)),
       "cannot read the optimizer state in %: record data.pkl, byte ", too_deep},
      // Nesting built by filling lists already inside others, which a depth counted as values
      // are made would not see.
      {"filled-after-nesting", "data.pkl", resealed::add_entry(model_dict, resealed::nested_by_memo(kDeep)),
       "cannot read the model state in %: record data.pkl, byte ",
       ": an APPEND to a list that is already inside another value (no pickler writes one; it would hide how deep "
       "values nest)"},
      // The bound itself: the root dict and 999 levels below it are 1000.
      {"at-the-bound", "data.pkl", resealed::add_entry(model_dict, resealed::nested('l', 999)),
       "% does not hold a state_dict: entry deep is a GenericList", ", not a tensor under a name"},
      {"one-past-the-bound", "data.pkl", resealed::add_entry(model_dict, resealed::nested('l', 1000)),
       "cannot read the model state in %: record data.pkl, byte ", too_deep},
  };
  expect_refused(cases);
}

// The zip directory of a re-sealed file points past its end: LibTorch's zip reader would copy
// from there (it did: a SEGV the fuzzer found). Refused before any LibTorch reader runs.
TEST_F(Corruption, AZipDirectoryOutsideTheFileIsRefused) {
  std::vector<char> archive = ddp::read_checkpoint_file(path_);
  auto put = [&](std::size_t at, uint64_t value, int bytes) {
    for (int i = 0; i < bytes; ++i) archive[at + i] = static_cast<char>((value >> (8 * i)) & 0xff);
  };
  const std::size_t eocd = archive.size() - 22;
  const bool zip64 = archive[eocd - 20] == 'P' && archive[eocd - 19] == 'K' && archive[eocd - 18] == 6;
  if (zip64) {  // the directory's offset is in the ZIP64 record the locator points to
    uint64_t record = 0;
    for (int i = 0; i < 8; ++i) record |= static_cast<uint64_t>(static_cast<unsigned char>(archive[eocd - 12 + i])) << (8 * i);
    put(static_cast<std::size_t>(record) + 48, ~uint64_t{0} - 16, 8);
    put(eocd + 16, 0xffffffffu, 4);  // the directory record's offset: "see the ZIP64 record"
  } else {
    put(eocd + 16, 0xfffffff0u, 4);
  }
  ddp::seal_archive(archive);
  const std::string file = dir_ + "/directory-outside.pt";
  std::ofstream(file, std::ios::binary).write(archive.data(), static_cast<std::streamsize>(archive.size()));
  EXPECT_EQ(load_error(file), file + " is not a sound zip archive: the zip directory lies outside the archive");
  EXPECT_EQ(ddp::test::error_of<ddp::CheckpointError>([&] { ddp::load_state_dict(file); }),
            file + " is not a sound zip archive: the zip directory lies outside the archive");
}

// A device entry naming "meta" (issue 28): LibTorch placed the tensor there, then the copy into
// the model threw c10::NotImplementedError out of load_checkpoint. The same device as the
// optimizer's reached LibTorch's archive reader. Both are CheckpointErrors naming what and where.
TEST_F(Corruption, TheMetaDeviceIsRefusedAsAPlaceForTensors) {
  const std::vector<char> archive = ddp::read_checkpoint_file(path_);
  auto load_crafted = [&](const std::string& name, const std::string& record,
                          const std::function<void(std::string&)>& edit) {
    std::vector<char> crafted = resealed::rewrite(archive, record, edit);
    ddp::seal_archive(crafted);
    const std::string file = dir_ + "/" + name + ".pt";
    std::ofstream(file, std::ios::binary).write(crafted.data(), static_cast<std::streamsize>(crafted.size()));
    ToyModel target;
    torch::optim::Adam adam(target->parameters());
    return ddp::test::error_of<ddp::CheckpointError>([&] { ddp::load_checkpoint(file, *target, &adam); });
  };
  const std::string no_data = "map_location: the meta device holds no data, so a checkpoint cannot be loaded onto it "
                              "(map it to a device that does, e.g. ddp::MapLocation(\"cpu\"))";
  EXPECT_EQ(load_crafted("meta-tensor", "ddp_devices",
                         [](std::string& devices) { resealed::replace(devices, "cpu net1.weight", "meta net1.weight"); }),
            "cannot place net1.weight from " + dir_ + "/meta-tensor.pt (saved on meta) where map_location puts it: " +
                no_data);
  EXPECT_EQ(load_crafted("meta-optimizer", "ddp_training_state/data.pkl",
                         [](std::string& pickle) {
                           const std::string cpu("X\3\0\0\0cpu", 8), meta("X\4\0\0\0meta", 9);
                           pickle.replace(pickle.find(cpu, pickle.find("optimizer_device")), cpu.size(), meta);
                         }),
            "cannot place the optimizer state from " + dir_ + "/meta-optimizer.pt (saved on meta) where map_location "
            "puts it: " + no_data);
}

// LibTorch's text after our own is cut to its first line (before: a cuda:99 map on a CPU-only
// machine appended the dispatcher's whole list of backends, "If you are a Facebook employee ...").
TEST_F(Corruption, LibTorchsTextIsCutToItsFirstLine) {
  ToyModel target;
  const std::string error = ddp::test::error_of<ddp::CheckpointError>([&] {
    ddp::load_checkpoint(path_, *target, nullptr, ddp::LoadOptions().map_location("cuda:99"));
  });
  const std::string head = "cannot place net1.weight from " + path_ + " (saved on cpu) where map_location puts it: ";
  EXPECT_EQ(error.rfind(head, 0), 0u) << error;
  EXPECT_GT(error.size(), head.size()) << error;
  EXPECT_EQ(error.find('\n'), std::string::npos) << error;
}

// A model that trained on to NaN, saved: refused at load, naming the file and the tensor (issue
// 39: it loaded, and the run went on training NaN and exited 0).
TEST_F(Corruption, NonFiniteWeightsAreRefused) {
  ToyModel diverged;
  {
    torch::NoGradGuard no_grad;
    diverged->net2->bias[3] = std::numeric_limits<float>::quiet_NaN();
  }
  const std::string nan_file = dir_ + "/nan.pt";
  ddp::save_checkpoint(nan_file, *diverged, nullptr, {});
  EXPECT_EQ(load_error(nan_file), nan_file + " holds NaN in net2.bias (a run that diverged, or a damaged file): it is "
                                             "not loaded");
  {
    torch::NoGradGuard no_grad;
    diverged->net2->bias[3] = -std::numeric_limits<float>::infinity();
  }
  const std::string inf_file = dir_ + "/inf.pt";
  ddp::save_checkpoint(inf_file, *diverged, nullptr, {});
  EXPECT_EQ(load_error(inf_file), inf_file + " holds an infinity in net2.bias (a run that diverged, or a damaged file): "
                                             "it is not loaded");
}

// Adam's moments NaN, or shaped unlike their parameter (before: NaN loaded and trained on; a
// wrong shape loaded, and the rank died at step() with LibTorch's text naming neither the file
// nor the parameter). Both refused at load, naming the file and the parameter.
TEST_F(Corruption, NonFiniteOrMisshapenOptimizerStateIsRefused) {
  auto saved_with_state = [&](const std::string& name, const std::function<void(torch::optim::AdamParamState&)>& edit) {
    ToyModel model;
    torch::optim::Adam adam(model->parameters());
    model->forward(torch::ones({2, 10})).sum().backward();
    adam.step();  // every parameter has its state now
    for (auto& item : adam.state()) edit(static_cast<torch::optim::AdamParamState&>(*item.second));
    const std::string file = dir_ + "/" + name + ".pt";
    ddp::save_checkpoint(file, *model, &adam, {});
    ToyModel target;
    torch::optim::Adam loaded(target->parameters());
    return ddp::test::error_of<ddp::CheckpointError>([&] { ddp::load_checkpoint(file, *target, &loaded); });
  };
  EXPECT_EQ(saved_with_state("nan-moment", [](auto& state) { state.exp_avg_sq()[0] = NAN; }),
            "the optimizer state in " + dir_ + "/nan-moment.pt is refused: its state for the parameter net1.weight "
            "holds NaN (a run that diverged, or a damaged file)");
  EXPECT_EQ(saved_with_state("shape", [](auto& state) { state.exp_avg(torch::zeros({3})); }),
            "the optimizer state in " + dir_ + "/shape.pt is refused: its state for the parameter net1.weight holds "
            "a tensor of shape [3], the parameter's is [10, 10]");
}

// An optimizer record that cannot be read, or that holds NaN, edited and re-sealed: the load is
// refused and changes nothing, in either layout (before: the model was loaded first and kept the
// file's values; with NaN the optimizer kept the file's state too).
TEST_F(Corruption, ABadOptimizerRecordIsRefusedAndChangesNothing) {
  torch::manual_seed(1);
  ToyModel saved;
  torch::optim::Adam saved_adam(saved->parameters());
  saved->forward(torch::ones({2, 10})).sum().backward();
  saved_adam.step();
  int64_t saved_step = 7;
  ddp::save_checkpoint(dir_ + "/one.pt", *saved, &saved_adam, {});
  ddp::save_checkpoint(dir_ + "/named.pt", {{"model", saved}, {"adam", saved_adam}, {"step", saved_step}}, {});
  struct Case {
    const char* name;
    std::string source, record;
    std::function<void(std::string&)> edit;
    std::string error_start, error_part;  // % is the damaged file
  };
  const auto cut_in_half = [](std::string& pickle) { pickle.resize(pickle.size() / 2); };
  const auto nan_first = [](std::string& storage) {  // Adam's moments are float32
    const float nan = std::numeric_limits<float>::quiet_NaN();
    ASSERT_GE(storage.size(), sizeof(nan));
    storage.replace(0, sizeof(nan), reinterpret_cast<const char*>(&nan), sizeof(nan));
  };
  const std::vector<Case> cases = {
      {"one-unreadable", "one.pt", "ddp_optimizer_state/data.pkl", cut_in_half, "cannot read the optimizer state in %: ", ""},
      {"one-nan", "one.pt", "ddp_optimizer_state/data/0", nan_first, "the optimizer state in % is refused: ", "holds NaN"},
      {"named-unreadable", "named.pt", "ddp_optimizer_state_0/data.pkl", cut_in_half,
       "cannot read the optimizer state under \"adam\" in %: ", ""},
      {"named-nan", "named.pt", "ddp_optimizer_state_0/data/0", nan_first,
       "the optimizer state under \"adam\" in % is refused: ", "holds NaN"},
  };
  // The loading run: other parameters, Adam state of its own, another step.
  torch::manual_seed(2);
  ToyModel model;
  torch::optim::Adam adam(model->parameters());
  model->forward(torch::ones({2, 10})).sum().backward();
  adam.step();
  int64_t step = 3;
  // The parameters, then each parameter's Adam state, by its size (ToyModel's four differ): this
  // needs nothing of how LibTorch keys Optimizer::state().
  auto snapshot = [&] {
    std::vector<torch::Tensor> tensors;
    for (const auto& parameter : model->parameters()) tensors.push_back(parameter.detach().clone());
    std::map<int64_t, std::vector<torch::Tensor>> states;
    for (const auto& item : adam.state()) {
      const auto& state = static_cast<torch::optim::AdamParamState&>(*item.second);
      states[state.exp_avg().numel()] = {state.exp_avg().clone(), state.exp_avg_sq().clone(),
                                         torch::tensor({static_cast<int64_t>(state.step())})};
    }
    for (const auto& [numel, state] : states) tensors.insert(tensors.end(), state.begin(), state.end());
    return tensors;
  };
  const std::vector<torch::Tensor> before = snapshot();
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<char> crafted = resealed::rewrite(ddp::read_checkpoint_file(dir_ + "/" + c.source), c.record, c.edit);
    ddp::seal_archive(crafted);
    const std::string file = dir_ + "/" + c.name + ".pt";
    std::ofstream(file, std::ios::binary).write(crafted.data(), static_cast<std::streamsize>(crafted.size()));
    const std::string error = ddp::test::error_of<ddp::CheckpointError>([&] {
      if (c.source == "one.pt") {
        ddp::load_checkpoint(file, *model, &adam);
      } else {
        ddp::load_checkpoint(file, {{"model", model}, {"adam", adam}, {"step", step}});
      }
    });
    std::string start = c.error_start;
    start.replace(start.find('%'), 1, file);
    EXPECT_EQ(error.rfind(start, 0), 0u) << error;
    EXPECT_TRUE(contains(error, c.error_part)) << error;
    EXPECT_EQ(step, 3);
    ASSERT_EQ(adam.state().size(), model->parameters().size());
    const std::vector<torch::Tensor> after = snapshot();
    ASSERT_EQ(after.size(), before.size());
    for (size_t i = 0; i < before.size(); ++i) {
      // Bitwise: NaN is unequal to itself, so equal() alone would not show a NaN left behind either.
      EXPECT_TRUE(before[i].sizes().equals(after[i].sizes()) &&
                  std::memcmp(before[i].data_ptr(), after[i].data_ptr(), before[i].nbytes()) == 0)
          << "tensor " << i << " changed (the parameters, then each state's exp_avg, exp_avg_sq and step)";
    }
  }
  // The sound files load (the damage above, not the files, was refused).
  ddp::load_checkpoint(dir_ + "/one.pt", *model, &adam);
  EXPECT_TRUE(ckpt_test::same_state(*model, *saved));
}

// Edits of the zip's end-of-directory records, re-sealed (issue 28: they were accepted). A
// checkpoint is one zip file: its directory is followed by the ZIP64 directory record, its
// locator and the directory record (EOCD), which all agree; anything else is refused.
class ZipDirectoryRecord : public Corruption {
 protected:
  void SetUp() override {
    Corruption::SetUp();
    original_ = ddp::read_checkpoint_file(path_);
    reset();
    eocd_ = archive_.size() - 22;
    ASSERT_TRUE(get(eocd_ - 20, 4) == 0x07064b50u) << "the test expects LibTorch's ZIP64 records";
    zip64_ = static_cast<std::size_t>(get(eocd_ - 12, 8));
    entries_ = get(eocd_ + 10, 2);
  }
  void reset() { archive_ = original_; }  // undoes the edits
  uint64_t get(std::size_t at, int bytes) const {
    uint64_t value = 0;
    for (int i = 0; i < bytes; ++i) value |= static_cast<uint64_t>(static_cast<unsigned char>(archive_[at + i])) << (8 * i);
    return value;
  }
  void put(std::size_t at, uint64_t value, int bytes) {
    for (int i = 0; i < bytes; ++i) archive_[at + i] = static_cast<char>((value >> (8 * i)) & 0xff);
  }
  // Sealed as save_checkpoint seals, then `after_sealing` (the file before its trailer, which is
  // then written anew: the size and CRC-32 of what the edit left), as a crafter would.
  std::string error_after(const std::string& name,
                          const std::function<void(std::vector<char>&)>& after_sealing = nullptr) {
    std::vector<char> bytes = archive_;
    ddp::seal_archive(bytes);
    if (after_sealing) {
      constexpr std::size_t kTrailer = 61;  // "torchddp-checkpoint v1 bytes=<16> crc32=<8>\n"
      bytes.resize(bytes.size() - kTrailer);
      after_sealing(bytes);
      char trailer[kTrailer + 1];
      std::snprintf(trailer, sizeof(trailer), "torchddp-checkpoint v1 bytes=%016" PRIx64 " crc32=%08" PRIx32 "\n",
                    static_cast<uint64_t>(bytes.size()),
                    static_cast<uint32_t>(crc32(0, reinterpret_cast<const Bytef*>(bytes.data()), bytes.size())));
      bytes.insert(bytes.end(), trailer, trailer + kTrailer);
    }
    const std::string file = dir_ + "/" + name + ".pt";
    std::ofstream(file, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    const std::string error = load_error(file);
    const std::string head = file + " is not a sound zip archive: ";
    EXPECT_EQ(error.rfind(head, 0), 0u) << error;
    return error.rfind(head, 0) == 0 ? error.substr(head.size()) : error;
  }

  std::vector<char> original_, archive_;
  std::size_t eocd_ = 0, zip64_ = 0;
  uint64_t entries_ = 0;
};

TEST_F(ZipDirectoryRecord, DiskNumbersOtherThanOneFileAreRefused) {
  put(eocd_ + 4, 1, 2);  // this disk
  EXPECT_EQ(error_after("eocd-disk"),
            "the zip directory record is on disk 1 and names disk 0 for the directory (a checkpoint is one file: "
            "disk 0 for both)");
  reset();
  put(eocd_ + 6, 2, 2);  // the directory's disk
  EXPECT_EQ(error_after("eocd-directory-disk"),
            "the zip directory record is on disk 0 and names disk 2 for the directory (a checkpoint is one file: "
            "disk 0 for both)");
  reset();
  put(zip64_ + 16, 1, 4);
  EXPECT_EQ(error_after("zip64-disk"),
            "the ZIP64 directory record is on disk 1 and names disk 0 for the directory (a checkpoint is one file: "
            "disk 0 for both)");
  reset();
  put(eocd_ - 20 + 16, 2, 4);  // the locator's count of disks
  EXPECT_EQ(error_after("locator-disks"),
            "the ZIP64 locator names disk 0 of 2 (a checkpoint is one file: disk 0 of 1)");
}

TEST_F(ZipDirectoryRecord, EntryCountsThatDisagreeAreRefused) {
  put(eocd_ + 8, entries_ - 1, 2);  // on this disk, not in all
  EXPECT_EQ(error_after("entries-on-disk"),
            "the zip directory record counts " + std::to_string(entries_ - 1) + " entries on this disk and " +
                std::to_string(entries_) + " in all (a checkpoint is one file: the same number)");
  reset();
  put(eocd_ + 8, entries_ - 1, 2);  // the directory record against its ZIP64 record
  put(eocd_ + 10, entries_ - 1, 2);
  EXPECT_EQ(error_after("eocd-against-zip64"),
            "the zip directory record and its ZIP64 record disagree on the number of entries (" +
                std::to_string(entries_ - 1) + " and " + std::to_string(entries_) + ")");
  reset();
  for (std::size_t at : {eocd_ + 8, eocd_ + 10}) put(at, entries_ - 1, 2);  // all agree, the directory holds more
  for (std::size_t at : {zip64_ + 24, zip64_ + 32}) put(at, entries_ - 1, 8);
  const std::string error = error_after("fewer-entries");
  EXPECT_TRUE(contains(error, "the zip directory's " + std::to_string(entries_ - 1) + " entries take ")) << error;
  EXPECT_TRUE(contains(error, " bytes, its directory record says " + std::to_string(get(eocd_ + 12, 4)))) << error;
}

TEST_F(ZipDirectoryRecord, SizesAndOffsetsThatDoNotMeetAreRefused) {
  const uint64_t directory = get(eocd_ + 16, 4), size = get(eocd_ + 12, 4);
  const std::string before_zip64 = ") does not end where the ZIP64 directory record begins (byte " + std::to_string(zip64_) + ")";
  put(eocd_ + 12, size + 1, 4);  // the directory's size, in both records
  put(zip64_ + 40, size + 1, 8);
  EXPECT_EQ(error_after("directory-size"),
            "the zip directory (" + std::to_string(size + 1) + " bytes from byte " + std::to_string(directory) + before_zip64);
  reset();
  put(eocd_ + 16, directory - 1, 4);  // the directory's offset, in both records
  put(zip64_ + 48, directory - 1, 8);
  EXPECT_EQ(error_after("directory-offset"),
            "the zip directory (" + std::to_string(size) + " bytes from byte " + std::to_string(directory - 1) + before_zip64);
  reset();
  put(eocd_ + 12, size - 1, 4);  // the directory record against its ZIP64 record
  EXPECT_EQ(error_after("size-against-zip64"),
            "the zip directory record and its ZIP64 record disagree on the directory's size (" + std::to_string(size - 1) +
                " and " + std::to_string(size) + ")");
  reset();
  put(zip64_ + 4, get(zip64_ + 4, 8) + 8, 8);  // the ZIP64 record's own size
  EXPECT_EQ(error_after("zip64-size"),
            "the ZIP64 directory record (" + std::to_string(eocd_ - 20 - zip64_ + 8) + " bytes from byte " +
                std::to_string(zip64_) + ") does not end where the ZIP64 locator begins (byte " +
                std::to_string(eocd_ - 20) + ")");
}

TEST_F(ZipDirectoryRecord, TheTrailerMustBeItsWholeComment) {
  // The comment's length, which reading zeroes (for zip readers the trailer is the comment).
  EXPECT_EQ(error_after("comment-length", [](std::vector<char>& bytes) { bytes[bytes.size() - 2] = 0; }),
            "the zip directory record gives its comment 0 bytes, but the checkpoint trailer after it is 61");
  // Bytes between the directory record and the trailer, the comment's length stretched over them.
  EXPECT_EQ(error_after("trailing-bytes",
                        [](std::vector<char>& bytes) {
                          bytes[bytes.size() - 2] = 61 + 4;
                          bytes.insert(bytes.end(), {'j', 'u', 'n', 'k'});
                        }),
            "the zip directory record does not end where the checkpoint trailer begins (byte " +
                std::to_string(size_ - 61 + 4) + ")");
}

}  // namespace
