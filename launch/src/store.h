#pragma once
// A tiny key-value store over TCP for the launchers' rendezvous (node 0 hosts it). It replaces
// c10d::TCPStore so that ddprun does not link libtorch: loading libtorch costs ~0.4 s of static
// initialisation, paid before the first rank could even start.
//
// Protocol, one request line and one reply line each ('\n'-terminated; keys have no spaces,
// values no newlines):  SET key value -> OK | GET key -> VALUE value / NONE | ADD key n -> number
#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <thread>

namespace ddprun {

class StoreServer {
 public:
  // Listens on every address on `port`; throws std::runtime_error when it cannot (port in use).
  explicit StoreServer(int port);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

 private:
  void serve();
  std::string handle(const std::string& request);

  int listen_fd_ = -1;
  int stop_pipe_[2] = {-1, -1};
  std::map<std::string, std::string> data_;  // only touched by the serving thread
  std::thread thread_;
};

class StoreClient {
 public:
  // Connects, retrying until `timeout` passes or stop_requested() says so; throws on failure.
  StoreClient(const std::string& host, int port, std::chrono::milliseconds timeout, bool (*stop_requested)());
  ~StoreClient();
  StoreClient(const StoreClient&) = delete;
  StoreClient& operator=(const StoreClient&) = delete;

  // Each throws std::runtime_error if the server is gone or does not answer within the timeout.
  void set(const std::string& key, const std::string& value);
  std::optional<std::string> get(const std::string& key);
  long add(const std::string& key, long amount);

 private:
  std::string request(const std::string& line);

  int fd_ = -1;
  std::chrono::milliseconds timeout_;
  std::string buffer_;
};

}  // namespace ddprun
