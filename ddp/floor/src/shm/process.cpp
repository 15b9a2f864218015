// A process's state, by pid, from /proc (process.h).
#include "ddp/floor/src/shm/process.h"

#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <fstream>
#include <iterator>
#include <sstream>
#include <thread>

namespace ddp::detail::shm {

ProcessInfo read_process(int pid) {
  ProcessInfo info;
  if (pid <= 0 || (::kill(pid, 0) != 0 && errno == ESRCH)) return info;
  info.exists = true;
  std::ifstream file("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  const auto paren = text.rfind(')');  // the command name may hold spaces and parentheses
  if (paren == std::string::npos) return info;
  std::istringstream fields(text.substr(paren + 1));
  std::string field;
  fields >> info.state;
  for (int i = 4; i < 22 && fields >> field; ++i) {
  }
  fields >> info.start_time;  // field 22
  return info;
}

bool exited(const ProcessInfo& now, std::uint64_t start_time) {
  return !now.exists || now.state == 'Z' || now.state == 'X' || (start_time != 0 && now.start_time != 0 && now.start_time != start_time);
}

bool stopped(const ProcessInfo& now) { return now.exists && (now.state == 'T' || now.state == 't'); }

std::string pid_space() {
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  char link[PATH_MAX] = {};
  const ssize_t length = ::readlink("/proc/self/ns/pid", link, sizeof link - 1);
  // Without either, no pid of another process can be trusted to mean the same process here.
  if (boot.empty() || length <= 0) return "";
  return boot + " " + std::string(link, static_cast<std::size_t>(length));
}

int cpus_available() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace ddp::detail::shm
