#include "signals.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>
#include <csignal>
#include <initializer_list>
#include <thread>

namespace ddprun {
namespace {

int wake_pipe[2] = {-1, -1};
volatile std::sig_atomic_t requested_stop = 0;

void on_signal(int signal) {
  const int saved = errno;  // a handler must not clobber errno of the interrupted code
  if (signal != SIGCHLD) requested_stop = signal;
  const char byte = 0;
  (void)!write(wake_pipe[1], &byte, 1);
  errno = saved;
}

}  // namespace

void install_signal_handlers() {
  if (wake_pipe[0] >= 0) return;
  // Without them Ctrl-C would kill ddprun and orphan its ranks: failing to install is fatal.
  if (pipe2(wake_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    throw std::runtime_error(std::string("cannot create the signal wake-up pipe: ") + std::strerror(errno));
  }
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  for (int s : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) {
    if (sigaction(s, &action, nullptr) != 0) {
      throw std::runtime_error(std::string("cannot install the handler of signal ") + std::to_string(s) + ": " +
                               std::strerror(errno));
    }
  }
  signal(SIGPIPE, SIG_IGN);  // a closed console must not kill the launcher before it cleans up
}

int wake_fd() { return wake_pipe[0]; }

void drain_wakeups() {
  char buffer[64];
  while (read(wake_pipe[0], buffer, sizeof(buffer)) > 0) {
  }
}

int stop_signal() { return requested_stop; }

void hang_up_when_stdin_closes(const std::string& who) {
  const std::string notice = "ddprun: " + who + ": stdin closed (the ddprun -H that started this node is stopping "
                             "the job); stopping as on SIGHUP\n";
  std::thread([notice] {
    char buffer[256];
    ssize_t n;
    while ((n = read(STDIN_FILENO, buffer, sizeof(buffer))) > 0 || (n < 0 && errno == EINTR)) {
    }
    (void)!write(STDERR_FILENO, notice.data(), notice.size());  // one line, one write
    kill(getpid(), SIGHUP);  // the handler above turns it into a stop request and a wake-up
  }).detach();
}

}  // namespace ddprun
