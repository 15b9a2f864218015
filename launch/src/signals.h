#pragma once
// Turns asynchronous signals (Ctrl-C, SIGTERM, SIGHUP, a child exiting) into something the
// supervision loop can poll(): a self-pipe that becomes readable, plus the last stop request.
namespace ddprun {

// Installs the handlers once. Afterwards wake_fd() becomes readable on every signal. Throws
// std::runtime_error (saying what failed) when the pipe or a handler cannot be set up.
void install_signal_handlers();
int wake_fd();
// Empties the wake pipe (call after poll() said it is readable).
void drain_wakeups();
// SIGINT/SIGTERM/SIGHUP received so far (the latest one), 0 if none.
int stop_signal();

}  // namespace ddprun
