// One POSIX shared-memory object (segment.h): create or open, map, unlink, unmap.
#include "ddp/floor/src/shm/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <utility>

namespace ddp::detail::shm {
namespace {

// "shared memory object /x: <what> failed: <strerror> (<hint>)"
[[noreturn]] void fail(const std::string& name, const char* what, int error) {
  std::string text = "shared memory object " + name + ": " + what + " failed: " + std::strerror(error);
  const std::string path = "/dev/shm/" + name.substr(name.empty() ? 0 : 1);
  switch (error) {
    case ENOSPC: text += " (/dev/shm is full; its size is set by the tmpfs mount or the container's --shm-size)"; break;
    case ENOMEM: text += " (out of memory, or over the memory cgroup's limit)"; break;
    case ENOSYS: text += " (no tmpfs mounted at /dev/shm?)"; break;
    case EEXIST:
      text += " (a stale object of an earlier job with the same run id, or another job using the name; if no job runs, remove " +
              path + ")";
      break;
    case EACCES: text += " (it belongs to another user, or /dev/shm is not writable)"; break;
    case EMFILE:
    case ENFILE: text += " (too many open files)"; break;
    default: break;
  }
  throw ShmUnavailable(text);
}

void check_name(const std::string& name) {
  // POSIX leaves other forms implementation-defined; on Linux the name becomes a file in /dev/shm.
  if (name.size() < 2 || name[0] != '/' || name.find('/', 1) != std::string::npos || name.size() > NAME_MAX) {
    throw ShmUnavailable("shared memory object name \"" + name + "\" is invalid: it needs one leading '/', no other '/', and at most " +
                         std::to_string(NAME_MAX) + " characters");
  }
}

// Closes a descriptor on every path out of a function.
struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// A peer's segment is what create() makes: this user's, 0600, at least `bytes` long. Anything
// else was made by someone else (planted under the name before the peer made its own) or changed
// since; a shorter one would SIGBUS when mapped past its end.
void check_made_by_peer(const std::string& name, const struct stat& info, std::size_t bytes) {
  const std::string object = "shared memory object " + name;
  if (info.st_uid != ::geteuid()) {
    throw ShmUnavailable(object + " belongs to uid " + std::to_string(info.st_uid) + ", not to this process's uid " +
                         std::to_string(::geteuid()) + ": not made by a rank of this job");
  }
  if ((info.st_mode & 07777) != (S_IRUSR | S_IWUSR)) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(info.st_mode & 07777));
    throw ShmUnavailable(object + " has mode " + mode + ", not 0600: not made by a rank of this job, or changed since");
  }
  if (static_cast<std::size_t>(info.st_size) < bytes) {
    throw ShmUnavailable(object + " holds " + std::to_string(info.st_size) + " bytes, expected " + std::to_string(bytes));
  }
}

void* map(int fd, std::size_t bytes, const std::string& name) {
  // MAP_POPULATE: fault every page in now rather than inside the first collective.
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (data == MAP_FAILED) fail(name, "mmap", errno);
  return data;
}

}  // namespace

Segment Segment::create(const std::string& name, std::size_t bytes) {
  check_name(name);
  if (bytes == 0) throw ShmUnavailable("shared memory object " + name + ": a segment needs a size above 0");
  // O_EXCL: never adopt an object someone else made (a stale one, or another user's planted one).
  Fd fd{::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, S_IRUSR | S_IWUSR)};
  if (fd.fd < 0) fail(name, "shm_open(O_CREAT | O_EXCL)", errno);
  Segment segment;
  segment.name_ = name;
  segment.owns_name_ = true;  // from here on, every failure removes the name again
  if (::ftruncate(fd.fd, static_cast<off_t>(bytes)) != 0) fail(name, "ftruncate", errno);
  // tmpfs hands out pages lazily: allocate them now so that a full /dev/shm fails here, cleanly,
  // instead of killing the process with SIGBUS on first touch. Filesystems without fallocate skip it.
  int error;
  do error = ::posix_fallocate(fd.fd, 0, static_cast<off_t>(bytes));
  while (error == EINTR);
  if (error != 0 && error != EOPNOTSUPP && error != EINVAL) fail(name, "posix_fallocate", error);
  segment.data_ = map(fd.fd, bytes, name);
  segment.size_ = bytes;
  return segment;
}

Segment Segment::open(const std::string& name, std::size_t bytes) {
  check_name(name);
  Fd fd{::shm_open(name.c_str(), O_RDWR, 0)};
  if (fd.fd < 0) fail(name, "shm_open", errno);
  struct stat info {};
  if (::fstat(fd.fd, &info) != 0) fail(name, "fstat", errno);
  check_made_by_peer(name, info, bytes);
  Segment segment;
  segment.name_ = name;
  segment.data_ = map(fd.fd, bytes, name);
  segment.size_ = bytes;
  return segment;
}

Segment::Segment(Segment&& other) noexcept
    : name_(std::move(other.name_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      owns_name_(std::exchange(other.owns_name_, false)) {}

Segment& Segment::operator=(Segment&& other) noexcept {
  if (this != &other) {
    release();
    name_ = std::move(other.name_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    owns_name_ = std::exchange(other.owns_name_, false);
  }
  return *this;
}

Segment::~Segment() { release(); }

void Segment::unlink() {
  if (!owns_name_) return;
  // ENOENT: already gone (someone removed it by hand); the name is not ours to keep either way.
  if (::shm_unlink(name_.c_str()) != 0 && errno != ENOENT) fail(name_, "shm_unlink", errno);
  owns_name_ = false;
}

void Segment::release() noexcept {
  if (owns_name_) ::shm_unlink(name_.c_str());
  if (data_ != nullptr) ::munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
  owns_name_ = false;
}

}  // namespace ddp::detail::shm
