#pragma once
// `ddprun -H host1:2,host2:2 ./train`: this ddprun coordinates a multi-node job from one command.
// It starts one node launcher per host, exactly the command a user would type there by hand,
//   ddprun --nnodes N --node-rank k --nproc-per-node SLOTS --master-addr A --master-port P ... ./train
// (so the nodes meet through the usual rendezvous, rendezvous.h): over ssh for other hosts,
// directly for its own. It relays their output line by line (the node launchers already prefix
// their ranks' lines) and, when one node launcher fails or a signal arrives, stops all of them.
//
// How a node launcher is stopped: it runs with --stop-when-stdin-closes and its stdin is a pipe
// from here (through ssh for another host). Closing the pipe, ssh losing the connection, or this
// process dying all reach it as EOF; it then stops its ranks as on SIGHUP and exits. Node
// launchers still running after twice the grace period (+10 s) are killed: for ssh that closes
// the connection, which the remote launcher again sees as EOF.
namespace ddprun {

struct Options;

// Returns ddprun's exit code: 0 every node succeeded, 1 a node failed (the report names its host),
// 128+N stopped by signal N. Throws UsageError, with nothing started, when ssh is needed but missing.
int run_on_hosts(const Options& options);

}  // namespace ddprun
