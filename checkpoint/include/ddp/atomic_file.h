#pragma once
// Crash-safe file replacement: the only place with OS-specific file calls.
//
// Thread-safety: two threads must not write the same path at once; different paths are independent.
#include <cstddef>
#include <string>

namespace ddp {

// Writes `data` to `path` so that a crash (kill -9, power loss) at any moment leaves either the
// old file or the complete new one: write a temporary file in the same directory, flush it to
// disk, atomically rename it over `path`, then flush the directory entry. Throws
// std::runtime_error naming the failed step and the OS error.
// Only a regular file is replaced: `path` holding a directory, FIFO, device node or socket is
// refused ("cannot write <path>: it is a FIFO (named pipe), not a regular file ...") and left as
// it is. A symbolic link is written through, as torch.save does (the link stays, the regular file
// it names is replaced); a link to anything else, or to nothing, is refused, and so is a link
// owned by another user in a sticky directory or one not ours (as the kernel's protected_symlinks
// refuses to follow it): that user would choose the file replaced. A replaced file keeps its mode,
// and its owner and group where this process may set them (root; a user keeps a file's group).
void write_file_atomically(const std::string& path, const char* data, std::size_t size);

// The name of the temporary file write_file_atomically uses for `path` in this process:
// "<dir>/.torchddp-tmp.<pid>.<name of path>", created with O_EXCL.
std::string temporary_path_for(const std::string& path);

// Removes the temporary files in `directory` named as temporary_path_for names them whose writer
// process no longer exists on this machine: what a writer killed during write_file_atomically
// leaves behind. Called by write_file_atomically (so every save cleans its directory); returns
// how many it removed. Only regular files of this user are removed: files of live processes, of
// other users, and every file named otherwise ("notes.tmp.123") are left alone. A directory shared
// between machines must not have two machines writing into it at once (a pid is only checked on
// this machine). On Windows nothing is removed.
int remove_orphaned_temporaries(const std::string& directory);

}  // namespace ddp
