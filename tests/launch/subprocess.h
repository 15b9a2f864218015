#pragma once
// Runs ddprun (or anything) as a subprocess with extra environment, capturing stdout+stderr,
// under a hard deadline; and finds a job's processes in /proc by a tag in their environment.
#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace launch_test {

struct Finished {
  int exit_code = -1;  // when signal == 0 and !timed_out
  int signal = 0;
  bool timed_out = false;
  double seconds = 0;
  std::string output;
};

class Subprocess {
 public:
  Subprocess(const std::vector<std::string>& args, const std::map<std::string, std::string>& env);
  ~Subprocess();  // SIGKILLs it if still running
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;

  int pid() const { return pid_; }
  // Reads output until `text` has appeared `count` times; false on timeout or exit.
  bool wait_for_output(const std::string& text, int count, std::chrono::milliseconds timeout);
  // Waits for exit; on timeout kills it and reports timed_out.
  Finished wait(std::chrono::milliseconds timeout);
  const std::string& output() const { return output_; }

 private:
  bool read_some(int timeout_ms);  // false at EOF
  int pid_ = -1;
  int fd_ = -1;
  bool exited_ = false;
  std::string output_;
  std::chrono::steady_clock::time_point start_;
};

Finished run(const std::vector<std::string>& args, const std::map<std::string, std::string>& env = {},
             std::chrono::milliseconds timeout = std::chrono::seconds(120));

// Pids of live (non-zombie) processes whose environment holds DDPRUN_TEST_TAG=<tag>.
std::vector<int> tagged_processes(const std::string& tag);
// Polls until no tagged process is left; returns those still there after `timeout`.
std::vector<int> wait_until_no_tagged(const std::string& tag, std::chrono::milliseconds timeout);
std::string unique_tag(const std::string& name);

}  // namespace launch_test
