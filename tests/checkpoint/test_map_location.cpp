// MapLocation: the device-string rule, checked without a GPU.
#include <gtest/gtest.h>

#include <ddp/map_location.h>

namespace {

TEST(MapLocation, DefaultKeepsTheSavedDevice) {
  ddp::MapLocation keep;
  EXPECT_EQ(keep("cuda:0"), "cuda:0");
  EXPECT_EQ(keep("cpu"), "cpu");
}

TEST(MapLocation, OneDeviceForEverything) {
  ddp::MapLocation cpu("cpu");
  EXPECT_EQ(cpu("cuda:0"), "cpu");
  EXPECT_EQ(cpu("cuda:3"), "cpu");
  EXPECT_EQ(cpu("cpu"), "cpu");
  ddp::MapLocation second_gpu(c10::Device(c10::kCUDA, 1));
  EXPECT_EQ(second_gpu("cpu"), "cuda:1");
  EXPECT_EQ(second_gpu.device_for("cuda:0"), c10::Device(c10::kCUDA, 1));
}

TEST(MapLocation, RemapRenamesOnlyListedDevices) {
  auto location = ddp::MapLocation::remap({{"cuda:0", "cuda:1"}, {"cuda:1", "cpu"}});
  EXPECT_EQ(location("cuda:0"), "cuda:1");
  EXPECT_EQ(location("cuda:1"), "cpu");
  EXPECT_EQ(location("cuda:2"), "cuda:2");
  EXPECT_EQ(location("cpu"), "cpu");
}

TEST(MapLocation, CudaForLocalRankIsTheDdpTutorialMapping) {
  auto location = ddp::MapLocation::cuda_for_local_rank(3);
  EXPECT_EQ(location("cuda:0"), "cuda:3");
  EXPECT_EQ(location("cpu"), "cpu");
}

TEST(MapLocation, FunctionGetsTheSavedDevice) {
  std::vector<std::string> seen;
  auto location = ddp::MapLocation::function([&](const std::string& saved) {
    seen.push_back(saved);
    return saved == "cpu" ? std::string("cpu") : std::string("cuda:7");
  });
  EXPECT_EQ(location("cuda:0"), "cuda:7");
  EXPECT_EQ(location("cpu"), "cpu");
  EXPECT_EQ(seen, (std::vector<std::string>{"cuda:0", "cpu"}));
}

TEST(MapLocation, BadDeviceStringsAreNamed) {
  try {
    ddp::MapLocation location("gpu0");
    FAIL() << "accepted gpu0";
  } catch (const std::invalid_argument& error) {
    EXPECT_STREQ(error.what(),
                 "map_location: target device 'gpu0' is not a device (expected e.g. \"cpu\", \"cuda\", \"cuda:1\")");
  }
  try {
    ddp::MapLocation::remap({{"cuda-0", "cpu"}});
    FAIL() << "accepted cuda-0";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("source device 'cuda-0' is not a device"), std::string::npos) << error.what();
  }
  auto typo = ddp::MapLocation::function([](const std::string&) { return std::string("cdua:1"); });
  try {
    typo("cuda:0");
    FAIL() << "accepted cdua:1";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("mapped device 'cdua:1' is not a device"), std::string::npos) << error.what();
  }
}

// The meta device holds no data: nothing loaded onto it could be copied into a model (issue 28).
TEST(MapLocation, TheMetaDeviceIsNoPlaceForATensor) {
  const std::string no_data = "map_location: the meta device holds no data, so a checkpoint cannot be loaded onto it "
                              "(map it to a device that does, e.g. ddp::MapLocation(\"cpu\"))";
  try {
    ddp::MapLocation().device_for("meta");
    FAIL() << "placed a tensor on meta";
  } catch (const std::invalid_argument& error) {
    EXPECT_EQ(error.what(), no_data);
  }
  try {
    ddp::MapLocation("meta").device_for("cpu");
    FAIL() << "placed a tensor on meta";
  } catch (const std::invalid_argument& error) {
    EXPECT_EQ(error.what(), no_data);
  }
  EXPECT_EQ(ddp::MapLocation("cpu").device_for("meta"), c10::Device(c10::kCPU));  // saved there, placed elsewhere
}

}  // namespace
