// Micro-benchmark of the shared-memory collectives (ddp/floor/src/shm): float32 SUM at 4 KB,
// 256 KB, 4 MB and 33.6 MB (mlp_b4's gradients) between forked ranks on this host, the median of
// many runs each - allreduce through the buffers and where the data lies in a shared array
// (allreduce_shared, as DDP's buckets; scaled by 1/ranks as DDP's average), reduce_scatter of an
// input of that size, allgather into an output of that size - beside the memory passes they are made of, timed alone in one process: memcpy
// (and the collectives' own copy loop, copy_bytes) and a float add over 33.6 MB. Run it on a quiet
// machine.
//
//   ddp_shm_bench [--ranks N] [--chunk-kib K] [--one-step-kib K] [--runs-scale X] [--spin-us U]
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ddp/floor/src/shm/communicator.h"

namespace shm = ddp::detail::shm;
using Clock = std::chrono::steady_clock;

namespace {

class FileRendezvous : public shm::Rendezvous {
 public:
  explicit FileRendezvous(std::string folder) : folder_(std::move(folder)) {}
  void set(const std::string& key, const std::string& value) override {
    const std::string temporary = path(key) + ".tmp";
    std::ofstream(temporary) << value;
    std::rename(temporary.c_str(), path(key).c_str());
  }
  std::string get(const std::string& key) override {
    const auto deadline = Clock::now() + std::chrono::seconds(30);
    struct stat info {};
    while (::stat(path(key).c_str(), &info) != 0) {
      if (Clock::now() > deadline) throw std::runtime_error("rendezvous timeout on " + key);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::ifstream file(path(key));
    std::stringstream text;
    text << file.rdbuf();
    return text.str();
  }

 private:
  std::string path(std::string key) const {
    std::replace(key.begin(), key.end(), '/', '_');
    return folder_ + "/" + key;
  }
  std::string folder_;
};

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

template <typename F>
double median_ms(int runs, F&& f) {
  std::vector<double> times;
  for (int i = 0; i < runs; ++i) {
    const auto start = Clock::now();
    f();
    times.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
  }
  return median(times);
}

struct Size {
  const char* label;
  std::size_t floats;
  int runs;
};

const Size kSizes[] = {{"4 KB", 1024, 2000}, {"256 KB", 65536, 500}, {"4 MB", 1 << 20, 100}, {"33.6 MB", 8400000, 30}};

}  // namespace

int main(int argc, char** argv) {
  int ranks = 2;
  shm::Options options;
  options.timeout = std::chrono::seconds(60);
  double runs_scale = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--ranks") ranks = std::atoi(argv[i + 1]);
    else if (flag == "--chunk-kib") options.chunk_bytes = std::strtoull(argv[i + 1], nullptr, 10) << 10;
    else if (flag == "--one-step-kib") options.one_step_bytes = std::strtoull(argv[i + 1], nullptr, 10) << 10;
    else if (flag == "--runs-scale") runs_scale = std::atof(argv[i + 1]);
    else if (flag == "--spin-us") options.spin = std::chrono::microseconds(std::atoi(argv[i + 1]));
    else {
      std::fprintf(stderr, "usage: %s [--ranks N] [--chunk-kib K] [--one-step-kib K] [--runs-scale X] [--spin-us U]\n", argv[0]);
      return 2;
    }
  }

  // The memory passes alone, in this process, before any rank exists.
  const std::size_t floats = 8400000;
  std::vector<float> a(floats, 1.0f), b(floats, 2.0f);
  const double copy_ms = median_ms(20, [&] { std::memcpy(a.data(), b.data(), floats * sizeof(float)); });
  const double copy_bytes_ms = median_ms(20, [&] { shm::copy_bytes(a.data(), b.data(), floats * sizeof(float)); });
  const double add_ms = median_ms(20, [&] {
    float* __restrict x = a.data();
    const float* __restrict y = b.data();
    for (std::size_t i = 0; i < floats; ++i) x[i] += y[i];
  });
  a = {};
  b = {};

  char folder[] = "/tmp/ddp_shm_bench_XXXXXX";
  if (::mkdtemp(folder) == nullptr) return 1;
  const std::string prefix = "/ddpshmbench-" + std::to_string(::getpid());
  std::fflush(nullptr);
  std::vector<pid_t> pids;
  for (int rank = 0; rank < ranks; ++rank) {
    const pid_t pid = ::fork();
    if (pid != 0) {
      pids.push_back(pid);
      continue;
    }
    int status = 0;
    try {
      FileRendezvous rendezvous(folder);
      shm::Communicator comm(rendezvous, prefix, rank, ranks, options);
      // This rank's median per collective and size, ms: allreduce, allreduce_shared, reduce_scatter,
      // allgather, each timed from a common start (a barrier), so the ranks' skew is not counted.
      std::vector<double> medians;
      std::shared_ptr<shm::SharedArray> array = comm.share(kSizes[std::size(kSizes) - 1].floats * sizeof(float));
      const auto time_each = [&](const Size& size, const std::function<void()>& once) {
        const int runs = std::max(5, static_cast<int>(size.runs * runs_scale));
        for (int i = 0; i < 3; ++i) once();
        std::vector<double> times;
        for (int i = 0; i < runs; ++i) {
          comm.barrier();
          const auto start = Clock::now();
          once();
          times.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
        }
        medians.push_back(median(times));
      };
      for (const Size& size : kSizes) {
        std::vector<float> data(size.floats, 1.0f);
        time_each(size, [&] { comm.allreduce(data.data(), data.size(), shm::DType::kFloat32, shm::Op::kSum); });
      }
      for (const Size& size : kSizes) {
        auto* data = static_cast<float*>(array->mine());
        std::fill(data, data + size.floats, 1.0f);
        time_each(size, [&] { comm.allreduce_shared(*array, 0, size.floats, shm::DType::kFloat32, shm::Op::kSum, 1.0 / ranks); });
      }
      for (const Size& size : kSizes) {  // the size is the input's: each rank keeps 1/ranks of it
        std::vector<float> input(size.floats / ranks * ranks, 1.0f), output(size.floats / ranks);
        time_each(size, [&] { comm.reduce_scatter(input.data(), output.size(), output.data(), shm::DType::kFloat32, shm::Op::kSum); });
      }
      for (const Size& size : kSizes) {  // the size is the output's
        std::vector<float> input(size.floats / ranks, 1.0f), output(size.floats / ranks * ranks);
        time_each(size, [&] { comm.allgather(input.data(), input.size() * sizeof(float), output.data()); });
      }
      std::vector<double> all(medians.size() * ranks);
      comm.allgather(medians.data(), medians.size() * sizeof(double), all.data());
      if (rank == 0) {
        std::printf("shared-memory collectives, float32 SUM, %d ranks, chunk %zu KiB, one step up to %zu KiB\n", ranks,
                    comm.options().chunk_bytes >> 10, comm.options().one_step_bytes >> 10);
        std::printf("%-9s %10s %10s %10s %10s   (the slowest rank's median, ms; then GB/s of the size)\n", "size",
                    "allreduce", "shared", "red_scat", "allgather");
        const std::size_t sizes = std::size(kSizes);
        const auto slowest = [&](std::size_t collective, std::size_t size) {
          double ms = 0;
          for (int r = 0; r < ranks; ++r) ms = std::max(ms, all[r * medians.size() + collective * sizes + size]);
          return ms;
        };
        for (std::size_t s = 0; s < sizes; ++s) {
          std::printf("%-9s", kSizes[s].label);
          for (std::size_t c = 0; c < 4; ++c) std::printf(" %10.4f", slowest(c, s));
          std::printf("   ");
          for (std::size_t c = 0; c < 4; ++c) std::printf(" %6.2f", kSizes[s].floats * 4 / slowest(c, s) / 1e6);
          std::printf("\n");
        }
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
      status = 1;
    }
    std::fflush(nullptr);
    ::_exit(status);
  }
  int failures = 0;
  for (const pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    failures += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  std::printf("alone, one process, 33.6 MB: memcpy %.2f ms, copy_bytes %.2f ms, float add (a += b) %.2f ms\n", copy_ms, copy_bytes_ms, add_ms);
  std::system(("rm -rf '" + std::string(folder) + "'").c_str());
  return failures == 0 ? 0 : 1;
}
