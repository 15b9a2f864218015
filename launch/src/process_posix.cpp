#include "process.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <cerrno>
#include <cstdlib>
#include <stdexcept>

extern char** environ;

namespace ddprun {

std::string ExitStatus::describe() const {
  if (signal == 0) return "exited with code " + std::to_string(code);
  const char* name = sigabbrev_np(signal);
  return "was killed by signal " + std::to_string(signal) + (name ? std::string(" (SIG") + name + ")" : "");
}

namespace {

std::vector<char*> c_strings(const std::vector<std::string>& strings) {
  std::vector<char*> pointers;
  for (const auto& s : strings) pointers.push_back(const_cast<char*>(s.c_str()));
  pointers.push_back(nullptr);
  return pointers;
}

bool is_executable_file(const std::string& path) {
  struct stat info {};
  return stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode) && access(path.c_str(), X_OK) == 0;
}

}  // namespace

std::string find_program(const std::string& name) {
  if (name.empty()) return "";
  if (name.find('/') != std::string::npos) {
    if (!is_executable_file(name)) return "";
    char* resolved = realpath(name.c_str(), nullptr);
    std::string path = resolved ? resolved : name;
    free(resolved);
    return path;
  }
  const char* path_env = std::getenv("PATH");
  std::string path = path_env ? path_env : "/usr/local/bin:/usr/bin:/bin";
  size_t start = 0;
  while (start <= path.size()) {
    size_t end = path.find(':', start);
    if (end == std::string::npos) end = path.size();
    std::string dir = path.substr(start, end - start);
    if (dir.empty()) dir = ".";
    const std::string candidate = dir + "/" + name;
    if (is_executable_file(candidate)) return candidate;
    start = end + 1;
  }
  return "";
}

std::vector<std::string> current_environment() {
  std::vector<std::string> env;
  for (char** entry = environ; *entry != nullptr; ++entry) env.emplace_back(*entry);
  return env;
}

std::string own_executable() {
  char buffer[4096];
  const ssize_t n = readlink("/proc/self/exe", buffer, sizeof(buffer) - 1);
  if (n <= 0) throw std::runtime_error(std::string("cannot find ddprun's own path in /proc/self/exe: ") + strerror(errno));
  return std::string(buffer, static_cast<size_t>(n));
}

Child spawn(const std::string& path, const std::vector<std::string>& args, const std::vector<std::string>& env,
            StdinMode stdin_mode) {
  // Everything the child needs is prepared before fork: between fork and exec only
  // async-signal-safe calls are allowed (ddprun has threads once a TCPStore exists).
  auto argv = c_strings(args);
  auto envp = c_strings(env);
  int out[2], err[2], exec_error[2], in[2] = {-1, -1};
  if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0 || pipe2(exec_error, O_CLOEXEC) != 0 ||
      (stdin_mode == StdinMode::kPipe && pipe2(in, O_CLOEXEC) != 0)) {
    throw std::runtime_error(std::string("pipe failed: ") + strerror(errno));
  }
  // A rank is not in the terminal's foreground process group: reading the terminal would stop it
  // (SIGTTIN), so its stdin is /dev/null, or a pipe only we write to.
  const int stdin_source = stdin_mode == StdinMode::kPipe ? in[0] : open("/dev/null", O_RDONLY | O_CLOEXEC);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    const int error = errno;
    for (int fd : {out[0], out[1], err[0], err[1], exec_error[0], exec_error[1], stdin_source, in[1]}) close(fd);
    throw std::runtime_error(std::string("fork failed: ") + strerror(error));
  }
  if (pid == 0) {
    setpgid(0, 0);
#ifdef __linux__
    // Last resort against orphans: if ddprun is SIGKILLed, the kernel kills the rank.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);  // ddprun died before prctl took effect
#endif
    // Undo ddprun's signal setup: the program starts with default dispositions and no mask.
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    for (int s : {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE}) signal(s, SIG_DFL);
    if (stdin_source >= 0) dup2(stdin_source, STDIN_FILENO);
    dup2(out[1], STDOUT_FILENO);
    dup2(err[1], STDERR_FILENO);
    execve(path.c_str(), argv.data(), envp.data());
    const int error = errno;
    (void)!write(exec_error[1], &error, sizeof(error));
    _exit(127);
  }
  setpgid(pid, pid);  // also from the parent, so signal_group works even before the child ran
  if (stdin_source >= 0) close(stdin_source);
  close(out[1]);
  close(err[1]);
  close(exec_error[1]);
  int error = 0;
  ssize_t got;
  do {
    got = read(exec_error[0], &error, sizeof(error));  // EOF (0) means exec succeeded
  } while (got < 0 && errno == EINTR);
  close(exec_error[0]);
  if (got == sizeof(error)) {
    waitpid(pid, nullptr, 0);
    close(out[0]);
    close(err[0]);
    if (in[1] >= 0) close(in[1]);
    // execve's ENOENT for a file that exists means its #! interpreter (or ELF loader) is missing.
    const bool missing_interpreter = error == ENOENT && access(path.c_str(), F_OK) == 0;
    throw std::runtime_error("could not start " + path + ": " + strerror(error) +
                             (missing_interpreter ? " (the file exists: is the interpreter on its #! line missing?)" : ""));
  }
  fcntl(out[0], F_SETFL, O_NONBLOCK);
  fcntl(err[0], F_SETFL, O_NONBLOCK);
  Child child;
  child.pid = pid;
  child.stdout_fd = out[0];
  child.stderr_fd = err[0];
  child.stdin_fd = in[1];
  child.running = true;
  return child;
}

void signal_group(const Child& child, int signal) {
  if (child.running) kill(-child.pid, signal);
}

bool reap_if_exited(Child& child) {
  if (!child.running) return false;
  siginfo_t info{};
  // Peek first (WNOWAIT): while the leader is an unreaped zombie its pid cannot be reused, so
  // killing the group below cannot hit an unrelated process.
  if (waitid(P_PID, child.pid, &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid == 0) return false;
  kill(-child.pid, SIGKILL);  // a rank's helpers do not outlive it
  int status = 0;
  while (waitpid(child.pid, &status, 0) < 0 && errno == EINTR) {
  }
  child.running = false;
  if (WIFSIGNALED(status)) {
    child.status.signal = WTERMSIG(status);
  } else {
    child.status.code = WEXITSTATUS(status);
  }
  return true;
}

int listen_any(int port, int backlog) {
  int error = EAFNOSUPPORT;
  for (int family : {AF_INET6, AF_INET}) {
    const int fd = socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      error = errno;
      continue;
    }
    int one = 1, zero = 0;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    int bound;
    if (family == AF_INET6) {
      setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
      sockaddr_in6 address{};
      address.sin6_family = AF_INET6;
      address.sin6_addr = in6addr_any;
      address.sin6_port = htons(static_cast<uint16_t>(port));
      bound = bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
    } else {
      sockaddr_in address{};
      address.sin_family = AF_INET;
      address.sin_addr.s_addr = htonl(INADDR_ANY);
      address.sin_port = htons(static_cast<uint16_t>(port));
      bound = bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
    }
    if (bound == 0 && listen(fd, backlog) == 0) return fd;
    error = errno;
    close(fd);
    if (error == EADDRINUSE) break;  // taken: IPv4 alone would be taken too
  }
  errno = error;
  return -1;
}

int listen_at(const std::string& address, int port, int backlog) {
  if (address.empty()) return listen_any(port, backlog);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (getaddrinfo(address.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) {
    errno = EADDRNOTAVAIL;
    return -1;
  }
  int fd = -1, error = EADDRNOTAVAIL;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, backlog) == 0) break;
    error = errno;
    close(fd);
    fd = -1;
  }
  freeaddrinfo(found);
  if (fd < 0) errno = error;
  return fd;
}

bool port_is_free(int port) {
  const int fd = listen_any(port, 1);
  if (fd < 0) return false;
  close(fd);
  return true;
}

int pick_free_port() {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    if (fd >= 0) close(fd);
    throw std::runtime_error(std::string("could not pick a free port: ") + strerror(errno));
  }
  close(fd);
  return ntohs(address.sin_port);
}

}  // namespace ddprun
