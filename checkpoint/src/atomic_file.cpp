// Crash-safe replace of a file: temp file in the same directory, flush to disk, atomic rename,
// flush the directory. Only a regular file is replaced. OS-specific, as is directory_lock.cpp: the
// only such code of checkpoint/.
#include <ddp/atomic_file.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>

#ifdef _WIN32
#include <fcntl.h>
#include <io.h>
#include <process.h>
#include <sys/stat.h>
#include <windows.h>
#else
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

namespace ddp {
namespace {

[[noreturn]] void fail(const std::string& step, const std::string& path, int error) {
  throw std::runtime_error("cannot write " + path + ": " + step + " failed: " + std::strerror(error));
}

// "a FIFO (named pipe)": what is at a path, for an error.
std::string kind_of(std::filesystem::file_type type) {
  using std::filesystem::file_type;
  switch (type) {
    case file_type::directory: return "a directory";
    case file_type::fifo: return "a FIFO (named pipe)";
    case file_type::character: return "a character device";
    case file_type::block: return "a block device";
    case file_type::socket: return "a socket";
    default: return "a file of an unknown kind";
  }
}

// A link another user owns, in a directory others may write into (sticky, as /tmp) or that is not
// ours, is not followed: that user would choose which file the save replaces (a root run made to
// overwrite root's own files). The kernel's fs.protected_symlinks refuses the first case, where
// it is on; a save refuses both, wherever it runs.
void refuse_foreign_link(const std::string& path, const std::string& link) {
#ifndef _WIN32
  struct stat link_status {}, directory_status {};
  std::string directory = std::filesystem::path(path).parent_path().string();
  if (directory.empty()) directory = ".";
  if (::lstat(path.c_str(), &link_status) != 0) fail("lstat", path, errno);
  if (::stat(directory.c_str(), &directory_status) != 0) fail("stat of directory " + directory, path, errno);
  const uid_t self = ::geteuid();
  if (link_status.st_uid == self) return;
  const bool sticky = (directory_status.st_mode & S_ISVTX) != 0;
  if (!sticky && directory_status.st_uid == self) return;
  throw std::runtime_error("cannot write " + path + ": " + link + ", owned by another user (uid " +
                           std::to_string(link_status.st_uid) + ") in " + directory + ", a directory " +
                           (sticky ? "others may write into (sticky, as /tmp)" :
                                     "of uid " + std::to_string(directory_status.st_uid)) +
                           ": a save does not follow it (as the kernel's protected_symlinks would not), or that user "
                           "would choose which file it replaces; save to the file it names, or remove the link");
#else
  (void)path;
  (void)link;
#endif
}

// The file a save replaces: `path`, or the regular file a symbolic link there names (torch.save
// writes through a link, and so do we: the link stays, its file is replaced). Anything else is
// refused, so a save never replaces a FIFO, a device node, a socket or a directory with a file.
std::string file_to_replace(const std::string& path) {
  namespace fs = std::filesystem;
  const std::string not_regular =
      ", not a regular file (a save replaces only a regular file, or creates one where nothing is)";
  std::error_code error;
  const fs::file_type own = fs::symlink_status(path, error).type();  // lstat: the link itself
  if (own == fs::file_type::not_found || own == fs::file_type::regular) return path;
  if (own != fs::file_type::symlink) {
    if (own == fs::file_type::none) fail("lstat", path, error.value());
    throw std::runtime_error("cannot write " + path + ": it is " + kind_of(own) + not_regular);
  }
  const std::string link = "it is a symbolic link to " + fs::read_symlink(path, error).string();
  refuse_foreign_link(path, link);
  const fs::file_type target = fs::status(path, error).type();  // stat: what it names
  if (target == fs::file_type::not_found) {
    throw std::runtime_error("cannot write " + path + ": " + link +
                             ", which does not exist (remove the link, or save to the path it names)");
  }
  if (target != fs::file_type::regular) {
    if (target == fs::file_type::none) fail("stat", path, error.value());
    throw std::runtime_error("cannot write " + path + ": " + link + ", which is " + kind_of(target) + not_regular);
  }
  const std::string file = fs::canonical(path, error).string();
  if (error) fail("resolving the symbolic link", path, error.value());
  return file;
}

int process_id() {
#ifdef _WIN32
  return _getpid();
#else
  return static_cast<int>(getpid());
#endif
}

}  // namespace

constexpr char kTemporaryPrefix[] = ".torchddp-tmp.";

std::string temporary_path_for(const std::string& path) {
  // Same directory, so the rename never crosses file systems; pid keeps writers apart.
  const std::filesystem::path file(path);
  return (file.parent_path() / (kTemporaryPrefix + std::to_string(process_id()) + "." + file.filename().string())).string();
}

namespace {

// The writer's pid in a temporary file's name ".torchddp-tmp.<pid>.<name>", or -1 for any other name.
long writer_of(const std::string& file_name) {
  const std::string prefix = kTemporaryPrefix;
  if (file_name.rfind(prefix, 0) != 0) return -1;
  const std::size_t dot = file_name.find('.', prefix.size());
  if (dot == std::string::npos || dot == prefix.size() || dot + 1 == file_name.size()) return -1;
  const std::string digits = file_name.substr(prefix.size(), dot - prefix.size());
  if (digits.size() > 9 || !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return -1;
  }
  return std::stol(digits);
}

// Ours to remove: a regular file this user owns (never one of another user's, nor what a link names).
bool is_own_regular_file(const std::filesystem::path& path) {
#ifdef _WIN32
  (void)path;
  return false;
#else
  struct stat status {};
  return ::lstat(path.c_str(), &status) == 0 && S_ISREG(status.st_mode) && status.st_uid == ::geteuid();
#endif
}

bool process_is_gone(long pid) {
#ifdef _WIN32
  (void)pid;
  return false;  // not checked on Windows: such files are left alone
#else
  return pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
#endif
}

}  // namespace

int remove_orphaned_temporaries(const std::string& directory) {
  std::error_code error;
  int removed = 0;
  for (const auto& entry : std::filesystem::directory_iterator(directory.empty() ? "." : directory, error)) {
    const long pid = writer_of(entry.path().filename().string());
    if (pid < 0 || pid == process_id() || !process_is_gone(pid) || !is_own_regular_file(entry.path())) continue;
    std::error_code ignored;  // another process may sweep the same file at the same moment
    if (std::filesystem::remove(entry.path(), ignored)) ++removed;
  }
  return removed;
}

#ifdef _WIN32

void write_file_atomically(const std::string& target, const char* data, std::size_t size) {
  const std::string path = file_to_replace(target);
  const std::string temporary = temporary_path_for(path);
  int fd = _open(temporary.c_str(), _O_WRONLY | _O_CREAT | _O_TRUNC | _O_BINARY, _S_IREAD | _S_IWRITE);
  if (fd < 0) fail("open of " + temporary, path, errno);
  std::size_t done = 0;
  while (done < size) {
    const unsigned chunk = static_cast<unsigned>(std::min<std::size_t>(size - done, 1u << 30));
    const int written = _write(fd, data + done, chunk);
    if (written < 0) {
      const int error = errno;
      _close(fd);
      _unlink(temporary.c_str());
      fail("write", path, error);
    }
    done += static_cast<std::size_t>(written);
  }
  // _commit is Windows' fsync.
  if (_commit(fd) != 0) {
    const int error = errno;
    _close(fd);
    _unlink(temporary.c_str());
    fail("flush (_commit)", path, error);
  }
  _close(fd);
  // Atomic replace on NTFS; WRITE_THROUGH returns only once the rename is on disk (no directory
  // handle to flush on Windows).
  if (!MoveFileExA(temporary.c_str(), path.c_str(), MOVEFILE_REPLACE_EXISTING | MOVEFILE_WRITE_THROUGH)) {
    _unlink(temporary.c_str());
    throw std::runtime_error("cannot write " + path + ": MoveFileEx failed with error " +
                             std::to_string(GetLastError()));
  }
}

#else

namespace {

// The new file takes the mode and owner of the one it replaces, as a write in place would keep
// them (torch.save's open(path, "wb")). The owner only where this process may give files away
// (root, or the same user with the file's group); the group where it may; else the file is ours.
template <typename Abandon>
void keep_mode_and_owner(int fd, const struct stat& replaced, const Abandon& abandon) {
  if (::fchown(fd, replaced.st_uid, replaced.st_gid) != 0) (void)::fchown(fd, static_cast<uid_t>(-1), replaced.st_gid);
  if (::fchmod(fd, replaced.st_mode & 07777) != 0) abandon("fchmod");
}

}  // namespace

void write_file_atomically(const std::string& target, const char* data, std::size_t size) {
  const std::string path = file_to_replace(target);
  // A writer killed mid-write (SIGKILL, OOM) left its temporary file behind: nothing else removes it.
  remove_orphaned_temporaries(std::filesystem::path(path).parent_path().string());
  const std::string temporary = temporary_path_for(path);
  // A regular file under our temporary name was left by a writer with our pid that died (pids
  // are reused): ours to replace. Anything else there is not ours: O_EXCL refuses it (a link
  // too), so we never write into it, and the unlinks below only ever remove our own file.
  if (is_own_regular_file(temporary)) ::unlink(temporary.c_str());
  struct stat replaced {};
  const bool replaces = ::stat(path.c_str(), &replaced) == 0;
  // Private until it takes the replaced file's mode: nobody opens it meanwhile.
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, replaces ? 0600 : 0644);
  if (fd < 0) fail("open of " + temporary, path, errno);
  auto abandon = [&](const std::string& step) {
    const int error = errno;
    ::close(fd);
    ::unlink(temporary.c_str());
    fail(step, path, error);
  };
  if (replaces) keep_mode_and_owner(fd, replaced, abandon);
  std::size_t done = 0;
  while (done < size) {
    const ssize_t written = ::write(fd, data + done, size - done);
    if (written < 0) {
      if (errno == EINTR) continue;
      abandon("write");
    }
    done += static_cast<std::size_t>(written);
  }
  // The data must be on disk before the rename makes it visible, or a power loss could expose
  // a renamed but empty file.
  if (::fsync(fd) != 0) abandon("fsync");
  if (::close(fd) != 0) {
    const int error = errno;
    ::unlink(temporary.c_str());
    fail("close", path, error);
  }
  // Checked again: the write may have taken long. (A rename cannot be made conditional on what it
  // replaces, so a node put there from now on would still be replaced.)
  try {
    file_to_replace(path);
  } catch (const std::exception&) {
    ::unlink(temporary.c_str());
    throw;
  }
  if (::rename(temporary.c_str(), path.c_str()) != 0) {
    const int error = errno;
    ::unlink(temporary.c_str());
    fail("rename", path, error);
  }
  // The rename lives in the directory: flush it so the new name survives a power loss.
  std::string directory = std::filesystem::path(path).parent_path().string();
  if (directory.empty()) directory = ".";
  const int dir_fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) fail("open of directory " + directory, path, errno);
  if (::fsync(dir_fd) != 0 && errno != EINVAL) {  // EINVAL: file system without directory fsync
    const int error = errno;
    ::close(dir_fd);
    fail("fsync of directory " + directory, path, error);
  }
  ::close(dir_fd);
}

#endif

}  // namespace ddp
