#pragma once
// One POSIX shared-memory object, mapped into this process: the building block of the
// shared-memory collectives (communicator.h). A rank creates its own segment with create(),
// maps each peer's with open(), and removes its name with unlink() as soon as every peer has
// mapped it, so that nothing is left in /dev/shm whatever happens to the processes afterwards
// (the memory itself lives until the last mapping goes away).
//
// Thread-safety: a Segment is a plain value; use one from one thread at a time. Its memory may
// be shared by any number of threads and processes (the callers order their accesses).
#include <cstddef>
#include <stdexcept>
#include <string>

namespace ddp::detail::shm {

// Shared memory cannot be used here: the object could not be created, opened or mapped, a
// peer could not, or the ranks could not agree (peers.h: agree). Callers fall back to another
// transport for the whole group.
class ShmUnavailable : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Segment {
 public:
  // Creates the object `name` ("/something": one leading slash, no other, at most 255
  // characters) with mode 0600, exclusively (an object of that name already existing is an
  // error: a stale segment of an earlier job, or two jobs with one run id), sizes it to `bytes`
  // with its pages allocated now (so a full /dev/shm is an error here, not a SIGBUS later), and
  // maps it read-write. The new memory is zero. Throws ShmUnavailable naming the object and the
  // system's reason. The segment owns the name until unlink() or destruction.
  static Segment create(const std::string& name, std::size_t bytes);

  // Maps the existing object `name` created by another process, which must be what create()
  // makes: owned by this process's user, mode 0600, at least `bytes` long. Does not own the name.
  // Throws ShmUnavailable naming the object and the reason.
  static Segment open(const std::string& name, std::size_t bytes);

  Segment() noexcept = default;
  Segment(Segment&& other) noexcept;
  Segment& operator=(Segment&& other) noexcept;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  // Unmaps; removes the name too if this segment created it and still owns it.
  ~Segment();

  // Removes the name if this segment owns it (a no-op otherwise): the memory stays mapped and
  // usable here and in every process that mapped it. Throws ShmUnavailable if the system
  // refuses (the name then stays owned, and the destructor tries again).
  void unlink();

  void* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  const std::string& name() const noexcept { return name_; }
  bool owns_name() const noexcept { return owns_name_; }

 private:
  void release() noexcept;

  std::string name_;
  void* data_ = nullptr;
  std::size_t size_ = 0;
  bool owns_name_ = false;
};

}  // namespace ddp::detail::shm
