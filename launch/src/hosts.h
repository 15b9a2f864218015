#pragma once
// The hosts of `ddprun -H host1:2,host2:2` (Horovod's and mpirun's syntax) or `--hostfile FILE`:
// which machines take part, in node-rank order, and how many ranks ("slots") each runs.
#include <string>
#include <vector>

namespace ddprun {

struct Host {
  std::string name;  // as given: what ssh connects to: a name or an IPv4 address (a user goes in ssh's config)
  int slots = 1;     // ranks on this host (--nproc-per-node of its node launcher)
};

// "host1:2,host2:2"; a host without ":N" gets 1 slot. Throws UsageError naming the bad entry.
std::vector<Host> parse_host_list(const std::string& list);

// A hostfile: one host per line, "host slots=N" or just "host"; '#' starts a comment.
// Throws UsageError naming the file and line.
std::vector<Host> read_hostfile(const std::string& path);

// Whether `name` is this machine (its node launcher is started directly, not over ssh): it is
// "localhost", this machine's host name, or resolves to a loopback address or to an address of
// one of this machine's interfaces.
bool is_this_host(const std::string& name);

// Whether `name` resolves only to loopback addresses (other hosts could not reach it there).
bool is_loopback(const std::string& name);

// Whether `name` is an IPv4 or IPv6 address written out, not a host name.
bool is_address_literal(const std::string& name);

}  // namespace ddprun
