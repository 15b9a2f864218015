// ddp::AutocastGuard: CPU ops run in bfloat16 inside it and float32 outside; nested guards
// restore what they found; gradients of float32 parameters stay float32.
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/autocast.h>

#include "models.h"

namespace {

using namespace ddp::test;

TEST(AutocastGuard, CpuMatmulAndLinearAreBFloat16InsideFloat32Outside) {
  auto a = torch::randn({4, 5});
  auto b = torch::randn({5, 3});
  torch::nn::Linear linear(5, 3);
  ASSERT_FALSE(ddp::AutocastGuard::is_enabled(torch::kCPU));
  {
    ddp::AutocastGuard autocast;
    EXPECT_TRUE(ddp::AutocastGuard::is_enabled(torch::kCPU));
    EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kBFloat16);
    EXPECT_EQ(torch::matmul(a, b).scalar_type(), torch::kBFloat16);
    EXPECT_EQ(linear->forward(a).scalar_type(), torch::kBFloat16);
    // The inputs themselves are untouched.
    EXPECT_EQ(a.scalar_type(), torch::kFloat);
  }
  EXPECT_FALSE(ddp::AutocastGuard::is_enabled(torch::kCPU));
  EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kFloat);
  EXPECT_EQ(linear->forward(a).scalar_type(), torch::kFloat);
}

TEST(AutocastGuard, NestingRestoresTheOuterState) {
  auto a = torch::randn({4, 5});
  auto b = torch::randn({5, 3});
  const auto dtype_before = ddp::AutocastGuard::dtype(torch::kCPU);
  {
    ddp::AutocastGuard outer;
    {
      ddp::AutocastGuard inner(torch::kCPU, ddp::AutocastOptions().enabled(false));
      EXPECT_FALSE(ddp::AutocastGuard::is_enabled(torch::kCPU));
      EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kFloat);
      {
        ddp::AutocastGuard innermost;
        EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kBFloat16);
      }
      EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kFloat);
    }
    EXPECT_TRUE(ddp::AutocastGuard::is_enabled(torch::kCPU));
    EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kBFloat16);
  }
  EXPECT_FALSE(ddp::AutocastGuard::is_enabled(torch::kCPU));
  EXPECT_EQ(ddp::AutocastGuard::dtype(torch::kCPU), dtype_before);
  EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kFloat);
}

TEST(AutocastGuard, CudaGuardLeavesCpuOpsAlone) {
  auto a = torch::randn({4, 5});
  ddp::AutocastGuard cuda(torch::kCUDA);  // on a CPU tensor: no effect
  EXPECT_EQ(torch::mm(a, a.t()).scalar_type(), torch::kFloat);
  EXPECT_EQ(ddp::AutocastGuard::dtype(torch::kCUDA), torch::kHalf);
}

TEST(AutocastGuard, GradientsOfFloat32ParametersStayFloat32) {
  MLP net;
  auto [x, y] = batch(0);
  torch::Tensor loss;
  {
    ddp::AutocastGuard autocast;
    auto out = net->forward(x);
    EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
    loss = torch::mse_loss(out.to(torch::kFloat), y);
  }
  loss.backward();
  for (const auto& p : net->parameters()) {
    ASSERT_TRUE(p.grad().defined());
    EXPECT_EQ(p.grad().scalar_type(), torch::kFloat);
  }
}

TEST(AutocastGuard, RefusesWhatAutocastCannotDo) {
  try {
    ddp::AutocastGuard guard(torch::kCPU, ddp::AutocastOptions().dtype(torch::kFloat64));
    FAIL() << "no error for Double";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("CPU autocast does not support Double"), std::string::npos) << error.what();
  }
  EXPECT_THROW(ddp::AutocastGuard(torch::kMeta), std::invalid_argument);
  EXPECT_FALSE(ddp::AutocastGuard::is_enabled(torch::kCPU));  // a refused guard changed nothing
}

}  // namespace
