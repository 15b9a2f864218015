#pragma once
// What the README's and docs/*.md's C++ fragments assume, declared once: readme_code_test.sh
// compiles every block marked `<!-- compiles: fragment -->` as the body of a function after this
// header (-fsyntax-only: nothing here is defined or linked). A fragment may declare any of these
// names itself (a local shadows the one here). Add a name here when a new fragment assumes one;
// keep each the type a reader would guess from the text around the block.
#include <cstdint>
#include <memory>
#include <string>

#include <torch/torch.h>

#include <ddp/ddp.h>

// "any torch::nn::Module subclass"
struct Net : torch::nn::Module {
  Net();
  torch::Tensor forward(torch::Tensor x);
};

// The data: a LibTorch dataset and the loader over it that ddp::make_data_loader returns.
using ReadmeDataset = torch::data::datasets::MapDataset<torch::data::datasets::MNIST, torch::data::transforms::Stack<>>;
extern torch::data::datasets::MNIST dataset;
extern std::unique_ptr<ddp::DataLoader<ReadmeDataset>> loader;
extern ddp::DistributedSampler sampler;
extern ddp::SamplerState saved;  // a position saved earlier
extern bool resuming;

// The job: its group, model, optimizer, loss and loop bounds.
extern ddp::ProcessGroupPtr pg;
extern std::shared_ptr<Net> net;
extern ddp::DistributedDataParallel<Net> model;
extern torch::optim::SGD optimizer;
extern torch::Tensor loss;
extern int64_t epochs;
extern int64_t start_epoch;
extern int64_t iteration;
extern double learning_rate;

// Checkpoints: a file, a folder of them, the training state, and a GAN's two models and optimizers.
extern std::string path;
extern std::string dir;
extern ddp::TrainingState state;
extern ddp::GradScaler scaler;
extern ddp::DistributedDataParallel<Net> G;
extern ddp::DistributedDataParallel<Net> D;
extern torch::optim::Adam optG;
extern torch::optim::Adam optD;
