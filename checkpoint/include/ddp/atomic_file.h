#pragma once
// Crash-safe file replacement: the only place with OS-specific file calls.
#include <cstddef>
#include <string>

namespace ddp {

// Writes `data` to `path` so that a crash (kill -9, power loss) at any moment leaves either the
// old file or the complete new one: write a temporary file in the same directory, flush it to
// disk, atomically rename it over `path`, then flush the directory entry. Throws
// std::runtime_error naming the failed step and the OS error.
void write_file_atomically(const std::string& path, const char* data, std::size_t size);

// The name of the temporary file write_file_atomically uses for `path` in this process.
std::string temporary_path_for(const std::string& path);

}  // namespace ddp
