// Trains one DDP step in a world of one, through the installed or vendored library.
#include <iostream>

#include <torch/torch.h>

#include <ddp/ddp.h>

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  ddp::InitOptions options{"gloo", std::string("file://") + argv[1]};
  options.rank = 0;
  options.world_size = 1;
  ddp::init_process_group(options);
  torch::nn::Linear linear(4, 2);
  ddp::DistributedDataParallel model(linear);
  model.forward(torch::ones({3, 4})).sum().backward();
  std::cout << "torchddp " << TORCHDDP_VERSION << "\n";
  std::cout << "consumer ok: grad sum " << model->weight.grad().sum().item<float>() << std::endl;
  return model.reduction_stats().iterations_reduced == 1 ? 0 : 1;
}
