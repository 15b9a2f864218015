// free_port and spawn_self (procutil.h).
#include "procutil.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

extern char** environ;

namespace ddp::procutil {

int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;  // any port: the kernel picks one
  socklen_t length = sizeof(address);
  const bool ok = fd >= 0 && bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  const int error = errno;
  if (fd >= 0) close(fd);
  if (!ok) throw std::runtime_error(std::string("free_port: no port from the kernel: ") + std::strerror(error));
  return ntohs(address.sin_port);
}

pid_t spawn_self(const std::vector<std::string>& argv, const SpawnOptions& options) {
  if (argv.empty()) throw std::invalid_argument("spawn_self: argv needs at least argv[0]");
  // Everything the child needs is built here: after fork only async-signal-safe calls follow.
  std::vector<std::string> environment;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string text = *entry;
    if (options.env.count(text.substr(0, text.find('='))) == 0) environment.push_back(text);
  }
  for (const auto& [key, value] : options.env) environment.push_back(key + "=" + value);
  std::vector<char*> args, envp;
  for (const auto& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  for (const auto& entry : environment) envp.push_back(const_cast<char*>(entry.c_str()));
  envp.push_back(nullptr);

  const pid_t pid = fork();
  if (pid == 0) {
    if (options.own_process_group) setpgid(0, 0);
    if (!options.log.empty()) {
      const int fd = open(options.log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(fd, 1);
      dup2(fd, 2);
    }
    execve("/proc/self/exe", args.data(), envp.data());
    static const char message[] = "spawn_self: exec of /proc/self/exe failed\n";
    (void)!write(2, message, sizeof(message) - 1);
    _exit(127);
  }
  if (pid < 0) throw std::runtime_error(std::string("spawn_self: fork failed: ") + std::strerror(errno));
  return pid;
}

}  // namespace ddp::procutil
