#pragma once
// A tiny key-value store over TCP for the launchers' rendezvous (node 0 hosts it). It replaces
// c10d::TCPStore so that ddprun does not link libtorch: loading libtorch costs ~0.4 s of static
// initialisation, paid before the first rank could even start.
//
// Unlike TCPStore it trusts nobody by default. Each connection starts with a handshake in which
// both sides show they know the job's token (secret.h) without sending it:
//   store  -> DDPRUN-STORE 1 <store nonce>
//   client -> AUTH <client nonce> <HMAC(token, "ddprun client <store nonce> <client nonce>")>
//   store  -> WELCOME <HMAC(token, "ddprun store <store nonce> <client nonce>")> | DENIED <why>
// then requests and replies as store_protocol.h says. The store thread never blocks on one client:
// a connection that does not finish the handshake in time, sends a line longer than
// kMaxStoreLine, or leaves its replies unread is dropped, not waited for.
#include <chrono>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "store_protocol.h"

namespace ddprun {

// The other side of a store connection does not know the job's token (or is no ddprun store); the
// message is a predicate for "the store at <address>": "refused this node's rendezvous token: ...".
struct StoreTrustError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// How long the store waits for one client before dropping it.
struct StoreLimits {
  std::chrono::milliseconds handshake{5000};  // from accepting to AUTH (a launcher needs one round trip)
  std::chrono::milliseconds reply{10000};     // for a reply to be read (a launcher reads each at once)
};

class StoreServer {
 public:
  // Listens on `address` (every interface when empty) at `port`; throws std::runtime_error when it
  // cannot (port in use, not an address of this host).
  StoreServer(const std::string& address, int port, std::string token, StoreLimits limits = {});
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

 private:
  struct Connection;
  void serve();
  void accept_one(std::vector<Connection>& connections);
  bool receive(Connection& c);
  bool send_pending(Connection& c);
  void answer_buffered(Connection& c);
  std::string respond(Connection& c, const std::string& line);

  std::string token_;
  StoreLimits limits_;
  int listen_fd_ = -1;
  int stop_pipe_[2] = {-1, -1};
  StoreTable table_;        // only touched by the serving thread
  int refusals_shown_ = 0;  // only touched by the serving thread
  std::thread thread_;
};

class StoreClient {
 public:
  // Connects and completes the handshake, retrying until `timeout` passes or stop_requested()
  // says so; throws StoreTrustError when the store refuses `token` or cannot prove it knows it,
  // std::runtime_error when nothing answered in time.
  StoreClient(const std::string& host, int port, std::string token, std::chrono::milliseconds timeout,
              bool (*stop_requested)());
  ~StoreClient();
  StoreClient(const StoreClient&) = delete;
  StoreClient& operator=(const StoreClient&) = delete;

  // Each throws std::runtime_error if the server is gone or does not answer within the timeout.
  // A value is cut to what fits in one line.
  void set(const std::string& key, const std::string& value);
  std::optional<std::string> get(const std::string& key);
  long long add(const std::string& key, long long amount);

 private:
  void handshake(const std::string& token);
  std::string read_line();
  std::string request(const std::string& line);

  int fd_ = -1;
  std::chrono::milliseconds timeout_;
  LineReader in_;
};

}  // namespace ddprun
