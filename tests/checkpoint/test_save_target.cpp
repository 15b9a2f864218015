// What a save does to what is already at its path (issue 28): a regular file is replaced, a
// symbolic link is written through (as torch.save does), anything else is refused and left as it
// was: a FIFO, a directory, a socket, a device node (the save used to replace it with a file).
#ifndef _WIN32
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/atomic_file.h>
#include <ddp/checkpoint.h>

#include "error_of.h"
#include "models.h"
#include "multiprocess.h"

namespace {

using ckpt_test::ToyModel;

class SaveTarget : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ddp::test::make_temp_dir("ckpt-target");
    path_ = dir_ + "/ckpt.pt";
  }
  void TearDown() override { ddp::test::remove_tree(dir_); }

  std::string save_error(const std::string& path) {
    return ddp::test::error_of<ddp::CheckpointError>([&] { ddp::save_checkpoint(path, *model_, nullptr, {}); });
  }
  // The file type at `path` itself (not following a link), as lstat says.
  static struct stat status_of(const std::string& path) {
    struct stat status {};
    EXPECT_EQ(::stat(path.c_str(), &status), 0) << path;
    return status;
  }
  static std::string text_of(const std::string& path) {
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  static mode_t type_of(const std::string& path) {
    struct stat status {};
    return ::lstat(path.c_str(), &status) == 0 ? (status.st_mode & S_IFMT) : 0;
  }
  // Nothing but `expected` in the directory: no temporary file left behind (the directory's
  // lock, which the save takes first, stays).
  void expect_only(const std::vector<std::string>& expected) {
    std::vector<std::string> names;
    for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
      if (entry.path().filename() != ".torchddp-checkpoint.lock") names.push_back(entry.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    EXPECT_EQ(names, expected);
  }
  std::string refused(const std::string& path, const std::string& what) {
    return "cannot save checkpoint " + path + ": cannot write " + path + ": " + what +
           ", not a regular file (a save replaces only a regular file, or creates one where nothing is)";
  }

  ToyModel model_;
  std::string dir_, path_;
};

TEST_F(SaveTarget, AFifoIsRefusedAndKept) {
  ASSERT_EQ(::mkfifo(path_.c_str(), 0600), 0);
  EXPECT_EQ(save_error(path_), refused(path_, "it is a FIFO (named pipe)"));
  EXPECT_EQ(type_of(path_), static_cast<mode_t>(S_IFIFO));
  expect_only({"ckpt.pt"});
}

TEST_F(SaveTarget, ADirectoryIsRefusedAndKept) {
  std::filesystem::create_directory(path_);
  std::ofstream(path_ + "/inside") << "kept";
  EXPECT_EQ(save_error(path_), refused(path_, "it is a directory"));
  EXPECT_EQ(type_of(path_), static_cast<mode_t>(S_IFDIR));
  EXPECT_TRUE(std::filesystem::exists(path_ + "/inside"));
  expect_only({"ckpt.pt"});
}

TEST_F(SaveTarget, ASocketIsRefusedAndKept) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  ASSERT_LT(path_.size(), sizeof(address.sun_path));
  std::strncpy(address.sun_path, path_.c_str(), sizeof(address.sun_path) - 1);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  EXPECT_EQ(save_error(path_), refused(path_, "it is a socket"));
  EXPECT_EQ(type_of(path_), static_cast<mode_t>(S_IFSOCK));
  ::close(fd);
}

// A device node of our own making (the same device as /dev/null, 1:3), never a real one: if the
// save replaced it, only this test's copy would be lost.
TEST_F(SaveTarget, ADeviceNodeIsRefusedAndKept) {
  if (::geteuid() != 0) GTEST_SKIP() << "making a device node (mknod) needs root";
  ASSERT_EQ(::mknod(path_.c_str(), S_IFCHR | 0600, makedev(1, 3)), 0);
  EXPECT_EQ(save_error(path_), refused(path_, "it is a character device"));
  EXPECT_EQ(type_of(path_), static_cast<mode_t>(S_IFCHR));
  expect_only({"ckpt.pt"});
}

// PyTorch's torch.save writes through a symbolic link, and so does a save here: the link stays,
// the regular file it names is replaced. A link to anything else is refused like that thing.
TEST_F(SaveTarget, ALinkIsWrittenThroughToARegularFileOnly) {
  const std::string target = dir_ + "/target.pt";
  std::ofstream(target) << "old";
  std::filesystem::create_symlink("target.pt", path_);
  EXPECT_EQ(save_error(path_), "");
  EXPECT_EQ(type_of(path_), static_cast<mode_t>(S_IFLNK));
  ToyModel loaded;
  ddp::load_checkpoint(target, *loaded, nullptr);
  EXPECT_TRUE(ckpt_test::same_state(*loaded, *model_));
  expect_only({"ckpt.pt", "target.pt"});

  const std::string fifo_link = dir_ + "/fifo-link.pt";
  ASSERT_EQ(::mkfifo((dir_ + "/fifo").c_str(), 0600), 0);
  std::filesystem::create_symlink("fifo", fifo_link);
  EXPECT_EQ(save_error(fifo_link), refused(fifo_link, "it is a symbolic link to fifo, which is a FIFO (named pipe)"));
  EXPECT_EQ(type_of(fifo_link), static_cast<mode_t>(S_IFLNK));
  EXPECT_EQ(type_of(dir_ + "/fifo"), static_cast<mode_t>(S_IFIFO));

  const std::string dangling = dir_ + "/dangling.pt";
  std::filesystem::create_symlink("nothing-here", dangling);
  EXPECT_EQ(save_error(dangling), "cannot save checkpoint " + dangling + ": cannot write " + dangling +
                                      ": it is a symbolic link to nothing-here, which does not exist (remove the "
                                      "link, or save to the path it names)");
  EXPECT_EQ(type_of(dangling), static_cast<mode_t>(S_IFLNK));
  expect_only({"ckpt.pt", "dangling.pt", "fifo", "fifo-link.pt", "target.pt"});
}

// Something already at the temporary file's path is neither written into nor removed: the save
// fails. (It used to open a FIFO there, write the checkpoint into it, then unlink it.)
TEST_F(SaveTarget, SomethingAtTheTemporaryPathIsNotTouched) {
  const std::string temporary = ddp::temporary_path_for(path_);
  ASSERT_EQ(::mkfifo(temporary.c_str(), 0600), 0);
  const int reader = ::open(temporary.c_str(), O_RDONLY | O_NONBLOCK);  // so no open for writing can block
  ASSERT_GE(reader, 0);
  EXPECT_EQ(save_error(path_), "cannot save checkpoint " + path_ + ": cannot write " + path_ + ": open of " + temporary +
                                   " failed: File exists");
  EXPECT_EQ(type_of(temporary), static_cast<mode_t>(S_IFIFO));
  EXPECT_EQ(type_of(path_), 0u);
  ::close(reader);
  // A regular file there is what a writer with this pid left when it died: replaced as before.
  ::unlink(temporary.c_str());
  std::ofstream(temporary) << "left by a dead writer";
  EXPECT_EQ(save_error(path_), "");
  expect_only({"ckpt.pt"});
}

// A replaced file keeps its mode, and its owner where the saving process may give it (before:
// a save through a link turned 0600 into 0644, and a root run left a file of root's).
TEST_F(SaveTarget, AReplacedFileKeepsItsModeAndOwner) {
  const bool root = ::geteuid() == 0;
  std::ofstream(path_) << "old";
  ASSERT_EQ(::chmod(path_.c_str(), 0600), 0);
  if (root) ASSERT_EQ(::chown(path_.c_str(), 65534, 65534), 0);
  EXPECT_EQ(save_error(path_), "");
  EXPECT_EQ(status_of(path_).st_mode & 07777, 0600u);
  if (root) {
    EXPECT_EQ(status_of(path_).st_uid, 65534u);
    EXPECT_EQ(status_of(path_).st_gid, 65534u);
  }
  // Through a link: the file it names keeps its mode.
  const std::string target = dir_ + "/target.pt", link = dir_ + "/link.pt";
  std::ofstream(target) << "old";
  ASSERT_EQ(::chmod(target.c_str(), 0640), 0);
  std::filesystem::create_symlink("target.pt", link);
  EXPECT_EQ(save_error(link), "");
  EXPECT_EQ(status_of(target).st_mode & 07777, 0640u);
  expect_only({"ckpt.pt", "link.pt", "target.pt"});
}

// A link another user owns, in a sticky directory (as /tmp) or in theirs, is not followed (issue
// 39: another user's link in /tmp made a root run overwrite root's 0600 file with a checkpoint
// everyone could read, where fs.protected_symlinks=0). The same link of our own is followed.
TEST_F(SaveTarget, AnotherUsersLinkInASharedOrForeignDirectoryIsNotFollowed) {
  if (::geteuid() != 0) GTEST_SKIP() << "a link of another user needs root (lchown)";
  const std::string mine = dir_ + "/mine.pt";
  std::ofstream(mine) << "root's own";
  ASSERT_EQ(::chmod(mine.c_str(), 0600), 0);
  auto foreign_link_in = [&](const std::string& directory, mode_t mode) {
    std::filesystem::create_directory(directory);
    EXPECT_EQ(::chmod(directory.c_str(), mode), 0);
    const std::string link = directory + "/model.checkpoint";
    std::filesystem::create_symlink(mine, link);
    EXPECT_EQ(::lchown(link.c_str(), 65534, 65534), 0);
    return link;
  };
  auto refusal = [&](const std::string& link, const std::string& directory, const std::string& kind) {
    return "cannot save checkpoint " + link + ": cannot write " + link + ": it is a symbolic link to " + mine +
           ", owned by another user (uid 65534) in " + directory + ", a directory " + kind +
           ": a save does not follow it (as the kernel's protected_symlinks would not), or that user would choose "
           "which file it replaces; save to the file it names, or remove the link";
  };
  const std::string shared = dir_ + "/shared";
  const std::string in_shared = foreign_link_in(shared, 01777);
  EXPECT_EQ(save_error(in_shared), refusal(in_shared, shared, "others may write into (sticky, as /tmp)"));
  const std::string theirs = dir_ + "/theirs";
  const std::string in_theirs = foreign_link_in(theirs, 0755);
  ASSERT_EQ(::chown(theirs.c_str(), 65534, 65534), 0);
  EXPECT_EQ(save_error(in_theirs), refusal(in_theirs, theirs, "of uid 65534"));
  EXPECT_TRUE(text_of(mine) == "root's own") << "the file the links name was replaced";
  EXPECT_EQ(status_of(mine).st_mode & 07777, 0600u);
  // Our own link in the shared directory is ours to follow.
  const std::string own_link = shared + "/own.checkpoint";
  std::filesystem::create_symlink(mine, own_link);
  EXPECT_EQ(save_error(own_link), "");
  EXPECT_FALSE(text_of(mine) == "root's own") << "our own link was not followed";
}

}  // namespace
#endif
