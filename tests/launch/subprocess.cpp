#include "subprocess.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace launch_test {

Subprocess::Subprocess(const std::vector<std::string>& args, const std::map<std::string, std::string>& env) {
  std::vector<std::string> env_strings;
  for (char** e = environ; *e; ++e) {
    const std::string entry = *e;
    if (env.count(entry.substr(0, entry.find('='))) == 0) env_strings.push_back(entry);
  }
  for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (auto& e : env_strings) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
  start_ = std::chrono::steady_clock::now();
  pid_ = fork();
  if (pid_ == 0) {
    dup2(pipe_fds[1], 1);
    dup2(pipe_fds[1], 2);
    execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  close(pipe_fds[1]);
  fd_ = pipe_fds[0];
}

Subprocess::~Subprocess() {
  if (!exited_ && pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  if (fd_ >= 0) close(fd_);
}

bool Subprocess::read_some(int timeout_ms) {
  if (fd_ < 0) return false;
  pollfd p{fd_, POLLIN, 0};
  if (poll(&p, 1, timeout_ms) <= 0) return true;
  char buffer[8192];
  const ssize_t n = read(fd_, buffer, sizeof(buffer));
  if (n <= 0) {
    close(fd_);
    fd_ = -1;
    return false;
  }
  output_.append(buffer, static_cast<size_t>(n));
  return true;
}

bool Subprocess::wait_for_output(const std::string& text, int count, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    int found = 0;
    for (size_t at = output_.find(text); at != std::string::npos; at = output_.find(text, at + 1)) ++found;
    if (found >= count) return true;
    if (!read_some(50)) return false;
  }
  return false;
}

Finished Subprocess::wait(std::chrono::milliseconds timeout) {
  Finished result;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (true) {
    read_some(20);
    const pid_t done = waitpid(pid_, &status, WNOHANG);
    if (done == pid_) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      kill(pid_, SIGKILL);
      waitpid(pid_, &status, 0);
      result.timed_out = true;
      break;
    }
  }
  exited_ = true;
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  // The rest of the output; bounded, since an escaped grandchild may hold the pipe open.
  const auto drain_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (fd_ >= 0 && std::chrono::steady_clock::now() < drain_deadline) read_some(20);
  if (WIFSIGNALED(status)) result.signal = WTERMSIG(status);
  else result.exit_code = WEXITSTATUS(status);
  result.output = output_;
  return result;
}

Finished run(const std::vector<std::string>& args, const std::map<std::string, std::string>& env,
             std::chrono::milliseconds timeout) {
  Subprocess process(args, env);
  return process.wait(timeout);
}

std::vector<int> tagged_processes(const std::string& tag) {
  const std::string needle = "DDPRUN_TEST_TAG=" + tag;
  std::vector<int> pids;
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return pids;
  while (dirent* entry = readdir(proc)) {
    const int pid = std::atoi(entry->d_name);
    if (pid <= 0) continue;
    const std::string base = std::string("/proc/") + entry->d_name;
    std::ifstream stat(base + "/stat");
    std::string line;
    std::getline(stat, line);
    const auto close_paren = line.rfind(')');
    if (close_paren == std::string::npos || close_paren + 2 >= line.size() || line[close_paren + 2] == 'Z') continue;
    std::ifstream environ_file(base + "/environ", std::ios::binary);
    std::stringstream content;
    content << environ_file.rdbuf();
    const std::string env = content.str();
    // Entries are NUL-separated: match a whole entry.
    for (size_t at = env.find(needle); at != std::string::npos; at = env.find(needle, at + 1)) {
      const size_t end = at + needle.size();
      if ((at == 0 || env[at - 1] == '\0') && (end == env.size() || env[end] == '\0')) {
        pids.push_back(pid);
        break;
      }
    }
  }
  closedir(proc);
  return pids;
}

std::vector<int> wait_until_no_tagged(const std::string& tag, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pids = tagged_processes(tag);
  while (!pids.empty() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    pids = tagged_processes(tag);
  }
  return pids;
}

std::string unique_tag(const std::string& name) {
  static std::atomic<int> counter{0};
  return name + "_" + std::to_string(getpid()) + "_" + std::to_string(counter++);
}

}  // namespace launch_test
