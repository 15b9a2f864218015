// ddp::GradScaler in one process: the scale's growth and backoff against values worked out by
// hand, unscale_ + clipping against an unscaled reference, PyTorch's errors for misuse, a disabled
// scaler, and the state round trip.
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/grad_scaler.h>

#include "models.h"
#include "error_of.h"

namespace {

using namespace ddp::test;

// One parameter whose gradient the test writes directly.
struct OneParam {
  torch::Tensor weight = torch::ones({4}, torch::requires_grad());
  torch::optim::SGD optimizer{std::vector<torch::Tensor>{weight}, torch::optim::SGDOptions(0.5)};

  // An iteration whose (scaled) gradient is `grad_value`; returns whether the scaler stepped.
  bool iterate(ddp::GradScaler& scaler, float grad_value) {
    scaler.scale(torch::zeros({}));  // marks the iteration as scaled, as scale(loss).backward() does
    weight.mutable_grad() = torch::full({4}, grad_value);
    const bool stepped = scaler.step(optimizer);
    scaler.update();
    return stepped;
  }
};

TEST(GradScaler, DefaultsArePyTorchs) {
  ddp::GradScaler scaler;
  EXPECT_EQ(scaler.get_scale(), 65536.0);
  EXPECT_EQ(scaler.options().growth_factor(), 2.0);
  EXPECT_EQ(scaler.options().backoff_factor(), 0.5);
  EXPECT_EQ(scaler.options().growth_interval(), 2000);
  EXPECT_TRUE(scaler.is_enabled());
  auto loss = torch::tensor(1.5f);
  EXPECT_EQ(scaler.scale(loss).item<float>(), 1.5f * 65536.0f);
}

// growth_interval 3: the scale doubles after the 3rd clean step in a row, not before; an inf halves
// it and restarts the count.
TEST(GradScaler, GrowsAfterGrowthIntervalCleanStepsAndBacksOffOnInf) {
  ddp::GradScaler scaler(ddp::GradScalerOptions().init_scale(1024).growth_interval(3));
  OneParam p;
  const float inf = std::numeric_limits<float>::infinity();
  struct Expected {
    float grad;
    bool stepped;
    double scale;
    int64_t tracker;
  };
  const Expected script[] = {
      {1.0f, true, 1024, 1}, {1.0f, true, 1024, 2}, {1.0f, true, 2048, 0},  // grows on the 3rd
      {1.0f, true, 2048, 1}, {inf, false, 1024, 0},                         // backoff resets the count
      {NAN, false, 512, 0},  {1.0f, true, 512, 1},  {1.0f, true, 512, 2}, {1.0f, true, 1024, 0}};
  int i = 0;
  for (const auto& step : script) {
    const auto before = p.weight.detach().clone();
    const double scale_before = scaler.get_scale();
    EXPECT_EQ(p.iterate(scaler, step.grad), step.stepped) << "iteration " << i;
    EXPECT_EQ(scaler.get_scale(), step.scale) << "iteration " << i;
    EXPECT_EQ(scaler.growth_tracker(), step.tracker) << "iteration " << i;
    // A step moves the weight by lr * grad / scale; a skipped one leaves it alone.
    const auto expected = step.stepped ? before - 0.5 * (step.grad / scale_before) : before;
    EXPECT_TRUE(torch::equal(p.weight.detach(), expected)) << "iteration " << i;
    ++i;
  }
}

TEST(GradScaler, GrowthStopsWhereFloat32Ends) {
  const double top = std::ldexp(1.0, 127);  // 2^128 is not a float32
  ddp::GradScaler scaler(ddp::GradScalerOptions().init_scale(top).growth_interval(1));
  OneParam p;
  EXPECT_TRUE(p.iterate(scaler, 1.0f));
  EXPECT_EQ(scaler.get_scale(), top);
  EXPECT_EQ(scaler.growth_tracker(), 0);
}

// unscale_, then clip_grad_norm_ on the true gradients, then step: equal to SGD on gradients
// computed without any scaling and clipped by hand.
TEST(GradScaler, UnscaleThenClipThenStepMatchesAnUnscaledReference) {
  torch::manual_seed(3);
  MLP net, reference;
  copy_parameters(*net, *reference);
  const double lr = 0.1, max_norm = 0.05;
  auto [x, y] = batch(0);

  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(lr));
  ddp::GradScaler scaler;
  optimizer.zero_grad();
  scaler.scale(torch::mse_loss(net->forward(x), y)).backward();
  scaler.unscale_(optimizer);
  torch::nn::utils::clip_grad_norm_(net->parameters(), max_norm);
  EXPECT_TRUE(scaler.step(optimizer));
  scaler.update();

  // Reference: plain gradients, total 2-norm, scaled by max_norm / (norm + 1e-6), p -= lr * g.
  torch::mse_loss(reference->forward(x), y).backward();
  double squares = 0;
  for (const auto& p : reference->parameters()) squares += p.grad().pow(2).sum().item<double>();
  const double norm = std::sqrt(squares);
  ASSERT_GT(norm, max_norm) << "the test must actually clip";
  const double coefficient = max_norm / (norm + 1e-6);
  const auto params = net->parameters();
  const auto expected = reference->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    const auto want = expected[i].detach() - lr * coefficient * expected[i].grad();
    EXPECT_TRUE(torch::allclose(params[i].detach(), want, /*rtol=*/1e-5, /*atol=*/1e-7))
        << "parameter " << i << " differs by " << (params[i].detach() - want).abs().max().item<double>();
  }
}

TEST(GradScaler, UnscaleTwiceBeforeUpdateIsPyTorchsError) {
  ddp::GradScaler scaler;
  OneParam p;
  scaler.scale(torch::zeros({}));
  p.weight.mutable_grad() = torch::ones({4});
  scaler.unscale_(p.optimizer);
  EXPECT_EQ(error_of([&] { scaler.unscale_(p.optimizer); }),
            "unscale_() has already been called on this optimizer since the last update()");
  // The first unscale_ is not undone or repeated: the gradient was divided once.
  EXPECT_TRUE(torch::equal(p.weight.grad(), torch::full({4}, 1.0f / 65536)));
  EXPECT_TRUE(scaler.step(p.optimizer));
  EXPECT_EQ(error_of([&] { scaler.unscale_(p.optimizer); }), "unscale_() is being called after step()");
  EXPECT_EQ(error_of([&] { scaler.step(p.optimizer); }), "step() has already been called since the last update()");
  scaler.update();
  // After update() the optimizer starts a fresh iteration.
  p.weight.mutable_grad() = torch::ones({4});
  EXPECT_NO_THROW(scaler.unscale_(p.optimizer));
}

TEST(GradScaler, MisuseSaysWhatToDo) {
  ddp::GradScaler scaler;
  OneParam p;
  p.weight.mutable_grad() = torch::ones({4});
  EXPECT_NE(error_of([&] { scaler.step(p.optimizer); }).find("call scaler.scale(loss).backward()"), std::string::npos);
  scaler.scale(torch::zeros({}));
  EXPECT_NE(error_of([&] { scaler.update(); }).find("No inf checks were recorded prior to update()"), std::string::npos);
  EXPECT_NE(error_of([&] { scaler.update(-1.0); }).find("new_scale must be a positive finite"), std::string::npos);
  p.weight.mutable_grad() = torch::ones({4}, torch::kHalf);
  EXPECT_NE(error_of([&] { scaler.unscale_(p.optimizer); }).find("Attempting to unscale FP16 gradients"),
            std::string::npos);
  EXPECT_NE(error_of([] { ddp::GradScaler(ddp::GradScalerOptions().growth_factor(1.0)); }).find("growth_factor must be > 1.0"),
            std::string::npos);
  EXPECT_NE(error_of([] { ddp::GradScaler(ddp::GradScalerOptions().backoff_factor(1.0)); }).find("backoff_factor must be in (0, 1)"),
            std::string::npos);
  EXPECT_NE(error_of([] { ddp::GradScaler(ddp::GradScalerOptions().growth_interval(0)); }).find("growth_interval must be >= 1"),
            std::string::npos);
  EXPECT_NE(error_of([] { ddp::GradScaler(ddp::GradScalerOptions().init_scale(0)); }).find("init_scale must be a positive"),
            std::string::npos);
}

TEST(GradScaler, UpdateWithANewScaleKeepsTheCount) {
  ddp::GradScaler scaler(ddp::GradScalerOptions().growth_interval(5));
  OneParam p;
  p.iterate(scaler, 1.0f);
  scaler.update(8.0);
  EXPECT_EQ(scaler.get_scale(), 8.0);
  EXPECT_EQ(scaler.growth_tracker(), 1);
}

// PyTorch: a disabled scaler's scale() returns its input, unscale_/update do nothing, step() just
// steps, get_scale() is 1, state_dict() is empty.
TEST(GradScaler, DisabledScalerPassesThrough) {
  ddp::GradScaler scaler(ddp::GradScalerOptions().enabled(false));
  EXPECT_FALSE(scaler.is_enabled());
  auto loss = torch::tensor(2.5f);
  EXPECT_TRUE(scaler.scale(loss).is_same(loss));
  OneParam p;
  p.weight.mutable_grad() = torch::full({4}, 2.0f);
  scaler.unscale_(p.optimizer);
  scaler.unscale_(p.optimizer);  // no error either: nothing is tracked
  EXPECT_TRUE(torch::equal(p.weight.grad(), torch::full({4}, 2.0f)));
  EXPECT_TRUE(scaler.step(p.optimizer));
  EXPECT_TRUE(torch::equal(p.weight.detach(), torch::full({4}, 1.0f - 0.5f * 2.0f)));  // plain SGD
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 1.0);
  EXPECT_TRUE(scaler.state_dict().empty());
  ddp::GradScaler enabled;
  EXPECT_NE(error_of([&] { enabled.load_state_dict(scaler.state_dict()); })
                .find("The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler"),
            std::string::npos);
}

TEST(GradScaler, StateDictRoundTripIsBitwise) {
  ddp::GradScaler scaler(ddp::GradScalerOptions().init_scale(3.0).growth_factor(1.5).backoff_factor(0.3).growth_interval(4));
  OneParam p;
  p.iterate(scaler, std::numeric_limits<float>::infinity());  // 3 * 0.3 in float32: not a round number
  p.iterate(scaler, 1.0f);
  const auto state = scaler.state_dict();
  EXPECT_EQ(state.at("scale").item<double>(), static_cast<double>(static_cast<float>(3.0 * 0.3)));
  EXPECT_EQ(state.at("_growth_tracker").item<int64_t>(), 1);

  ddp::GradScaler restored;  // default options: the state brings its own factors and interval
  restored.load_state_dict(state);
  EXPECT_EQ(restored.get_scale(), scaler.get_scale());
  EXPECT_EQ(restored.growth_tracker(), 1);
  const auto again = restored.state_dict();
  ASSERT_EQ(again.size(), state.size());
  for (const auto& [key, value] : state) {
    EXPECT_TRUE(torch::equal(again.at(key), value)) << key;
    EXPECT_EQ(again.at(key).scalar_type(), value.scalar_type()) << key;
  }
  // Both continue identically: 3 more clean steps reach growth_interval 4.
  OneParam q;
  for (int i = 0; i < 3; ++i) {
    p.iterate(scaler, 1.0f);
    q.iterate(restored, 1.0f);
  }
  EXPECT_EQ(restored.get_scale(), scaler.get_scale());
  EXPECT_EQ(scaler.get_scale(), static_cast<double>(static_cast<float>(static_cast<float>(3.0 * 0.3) * 1.5)));

  auto broken = state;
  broken.erase("growth_interval");
  EXPECT_NE(error_of([&] { restored.load_state_dict(broken); }).find("no \"growth_interval\""), std::string::npos);
}

}  // namespace
