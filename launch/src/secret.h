#pragma once
// The job's rendezvous token and what proves it: every launcher of a multi-node job holds the same
// secret token, and a connection to node 0's store is trusted only after each side showed it
// knows the token without sending it (an HMAC-SHA256 over both sides' fresh nonces).
#include <string>

namespace ddprun {

struct Options;

// `bytes` random bytes from the system's generator, as lowercase hex.
std::string random_hex(size_t bytes);

// HMAC-SHA256 of `message` under `key`, as lowercase hex.
std::string hmac_hex(const std::string& key, const std::string& message);

// Compares two strings in time that does not depend on where they differ.
bool same_secret(const std::string& a, const std::string& b);

// The token of this job, from (first found) --rdzv-token-file, DDPRUN_RDZV_TOKEN, or one line on
// stdin (--rdzv-token-stdin: a node launcher of `ddprun -H`). Without one, node 0 and the -H
// coordinator make one (node 0 prints it for the other nodes), and any other node is refused.
// Throws UsageError for a token file others can read, a token shorter than 16 characters, or no token.
// DDPRUN_RDZV_TOKEN is removed from the environment, so the ranks do not inherit it.
std::string job_token(const Options& options);

}  // namespace ddprun
