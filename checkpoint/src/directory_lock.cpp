// The checkpoint directory's lock (directory_lock.h): flock on a file in the directory, so the
// kernel releases it when its process ends, however it ends; the file's text only names the holder.
#include "checkpoint/src/directory_lock.h"

#include <cerrno>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <utility>
#include <vector>

#ifndef _WIN32
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

#include <ddp/launch_environment.h>

namespace ddp {

#ifdef _WIN32

void lock_checkpoint_directory(const std::string&) {}

#else

namespace {

constexpr char kLockName[] = ".torchddp-checkpoint.lock";

// The directories whose lock this process holds (by device and inode: one directory, any spelling),
// with the descriptor that holds it, open until the process exits.
struct HeldLocks {
  std::mutex mutex;
  std::vector<std::pair<dev_t, ino_t>> directories;
};
HeldLocks& held_locks() {
  static HeldLocks* locks = new HeldLocks();  // never destroyed: the locks last as long as the process
  return *locks;
}

// This job's run id; torchrun's default "none" names no run.
std::string own_run_id() {
  try {
    const std::string id = launch_environment().run_id;
    return id == "none" ? "" : id;
  } catch (const std::exception&) {  // a half-set launcher's variables: init_process_group names them
    return "";
  }
}

std::string host_name() {
  char name[256] = {};
  return ::gethostname(name, sizeof(name) - 1) == 0 ? name : "?";
}

// "run_id=<id> pid=<pid> host=<host>\n": the lock file's text.
std::string holder_line(const std::string& run_id) {
  return "run_id=" + run_id + " pid=" + std::to_string(::getpid()) + " host=" + host_name() + "\n";
}

std::string field_of(const std::string& line, const std::string& key) {
  const std::size_t at = line.find(key + "=");
  if (at == std::string::npos) return "";
  const std::size_t start = at + key.size() + 1;
  return line.substr(start, line.find_first_of(" \n", start) - start);
}

std::string text_of_file(int fd) {
  char buffer[512] = {};
  const ssize_t n = ::pread(fd, buffer, sizeof(buffer) - 1, 0);
  return n > 0 ? std::string(buffer, static_cast<std::size_t>(n)) : "";
}

[[noreturn]] void refuse(const std::string& directory, const std::string& lock, const std::string& holder) {
  const std::string run = field_of(holder, "run_id");
  throw std::runtime_error(
      "the checkpoint directory " + directory + " is in use by another job: " + lock + " names " +
      (run.empty() ? "a run without an id" : "run '" + run + "'") + ", pid " + field_of(holder, "pid") + " on host " +
      field_of(holder, "host") + ", which still holds it (this is " +
      (own_run_id().empty() ? "a run without an id" : "run '" + own_run_id() + "'") +
      "). Two jobs saving into one directory overwrite and prune each other's checkpoints: give this job its own "
      "directory, or end the other (a lock whose process has ended is taken over)");
}

}  // namespace

void lock_checkpoint_directory(const std::string& given) {
  const std::string directory = given.empty() ? "." : given;
  struct stat directory_status {};
  if (::stat(directory.c_str(), &directory_status) != 0) return;  // the save itself names what is wrong
  const std::pair<dev_t, ino_t> id{directory_status.st_dev, directory_status.st_ino};
  HeldLocks& locks = held_locks();
  std::lock_guard<std::mutex> guard(locks.mutex);
  for (const auto& held : locks.directories) {
    if (held == id) return;
  }
  const std::string lock = directory + "/" + kLockName;
  // Never through a link, and never another kind of file: this is the only file the lock writes.
  const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) {
    throw std::runtime_error("cannot lock the checkpoint directory " + directory + ": open of " + lock +
                             " failed: " + std::strerror(errno));
  }
  struct stat lock_status {};
  if (::fstat(fd, &lock_status) != 0 || !S_ISREG(lock_status.st_mode)) {
    ::close(fd);
    throw std::runtime_error("cannot lock the checkpoint directory " + directory + ": " + lock +
                             " is not a regular file");
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    const std::string holder = text_of_file(fd);
    ::close(fd);
    if (error != EWOULDBLOCK) return;  // a file system without locks (some network ones): unlocked, as before
    const std::string run = own_run_id();
    if (!run.empty() && field_of(holder, "run_id") == run) return;  // another process of this job
    refuse(directory, lock, holder);
  }
  // Ours now (taken over, if a process that ended left it): name this process in it.
  const std::string line = holder_line(own_run_id());
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, line.data(), line.size(), 0) != static_cast<ssize_t>(line.size())) {
    const int error = errno;
    ::close(fd);
    throw std::runtime_error("cannot lock the checkpoint directory " + directory + ": write of " + lock +
                             " failed: " + std::strerror(error));
  }
  locks.directories.push_back(id);  // fd stays open: the lock lasts until this process exits
}

#endif

}  // namespace ddp
