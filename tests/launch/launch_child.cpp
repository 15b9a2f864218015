// The program ddprun starts in launch_tests. Usage: launch_child MODE [args]
//   allreduce DIR       init_process_group(env://), all_reduce(rank+1); writes DIR/rank_<RANK>.txt
//                       with the result, torchrun's variables and when the collective finished
//   fail_once DIR       rank 1 exits 5 on the first attempt; then behaves like allreduce
//   fail R CODE [stubborn]  rank R exits CODE after 0.3 s; the others sleep (ignoring SIGTERM
//                       when "stubborn", so only SIGKILL ends them)
//   fail_late R CODE S  like fail, but rank R waits S seconds before exiting
//   resume DIR          a training loop of 6 steps that checkpoints every step in DIR/ckpt and
//                       resumes from the newest; rank 1 exits 5 at step 3 on the first attempt.
//                       Appends "attempt=A step=S weight=W" to DIR/steps_<RANK>.txt per finished step
//   hang [grandchild]   prints "ready rank=R pid=P" and sleeps; optionally starts a helper
//                       process first (it must die with the rank's process group)
//   print DIR           printf "first line rank=R" (no fflush), waits up to 30 s for DIR/go (the
//                       test creates it once it has read that line through ddprun), then redraws a
//                       progress line with "\r" and ends it with "done rank=R"; exit 3 without go
//   unfinished DIR      rank 1 draws "50%\r" (flushed, no newline) and waits up to 30 s for DIR/go
//                       (the test creates it once ddprun has shown that state), then ends the line
//                       as "100%"; every rank ends with "done rank=R"; exit 3 without go
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>

#include <torch/torch.h>

#include <ddp/checkpoint.h>
#include <ddp/process_group.h>

namespace {

std::string env(const char* name) {
  const char* value = std::getenv(name);
  return value ? value : "<unset>";
}

int rank() { return std::atoi(env("RANK").c_str()); }

void sleep_s(double seconds) {
  std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<long long>(seconds * 1000)));
}

// The world ddprun set up (env://), with a timeout so a broken launch fails instead of hanging.
void init_from_launcher() {
  ddp::InitOptions options;
  options.backend = "gloo";
  options.init_method = "env://";
  options.timeout = std::chrono::seconds(60);
  ddp::init_process_group(options);
}

int allreduce(const std::string& dir) {
  init_from_launcher();
  auto value = torch::full({4}, static_cast<float>(ddp::get_rank() + 1));
  ddp::all_reduce(value);
  const auto done = std::chrono::system_clock::now().time_since_epoch();
  const int world = ddp::get_world_size();
  const float expected = world * (world + 1) / 2.0f;
  const bool ok = torch::allclose(value, torch::full({4}, expected));
  std::ofstream out(dir + "/rank_" + env("RANK") + ".txt");
  out << "sum=" << value[0].item<float>() << "\n"
      << "pg_rank=" << ddp::get_rank() << "\npg_world=" << world << "\n";
  for (const char* name : {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                           "MASTER_ADDR", "MASTER_PORT", "DDPRUN_RESTART_COUNT", "OMP_NUM_THREADS", "TORCHDDP_RUN_ID",
                           "DDPRUN_RDZV_TOKEN"}) {
    out << name << "=" << env(name) << "\n";
  }
  out << "done_ns=" << std::chrono::duration_cast<std::chrono::nanoseconds>(done).count() << "\n";
  out.close();
  std::cout << "all_reduce " << (ok ? "ok" : "WRONG") << " on rank " << ddp::get_rank() << std::endl;
  ddp::barrier();  // nobody tears down the store while a peer still needs it
  return ok ? 0 : 1;
}

// Every step adds exactly 1 to the weight (SGD, lr 1, gradient -1), so the weight counts the steps
// the model really went through: a repeated or skipped step after resume shows in it.
int resume(const std::string& dir) {
  init_from_launcher();
  const std::string attempt = env("DDPRUN_RESTART_COUNT");
  const std::string ckpt_dir = dir + "/ckpt";
  auto model = torch::nn::Linear(torch::nn::LinearOptions(1, 1).bias(false));
  {
    torch::NoGradGuard no_grad;
    model->weight.zero_();
  }
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(1.0));
  int64_t step = 0;
  if (auto latest = ddp::latest_checkpoint(ckpt_dir)) {
    step = ddp::load_checkpoint(*latest, *model, &optimizer).global_step;
    std::cout << "rank " << rank() << " resumed from " << *latest << " at step " << step << std::endl;
  }
  std::ofstream log(dir + "/steps_" + env("RANK") + ".txt", std::ios::app);
  for (++step; step <= 6; ++step) {
    if (step == 3 && attempt == "0" && rank() == 1) {
      std::cerr << "rank 1 failing at step 3 (first attempt)" << std::endl;
      return 5;
    }
    optimizer.zero_grad();
    (-model->weight.sum()).backward();
    optimizer.step();
    std::filesystem::create_directories(ckpt_dir);
    ddp::TrainingState state;
    state.global_step = step;
    ddp::save_checkpoint(ddp::checkpoint_path(ckpt_dir, step), *model, &optimizer, state,
                         ddp::CheckpointOptions().keep_last(2));
    log << "attempt=" << attempt << " step=" << step << " weight=" << model->weight.item<float>() << std::endl;
  }
  ddp::barrier();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "allreduce" && argc > 2) return allreduce(argv[2]);
  if (mode == "fail_once" && argc > 2) {
    if (env("DDPRUN_RESTART_COUNT") == "0" && rank() == 1) {
      std::cerr << "rank 1 failing on purpose (first attempt)" << std::endl;
      return 5;
    }
    return allreduce(argv[2]);
  }
  if (mode == "fail" && argc > 3) {
    const bool stubborn = argc > 4 && std::string(argv[4]) == "stubborn";
    if (stubborn) signal(SIGTERM, SIG_IGN);
    std::cout << "started rank " << rank() << " pid=" << getpid() << std::endl;
    // Long enough for every other rank to have started and said so (loading LibTorch takes a
    // second or more on a loaded machine): tests read every rank's "started" line.
    sleep_s(2.0);
    if (rank() == std::atoi(argv[2])) {
      std::cerr << "rank " << rank() << " giving up with code " << argv[3] << std::endl;
      return std::atoi(argv[3]);
    }
    sleep_s(120);
    return 0;
  }
  if (mode == "resume" && argc > 2) return resume(argv[2]);
  if (mode == "fail_late" && argc > 4) {
    std::cout << "started rank " << rank() << " pid=" << getpid() << std::endl;
    if (rank() != std::atoi(argv[2])) {
      sleep_s(120);
      return 0;
    }
    sleep_s(std::atof(argv[4]));
    std::cerr << "rank " << rank() << " giving up with code " << argv[3] << std::endl;
    return std::atoi(argv[3]);
  }
  if (mode == "print" && argc > 2) {
    // stdio buffers a pipe in blocks: the line reaches ddprun now only if stdout is line-buffered.
    std::printf("first line rank=%d\n", rank());
    const auto go = std::filesystem::path(argv[2]) / "go";
    for (int i = 0; i < 300 && !std::filesystem::exists(go); ++i) sleep_s(0.1);
    if (!std::filesystem::exists(go)) {
      std::printf("nobody read the first line rank=%d\n", rank());
      return 3;
    }
    for (int step = 1; step <= 50; ++step) {
      std::printf("\rprogress %d/50", step);
      std::fflush(stdout);  // as progress bars do: each redraw reaches ddprun on its own
    }
    std::printf("\r\033[Kdone rank=%d\n", rank());
    return 0;
  }
  if (mode == "unfinished" && argc > 2) {
    if (rank() == 1) {
      // A bar that stops mid-line, as one does while a long step runs: nothing more comes until go.
      std::printf("50%%\r");
      std::fflush(stdout);
      const auto go = std::filesystem::path(argv[2]) / "go";
      for (int i = 0; i < 300 && !std::filesystem::exists(go); ++i) sleep_s(0.1);
      if (!std::filesystem::exists(go)) {
        std::printf("\nnobody saw 50%% of rank=%d\n", rank());
        return 3;
      }
      std::printf("100%%\n");
    }
    std::printf("done rank=%d\n", rank());
    return 0;
  }
  if (mode == "hang") {
    if (argc > 2 && std::string(argv[2]) == "grandchild") {
      // "ready" only once the helper has exec'd (the close-on-exec pipe reads EOF then), so the
      // test's process-table count never catches it mid-exec.
      int exec_done[2];
      if (pipe2(exec_done, O_CLOEXEC) != 0) return 70;
      if (fork() == 0) {
        execlp("sleep", "sleep", "120", static_cast<char*>(nullptr));
        _exit(127);
      }
      close(exec_done[1]);
      char byte;
      while (read(exec_done[0], &byte, 1) > 0) {
      }
      close(exec_done[0]);
    }
    std::cout << "ready rank=" << rank() << " pid=" << getpid() << std::endl;
    sleep_s(120);
    return 0;
  }
  std::cerr << "launch_child: bad arguments (mode '" << mode << "')" << std::endl;
  return 64;
}
