// ddp_bench: what does gradient synchronization cost in a C++ training step, and how does
// torchddp compare with what a C++ user can do instead? (README.md lists the peers.)
//
//   ddp_bench --world 1,2 --out bench_out
//
// The parent forks+execs itself once per rank for each world size (RANK, WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT in the environment, rendezvous env:// over Gloo). Every rank builds
// every peer, then runs them in interleaved rounds so machine noise hits all peers alike. Rank 0
// writes <out>/raw_w<W>.json; the parent merges those into results.csv, results.json and
// buckets.dat, and draws buckets.png with gnuplot when it can.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <torch/torch.h>

#include <ddp/ddp.h>

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

struct Config {
  std::vector<int> worlds{1, 2};
  int input = 256;
  int hidden = 1024;
  int layers = 6;  // hidden layers; 5.5M parameters (21 MiB of gradients) with the defaults
  int classes = 10;
  int batch = 16;   // per rank; small, so that synchronization is a visible part of the step
  int warmup = 2;   // untimed steps per peer (torchddp rebuilds its buckets after the first)
  int steps = 3;    // timed steps per peer per round
  int repeats = 6;  // interleaved rounds: short blocks, so load changes hit every peer alike
  bool sweep = true;
  bool c10d_reducer = true;
  int timeout_s = 280;  // for one world size, all ranks
  std::string out = "ddp_bench_out";
};

void usage() {
  std::cout << "usage: ddp_bench [--world 1,2] [--out DIR] [--input N] [--hidden N] [--layers N]\n"
               "                 [--batch N] [--warmup N] [--steps N] [--repeats N]\n"
               "                 [--no-sweep] [--no-c10d] [--timeout SECONDS]\n";
}

std::vector<int> parse_list(const std::string& text) {
  std::vector<int> values;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) values.push_back(std::stoi(item));
  return values;
}

Config parse(int argc, char** argv) {
  Config c;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--world") c.worlds = parse_list(value());
    else if (arg == "--out") c.out = value();
    else if (arg == "--input") c.input = std::stoi(value());
    else if (arg == "--hidden") c.hidden = std::stoi(value());
    else if (arg == "--layers") c.layers = std::stoi(value());
    else if (arg == "--batch") c.batch = std::stoi(value());
    else if (arg == "--warmup") c.warmup = std::stoi(value());
    else if (arg == "--steps") c.steps = std::stoi(value());
    else if (arg == "--repeats") c.repeats = std::stoi(value());
    else if (arg == "--timeout") c.timeout_s = std::stoi(value());
    else if (arg == "--no-sweep") c.sweep = false;
    else if (arg == "--no-c10d") c.c10d_reducer = false;
    else if (arg == "--help" || arg == "-h") { usage(); std::exit(0); }
    else throw std::invalid_argument("unknown argument " + arg);
  }
  return c;
}

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// ------------------------------------------------------------------------------------------------
// The model and the peers
// ------------------------------------------------------------------------------------------------

struct Mlp : torch::nn::Module {
  explicit Mlp(const Config& c) {
    int64_t in = c.input;
    for (int i = 0; i < c.layers; ++i) {
      hidden.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(in, c.hidden)));
      in = c.hidden;
    }
    head = register_module("head", torch::nn::Linear(in, c.classes));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& layer : hidden) x = torch::relu(layer->forward(x));
    return head->forward(x);
  }
  std::vector<torch::nn::Linear> hidden;
  torch::nn::Linear head{nullptr};
};

struct Batch {
  at::Tensor x, y;
};

// Every peer starts from the same weights, so all do exactly the same arithmetic.
std::shared_ptr<Mlp> make_model(const Config& c) {
  torch::manual_seed(1);
  return std::make_shared<Mlp>(c);
}

std::shared_ptr<torch::optim::SGD> make_sgd(const std::shared_ptr<Mlp>& model) {
  return std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(1e-3));
}

struct Peer {
  Peer(std::string name, std::string what) : name(std::move(name)), what(std::move(what)) {}
  std::string name;           // id in the CSV
  std::string what;           // one line for humans
  double bucket_cap_mb = 0;   // sweep entries only
  bool in_sweep = false;
  std::function<void()> step;           // zero_grad, forward, backward (+ sync), SGD step
  std::function<int64_t()> buckets;     // collectives per step, where known
  std::vector<double> times_ms;         // every timed step, all rounds
  std::vector<double> round_median_ms;  // one per round
  // copy_in_out only: the time of the copies alone, per timed step (steady_clock around them).
  std::shared_ptr<std::vector<double>> copy_ms;
};

Peer no_ddp(const Config& c, const Batch& b) {
  auto model = make_model(c);
  auto sgd = make_sgd(model);
  Peer p{"no_ddp", "no synchronization: each rank trains alone on its local batch"};
  p.step = [=] {
    sgd->zero_grad();
    torch::nn::functional::cross_entropy(model->forward(b.x), b.y).backward();
    sgd->step();
  };
  return p;
}

// What C++ users write today: after backward, a blocking allreduce of every gradient.
Peer hand_per_param(const Config& c, const Batch& b, ddp::ProcessGroupPtr pg) {
  auto model = make_model(c);
  auto sgd = make_sgd(model);
  const double world = pg->getSize();
  Peer p{"hand_per_param", "after backward: one blocking allreduce per parameter, then divide"};
  p.step = [=] {
    sgd->zero_grad();
    torch::nn::functional::cross_entropy(model->forward(b.x), b.y).backward();
    for (const auto& param : model->parameters()) {
      at::Tensor grad = param.grad();
      ddp::all_reduce(grad, c10d::ReduceOp::SUM, pg);
      grad.div_(world);
    }
    sgd->step();
  };
  const auto count = static_cast<int64_t>(model->parameters().size());
  p.buckets = [count] { return count; };
  return p;
}

// The better hand-rolled version: flatten all gradients, one allreduce, copy back.
Peer hand_flat(const Config& c, const Batch& b, ddp::ProcessGroupPtr pg) {
  auto model = make_model(c);
  auto sgd = make_sgd(model);
  const double world = pg->getSize();
  Peer p{"hand_flat", "after backward: cat all gradients, one allreduce, copy back"};
  p.step = [=] {
    sgd->zero_grad();
    torch::nn::functional::cross_entropy(model->forward(b.x), b.y).backward();
    const auto params = model->parameters();
    std::vector<at::Tensor> grads;
    for (const auto& param : params) grads.push_back(param.grad().reshape({-1}));
    at::Tensor flat = torch::cat(grads);
    ddp::all_reduce(flat, c10d::ReduceOp::SUM, pg);
    flat.div_(world);
    int64_t offset = 0;
    for (const auto& param : params) {
      param.grad().view({-1}).copy_(flat.narrow(0, offset, param.numel()));
      offset += param.numel();
    }
    sgd->step();
  };
  p.buckets = [] { return int64_t{1}; };
  return p;
}

// The reducer's copy-mode work with no communication: scale each gradient into a flat buffer,
// then copy it back. Against no_ddp this isolates the cost of the copies themselves.
Peer copy_in_out(const Config& c, const Batch& b, ddp::ProcessGroupPtr pg) {
  auto model = make_model(c);
  auto sgd = make_sgd(model);
  const auto params = model->parameters();
  int64_t total = 0;
  for (const auto& param : params) total += param.numel();
  auto flat = torch::zeros({total});
  auto slots = std::make_shared<std::vector<at::Tensor>>();
  int64_t offset = 0;
  for (auto it = params.rbegin(); it != params.rend(); ++it) {  // reverse, like the buckets
    slots->push_back(flat.narrow(0, offset, it->numel()).view(it->sizes()));
    offset += it->numel();
  }
  const auto scale = torch::full({}, 1.0 / pg->getSize());
  Peer p{"copy_in_out", "no_ddp plus the reducer's copies (grad*1/W into a bucket, then back), no comm"};
  p.copy_ms = std::make_shared<std::vector<double>>();
  auto copy_ms = p.copy_ms;
  p.step = [=] {
    sgd->zero_grad();
    torch::nn::functional::cross_entropy(model->forward(b.x), b.y).backward();
    at::NoGradGuard no_grad;
    const auto start = std::chrono::steady_clock::now();
    for (size_t k = 0; k < params.size(); ++k) {
      at::Tensor slot = (*slots)[k];
      at::mul_out(slot, params[params.size() - 1 - k].grad(), scale);
    }
    for (size_t k = 0; k < params.size(); ++k) params[params.size() - 1 - k].grad().copy_((*slots)[k]);
    copy_ms->push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    sgd->step();
  };
  return p;
}

Peer torchddp(const Config& c, const Batch& b, ddp::ProcessGroupPtr pg, ddp::DDPOptions options,
              std::string name, std::string what) {
  auto model = make_model(c);
  auto sgd = make_sgd(model);
  auto wrapped = std::make_shared<ddp::DistributedDataParallel<Mlp>>(model, pg, options);
  Peer p{std::move(name), std::move(what)};
  p.step = [=] {
    sgd->zero_grad();
    torch::nn::functional::cross_entropy(wrapped->forward(b.x), b.y).backward();
    sgd->step();
  };
  p.buckets = [wrapped] { return static_cast<int64_t>(wrapped->reduction_stats().buckets.size()); };
  return p;
}

// PyTorch's own reducer, driven the way torch/nn/parallel/distributed.py (1.13) drives it:
// buckets from compute_bucket_assignment_by_size in reverse order, then per iteration
// prepare_for_forward, rebuild_buckets, forward, prepare_for_backward.
Peer c10d_reducer(const Config& c, const Batch& b, ddp::ProcessGroupPtr pg) {
  constexpr int64_t kFirstBucket = 1 << 20;
  constexpr int64_t kBucket = 25 << 20;
  auto model = make_model(c);
  auto sgd = make_sgd(model);
  const auto params = model->parameters();
  const std::vector<bool> sparse(params.size(), false);
  auto [indices, limits] = c10d::compute_bucket_assignment_by_size(
      params, {static_cast<size_t>(kFirstBucket), static_cast<size_t>(kBucket)}, sparse);
  std::reverse(indices.begin(), indices.end());
  std::reverse(limits.begin(), limits.end());
  const auto initial_buckets = static_cast<int64_t>(indices.size());
  auto reducer = std::make_shared<c10d::Reducer>(params, indices, limits, pg, sparse, kBucket,
                                                 /*find_unused_parameters=*/false,
                                                 /*gradient_as_bucket_view=*/false,
                                                 std::unordered_map<size_t, std::string>{}, kFirstBucket);
  Peer p{"c10d_reducer", "PyTorch's c10d::Reducer (what Python DDP runs), default options"};
  p.step = [=] {
    sgd->zero_grad();
    reducer->prepare_for_forward();
    reducer->rebuild_buckets();  // a no-op after the one rebuild
    at::Tensor out = model->forward(b.x);
    reducer->prepare_for_backward({});
    torch::nn::functional::cross_entropy(out, b.y).backward();
    sgd->step();
  };
  p.buckets = [initial_buckets] { return initial_buckets; };
  return p;
}

// ------------------------------------------------------------------------------------------------
// One rank
// ------------------------------------------------------------------------------------------------

// Per round, the median of peer p's steps divided by the reference's, then the median over rounds:
// a slow patch of the machine affects both sides of each ratio.
double ratio(const Peer& peer, const Peer& reference) {
  std::vector<double> ratios;
  for (size_t r = 0; r < peer.round_median_ms.size(); ++r) {
    ratios.push_back(peer.round_median_ms[r] / reference.round_median_ms[r]);
  }
  return median(ratios);
}

int run_rank(const Config& c) {
  torch::set_num_threads(1);
  ddp::InitOptions init;
  init.backend = "gloo";
  init.init_method = "env://";
  init.timeout = std::chrono::seconds(c.timeout_s);
  auto pg = ddp::init_process_group(init);
  const int rank = pg->getRank();
  const int world = pg->getSize();

  torch::manual_seed(100 + rank);  // each rank its own shard of data
  const Batch batch{torch::randn({c.batch, c.input}), torch::randint(c.classes, {c.batch})};

  std::vector<Peer> peers;
  peers.push_back(no_ddp(c, batch));
  peers.push_back(copy_in_out(c, batch, pg));
  peers.push_back(hand_per_param(c, batch, pg));
  peers.push_back(hand_flat(c, batch, pg));
  peers.push_back(torchddp(c, batch, pg, ddp::DDPOptions(), "torchddp",
                           "ddp::DistributedDataParallel, default options (25 MiB buckets, first 1 MiB)"));
  peers.back().in_sweep = true;
  peers.back().bucket_cap_mb = 25;
  peers.push_back(torchddp(c, batch, pg, ddp::DDPOptions().gradient_as_bucket_view(true), "torchddp_view",
                           "torchddp with gradient_as_bucket_view(true)"));
  if (c.c10d_reducer) peers.push_back(c10d_reducer(c, batch, pg));
  if (c.sweep) {
    for (double cap : {0.25, 1.0, 5.0, 100.0}) {
      std::ostringstream name;
      name << "torchddp_cap_" << cap;
      peers.push_back(torchddp(c, batch, pg, ddp::DDPOptions().bucket_cap_mb(cap), name.str(),
                               "torchddp, bucket_cap_mb=" + name.str().substr(13)));
      peers.back().in_sweep = true;
      peers.back().bucket_cap_mb = cap;
    }
  }

  const auto started = std::chrono::steady_clock::now();
  for (auto& peer : peers) {
    for (int i = 0; i < c.warmup; ++i) peer.step();
  }
  for (int round = 0; round < c.repeats; ++round) {
    // Rotate the order each round so no peer always runs right after the same neighbour.
    for (size_t k = 0; k < peers.size(); ++k) {
      Peer& peer = peers[(k + round) % peers.size()];
      ddp::barrier(pg);
      std::vector<double> times;
      for (int s = 0; s < c.steps; ++s) {
        const auto start = std::chrono::steady_clock::now();
        peer.step();
        times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
      }
      peer.times_ms.insert(peer.times_ms.end(), times.begin(), times.end());
      if (peer.copy_ms && round == 0 && peer.copy_ms->size() > static_cast<size_t>(c.steps)) {
        peer.copy_ms->erase(peer.copy_ms->begin(), peer.copy_ms->end() - c.steps);  // drop warm-up
      }
      peer.round_median_ms.push_back(median(times));
    }
    if (rank == 0) {
      std::cerr << "world " << world << ": round " << round + 1 << "/" << c.repeats << " done, "
                << static_cast<int>(std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count())
                << " s\n";
    }
  }
  ddp::barrier(pg);
  if (rank != 0) return 0;

  const Peer& base = peers[0];
  const Peer& ddp_default = peers[4];
  // The best bucket size: the lowest ratio against the default, the same measure that is reported.
  const Peer* best = nullptr;
  for (const auto& peer : peers) {
    if (peer.in_sweep && (!best || ratio(peer, ddp_default) < ratio(*best, ddp_default))) best = &peer;
  }
  int64_t numel = 0;
  for (const auto& param : make_model(c)->parameters()) numel += param.numel();
  json out;
  out["world"] = world;
  out["parameters"] = numel;
  out["config"] = {{"input", c.input}, {"hidden", c.hidden}, {"layers", c.layers}, {"classes", c.classes},
                   {"batch_per_rank", c.batch}, {"warmup", c.warmup}, {"steps", c.steps},
                   {"repeats", c.repeats}, {"torch_threads", 1}};
  for (const auto& peer : peers) {
    json row = {{"peer", peer.name},
                {"what", peer.what},
                {"median_ms", median(peer.times_ms)},
                {"ratio_vs_no_ddp", ratio(peer, base)},
                {"ratio_vs_torchddp", ratio(peer, ddp_default)}};
    if (peer.buckets) row["collectives_per_step"] = peer.buckets();
    if (peer.copy_ms) {
      row["copy_only_median_ms"] = median(*peer.copy_ms);
      row["copy_fraction_of_no_ddp_step"] = median(*peer.copy_ms) / median(base.times_ms);
    }
    if (peer.in_sweep) {
      row["bucket_cap_mb"] = peer.bucket_cap_mb;
      // Through the default, so the best entry is exactly 1 and every other one is >= 1.
      row["ratio_vs_best_bucket"] = ratio(peer, ddp_default) / ratio(*best, ddp_default);
    }
    out["peers"].push_back(row);
  }
  fs::create_directories(c.out);
  std::ofstream(fs::path(c.out) / ("raw_w" + std::to_string(world) + ".json")) << out.dump(2) << "\n";
  return 0;
}

// ------------------------------------------------------------------------------------------------
// The parent: spawn ranks, merge, plot
// ------------------------------------------------------------------------------------------------

// A port the kernel just handed out; free again by the time the ranks bind it (almost always).
int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    throw std::runtime_error("could not find a free port");
  }
  const int port = ntohs(address.sin_port);
  close(fd);
  return port;
}

// Forks+execs this program once per rank; a rank that fails or a run past the timeout ends all.
bool spawn_world(int world, const Config& c, char** argv) {
  const std::string port = std::to_string(free_port());
  std::vector<pid_t> children;
  for (int rank = 0; rank < world; ++rank) {
    const pid_t pid = fork();
    if (pid == 0) {
      setenv("RANK", std::to_string(rank).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", port.c_str(), 1);
      setenv("OMP_NUM_THREADS", "1", 1);  // one compute thread per rank
      execv("/proc/self/exe", argv);
      std::perror("execv");
      _exit(127);
    }
    if (pid < 0) throw std::runtime_error("fork failed");
    children.push_back(pid);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(c.timeout_s);
  bool ok = true;
  bool killed = false;
  size_t running = children.size();
  while (running > 0) {
    int status = 0;
    const pid_t done = waitpid(-1, &status, killed ? 0 : WNOHANG);
    if (done > 0) {
      --running;
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ok = false;
    } else if (std::chrono::steady_clock::now() > deadline) {
      std::cerr << "world " << world << ": timed out after " << c.timeout_s << " s\n";
      ok = false;
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (!ok && !killed) {  // stop the others rather than wait for their collectives to time out
      for (pid_t child : children) kill(child, SIGTERM);
      killed = true;
    }
  }
  return ok;
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return text;
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

std::string fmt(double value, int digits = 3) {
  std::ostringstream out;
  out.setf(std::ios::fixed);
  out.precision(digits);
  out << value;
  return out.str();
}

void merge_and_plot(const Config& c) {
  const fs::path dir(c.out);
  json all = {{"date", utc_now()},
              {"machine", {{"cpu", cpu_model()}, {"cores", std::thread::hardware_concurrency()}}},
              {"runs", json::array()}};
  std::ofstream csv(dir / "results.csv");
  csv << "world,peer,bucket_cap_mb,collectives_per_step,median_ms,ratio_vs_no_ddp,ratio_vs_torchddp,"
         "ratio_vs_best_bucket\n";
  std::ofstream dat(dir / "buckets.dat");
  for (int world : c.worlds) {
    std::ifstream raw(dir / ("raw_w" + std::to_string(world) + ".json"));
    if (!raw) continue;
    const json run = json::parse(raw);
    all["runs"].push_back(run);
    std::cout << "\nworld " << world << " (" << run["parameters"] << " parameters, batch " << c.batch
              << " per rank)\n";
    std::printf("  %-22s %10s %10s %10s %10s\n", "peer", "median_ms", "vs_no_ddp", "vs_torchddp", "vs_best_bkt");
    dat << "# world " << world << ": bucket_cap_mb, step time / best\n";
    for (const auto& row : run["peers"]) {
      const bool sweep = row.contains("bucket_cap_mb");
      csv << world << ',' << row["peer"].get<std::string>() << ','
          << (sweep ? fmt(row["bucket_cap_mb"].get<double>(), 2) : "") << ','
          << (row.contains("collectives_per_step") ? std::to_string(row["collectives_per_step"].get<int64_t>()) : "")
          << ',' << fmt(row["median_ms"].get<double>()) << ',' << fmt(row["ratio_vs_no_ddp"].get<double>()) << ','
          << fmt(row["ratio_vs_torchddp"].get<double>()) << ','
          << (sweep ? fmt(row["ratio_vs_best_bucket"].get<double>()) : "") << '\n';
      std::printf("  %-22s %10.2f %10.3f %10.3f %10s\n", row["peer"].get<std::string>().c_str(),
                  row["median_ms"].get<double>(), row["ratio_vs_no_ddp"].get<double>(),
                  row["ratio_vs_torchddp"].get<double>(),
                  sweep ? fmt(row["ratio_vs_best_bucket"].get<double>()).c_str() : "");
    }
    for (const auto& row : run["peers"]) {
      if (row.contains("copy_only_median_ms")) {
        std::printf("  copies alone (grad*1/W into a bucket and back): %.2f ms = %.1f%% of a no_ddp step\n",
                    row["copy_only_median_ms"].get<double>(), 100 * row["copy_fraction_of_no_ddp_step"].get<double>());
      }
    }
    // One gnuplot data block per world size, rows sorted by bucket size.
    std::vector<std::pair<double, double>> points;
    for (const auto& row : run["peers"]) {
      if (row.contains("bucket_cap_mb")) {
        points.emplace_back(row["bucket_cap_mb"].get<double>(), row["ratio_vs_best_bucket"].get<double>());
      }
    }
    std::sort(points.begin(), points.end());
    for (const auto& [cap, r] : points) dat << cap << ' ' << r << '\n';
    dat << "\n\n";
  }
  dat.close();
  std::ofstream(dir / "results.json") << all.dump(2) << "\n";

  const fs::path script = fs::path(DDP_BENCH_SOURCE_DIR) / "plot_buckets.gp";
  if (c.sweep && fs::exists(script)) {
    std::string worlds;
    for (int world : c.worlds) worlds += std::to_string(world) + " ";
    const std::string command = "gnuplot -e \"datafile='" + (dir / "buckets.dat").string() + "'; outfile='" +
                                (dir / "buckets.png").string() + "'; worlds='" + worlds + "'\" '" +
                                script.string() + "'";
    if (std::system(command.c_str()) != 0) std::cerr << "gnuplot failed; buckets.dat is still there\n";
  }
  std::cout << "\nwrote " << (dir / "results.csv").string() << ", results.json, buckets.dat"
            << (c.sweep ? ", buckets.png" : "") << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Config config = parse(argc, argv);
    if (std::getenv("RANK") != nullptr) return run_rank(config);  // spawned by us, ddprun or torchrun
    fs::create_directories(config.out);
    for (int world : config.worlds) {
      fs::remove(fs::path(config.out) / ("raw_w" + std::to_string(world) + ".json"));
      std::cerr << "world " << world << ": starting " << world << " rank(s)\n";
      if (!spawn_world(world, config, argv)) {
        std::cerr << "world " << world << " failed\n";
        return 1;
      }
    }
    merge_and_plot(config);
    return 0;
  } catch (const std::exception& error) {
    std::cerr << "ddp_bench: " << error.what() << "\n";
    return 1;
  }
}
