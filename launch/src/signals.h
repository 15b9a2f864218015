#pragma once
// Turns asynchronous signals (Ctrl-C, SIGTERM, SIGHUP, a child exiting) into something the
// supervision loop can poll(): a self-pipe that becomes readable, plus the last stop request.
#include <string>

namespace ddprun {

// Installs the handlers once. Afterwards wake_fd() becomes readable on every signal. Throws
// std::runtime_error (saying what failed) when the pipe or a handler cannot be set up.
void install_signal_handlers();
int wake_fd();
// Empties the wake pipe (call after poll() said it is readable).
void drain_wakeups();
// SIGINT/SIGTERM/SIGHUP received so far (the latest one), 0 if none.
int stop_signal();

// For a node launcher started by `ddprun -H` (over ssh, or directly for its own host): a thread
// reads stdin and, at EOF, raises SIGHUP in this process, so the coordinator closing the pipe
// (or ssh losing the connection, or the coordinator dying) stops this node as a hangup would.
// Says so on stderr first, naming `who`.
void hang_up_when_stdin_closes(const std::string& who);

}  // namespace ddprun
