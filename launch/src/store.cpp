#include "store.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "process.h"

namespace ddprun {
namespace {

using Clock = std::chrono::steady_clock;

void write_all(int fd, const std::string& data) {
  for (size_t sent = 0; sent < data.size();) {
    const ssize_t n = send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw std::runtime_error(std::string("store connection lost: ") + strerror(errno));
    sent += static_cast<size_t>(n);
  }
}

int listen_on(int port) {
  const int fd = listen_any(port, 64);
  if (fd < 0) throw std::runtime_error("cannot listen on port " + std::to_string(port) + ": " + strerror(errno));
  return fd;
}

}  // namespace

StoreServer::StoreServer(int port) {
  listen_fd_ = listen_on(port);
  if (pipe2(stop_pipe_, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
  thread_ = std::thread([this] { serve(); });
}

StoreServer::~StoreServer() {
  (void)!write(stop_pipe_[1], "x", 1);
  if (thread_.joinable()) thread_.join();
  close(listen_fd_);
  close(stop_pipe_[0]);
  close(stop_pipe_[1]);
}

std::string StoreServer::handle(const std::string& request) {
  const auto space = request.find(' ');
  const std::string command = request.substr(0, space);
  const std::string rest = space == std::string::npos ? "" : request.substr(space + 1);
  const auto key_end = rest.find(' ');
  const std::string key = rest.substr(0, key_end);
  const std::string value = key_end == std::string::npos ? "" : rest.substr(key_end + 1);
  if (command == "SET") {
    data_[key] = value;
    return "OK";
  }
  if (command == "GET") {
    auto it = data_.find(key);
    return it == data_.end() ? "NONE" : "VALUE " + it->second;
  }
  if (command == "ADD") {
    long current = 0;
    if (auto it = data_.find(key); it != data_.end()) current = std::stol(it->second);
    current += std::stol(value);
    data_[key] = std::to_string(current);
    return std::to_string(current);
  }
  return "ERROR unknown command";
}

void StoreServer::serve() {
  struct Connection {
    int fd;
    std::string pending;
  };
  std::vector<Connection> connections;
  while (true) {
    std::vector<pollfd> fds{{stop_pipe_[0], POLLIN, 0}, {listen_fd_, POLLIN, 0}};
    for (const auto& c : connections) fds.push_back({c.fd, POLLIN, 0});
    if (poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (fds[0].revents != 0) break;
    if (fds[1].revents & POLLIN) {
      const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) connections.push_back({fd, {}});
    }
    for (size_t i = 2; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      Connection& c = connections[i - 2];
      char buffer[4096];
      const ssize_t n = recv(c.fd, buffer, sizeof(buffer), 0);
      bool alive = n > 0;
      if (alive) c.pending.append(buffer, static_cast<size_t>(n));
      for (size_t newline; alive && (newline = c.pending.find('\n')) != std::string::npos;) {
        const std::string line = c.pending.substr(0, newline);
        c.pending.erase(0, newline + 1);
        try {
          write_all(c.fd, handle(line) + "\n");
        } catch (const std::exception&) {
          alive = false;
        }
      }
      if (!alive) {
        close(c.fd);
        c.fd = -1;
      }
    }
    connections.erase(std::remove_if(connections.begin(), connections.end(), [](const Connection& c) { return c.fd < 0; }),
                      connections.end());
  }
  for (const auto& c : connections) close(c.fd);
}

StoreClient::StoreClient(const std::string& host, int port, std::chrono::milliseconds timeout,
                         bool (*stop_requested)())
    : timeout_(timeout) {
  const auto deadline = Clock::now() + timeout;
  std::string last_error = "timed out";
  while (Clock::now() < deadline && !stop_requested()) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    const int resolved = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
    if (resolved != 0) {
      last_error = gai_strerror(resolved);
    } else {
      for (addrinfo* a = found; a != nullptr && fd_ < 0; a = a->ai_next) {
        const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
          int one = 1;
          setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
          fd_ = fd;
        } else {
          last_error = strerror(errno);
          close(fd);
        }
      }
      freeaddrinfo(found);
    }
    if (fd_ >= 0) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // node 0 not up yet: retry
  }
  throw std::runtime_error(last_error);
}

StoreClient::~StoreClient() {
  if (fd_ >= 0) close(fd_);
}

std::string StoreClient::request(const std::string& line) {
  write_all(fd_, line + "\n");
  const auto deadline = Clock::now() + timeout_;
  while (true) {
    if (const auto newline = buffer_.find('\n'); newline != std::string::npos) {
      std::string reply = buffer_.substr(0, newline);
      buffer_.erase(0, newline + 1);
      return reply;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) throw std::runtime_error("store did not answer within the timeout");
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left)) <= 0) continue;
    char chunk[4096];
    const ssize_t n = recv(fd_, chunk, sizeof(chunk), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw std::runtime_error("store connection lost");
    buffer_.append(chunk, static_cast<size_t>(n));
  }
}

void StoreClient::set(const std::string& key, const std::string& value) {
  std::string flat = value;
  for (char& c : flat) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  request("SET " + key + " " + flat);
}

std::optional<std::string> StoreClient::get(const std::string& key) {
  const std::string reply = request("GET " + key);
  if (reply.rfind("VALUE ", 0) == 0) return reply.substr(6);
  if (reply.rfind("VALUE", 0) == 0) return std::string();
  return std::nullopt;
}

long StoreClient::add(const std::string& key, long amount) {
  const std::string reply = request("ADD " + key + " " + std::to_string(amount));
  try {
    return std::stol(reply);
  } catch (const std::exception&) {
    throw std::runtime_error("bad store reply '" + reply + "'");
  }
}

}  // namespace ddprun
