#include "store.h"

#include <arpa/inet.h>
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
#include <iostream>

#include "process.h"
#include "secret.h"

namespace ddprun {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kMaxPendingReplies = 64 * 1024;             // bytes queued for one client
constexpr size_t kMaxHandshakes = 64;                        // connections not yet trusted
constexpr int kRefusalsShown = 5;
constexpr size_t kNonceBytes = 16;
const char* const kGreeting = "DDPRUN-STORE 1 ";

std::string client_proof(const std::string& token, const std::string& store_nonce, const std::string& client_nonce) {
  return hmac_hex(token, "ddprun client " + store_nonce + " " + client_nonce);
}
std::string store_proof(const std::string& token, const std::string& store_nonce, const std::string& client_nonce) {
  return hmac_hex(token, "ddprun store " + store_nonce + " " + client_nonce);
}

void write_all(int fd, const std::string& data) {
  for (size_t sent = 0; sent < data.size();) {
    const ssize_t n = send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw std::runtime_error(std::string("store connection lost: ") + strerror(errno));
    sent += static_cast<size_t>(n);
  }
}

std::string peer_name(int fd) {
  sockaddr_storage address{};
  socklen_t size = sizeof(address);
  char host[NI_MAXHOST] = "?", port[NI_MAXSERV] = "?";
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&address), &size) == 0) {
    getnameinfo(reinterpret_cast<sockaddr*>(&address), size, host, sizeof(host), port, sizeof(port),
                NI_NUMERICHOST | NI_NUMERICSERV);
  }
  return std::string(host) + ":" + port;
}

}  // namespace

struct StoreServer::Connection {
  enum class Phase { kChallenged, kTrusted, kRefused };  // kRefused: closed once its reply is out
  int fd = -1;
  std::string peer;  // for messages
  Phase phase = Phase::kChallenged;
  std::string nonce;  // ours, sent in the greeting
  LineReader in;
  std::string out;  // replies not sent yet
  Clock::time_point deadline;  // challenged: the handshake's end; with replies pending: their reading's
};

StoreServer::StoreServer(const std::string& address, int port, std::string token, StoreLimits limits)
    : token_(std::move(token)), limits_(limits) {
  listen_fd_ = listen_at(address, port, 64);
  if (listen_fd_ < 0) {
    throw std::runtime_error("cannot listen on " + (address.empty() ? std::string("every address") : address) +
                             " port " + std::to_string(port) + ": " + strerror(errno));
  }
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

// A new connection is greeted with a fresh nonce. Connections that have not proved the token are
// bounded: the oldest makes room, so a flood of strangers cannot keep a launcher out for long.
void StoreServer::accept_one(std::vector<Connection>& connections) {
  const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (fd < 0) return;
  const auto challenged = [](const Connection& c) { return c.phase == Connection::Phase::kChallenged && c.fd >= 0; };
  if (static_cast<size_t>(std::count_if(connections.begin(), connections.end(), challenged)) >= kMaxHandshakes) {
    auto oldest = std::find_if(connections.begin(), connections.end(), challenged);
    close(oldest->fd);
    oldest->fd = -1;
  }
  Connection c;
  c.fd = fd;
  c.peer = peer_name(fd);
  c.nonce = random_hex(kNonceBytes);
  c.out = kGreeting + c.nonce + "\n";
  c.deadline = Clock::now() + limits_.handshake;
  connections.push_back(std::move(c));
}

std::string StoreServer::respond(Connection& c, const std::string& line) {
  if (c.phase == Connection::Phase::kTrusted) return table_.apply(line);
  // "AUTH <client nonce> <proof>": the only line a connection may send before it is trusted.
  const size_t first = line.find(' '), second = line.find(' ', first + 1);
  const std::string nonce = second == std::string::npos ? "" : line.substr(first + 1, second - first - 1);
  const std::string proof = second == std::string::npos ? "" : line.substr(second + 1);
  if (line.compare(0, 5, "AUTH ") == 0 && nonce.size() == 2 * kNonceBytes &&
      same_secret(proof, client_proof(token_, c.nonce, nonce))) {
    c.phase = Connection::Phase::kTrusted;
    return "WELCOME " + store_proof(token_, c.nonce, nonce);
  }
  c.phase = Connection::Phase::kRefused;
  if (refusals_shown_ < kRefusalsShown) {
    std::cerr << "ddprun: the launchers' store refused a connection from " + c.peer +
                     ": it did not prove it knows this job's rendezvous token" +
                     (++refusals_shown_ == kRefusalsShown ? " (further refusals are not shown)\n" : "\n");
  }
  return "DENIED this store serves one ddprun job: the connection did not prove it knows the job's rendezvous token";
}

// Answers the lines already received, as long as the replies waiting to go out stay small.
void StoreServer::answer_buffered(Connection& c) {
  while (c.out.size() < kMaxPendingReplies && c.phase != Connection::Phase::kRefused) {
    auto line = c.in.next();
    if (!line) break;
    if (c.out.empty()) c.deadline = Clock::now() + limits_.reply;
    c.out += respond(c, *line) + "\n";
  }
}

bool StoreServer::receive(Connection& c) {
  char buffer[4096];
  const ssize_t n = recv(c.fd, buffer, sizeof(buffer), 0);
  if (n < 0) return errno == EAGAIN || errno == EINTR;
  if (n == 0) return false;
  c.in.append(buffer, static_cast<size_t>(n));
  answer_buffered(c);
  return !c.in.too_long() && send_pending(c);
}

bool StoreServer::send_pending(Connection& c) {
  while (!c.out.empty()) {
    const ssize_t n = send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
    if (n < 0) return errno == EAGAIN || errno == EINTR;
    c.out.erase(0, static_cast<size_t>(n));
    if (c.out.empty()) answer_buffered(c);  // requests that waited for room
  }
  if (c.phase == Connection::Phase::kTrusted) c.deadline = Clock::time_point::max();
  return c.phase != Connection::Phase::kRefused;
}

void StoreServer::serve() {
  std::vector<Connection> connections;
  while (true) {
    // A client with replies pending is not read until it took them: its requests wait in the kernel.
    std::vector<pollfd> fds{{stop_pipe_[0], POLLIN, 0}, {listen_fd_, POLLIN, 0}};
    auto next_deadline = Clock::now() + std::chrono::seconds(1);
    for (const auto& c : connections) {
      fds.push_back({c.fd, static_cast<short>(c.out.empty() ? POLLIN : POLLOUT), 0});
      next_deadline = std::min(next_deadline, c.deadline);
    }
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next_deadline - Clock::now()).count();
    if (poll(fds.data(), fds.size(), static_cast<int>(std::max<long long>(wait, 0) + 1)) < 0 && errno != EINTR) break;
    if (fds[0].revents != 0) break;
    const auto now = Clock::now();
    for (size_t i = 2; i < fds.size(); ++i) {
      Connection& c = connections[i - 2];
      bool keep = c.fd >= 0;
      if (keep && (fds[i].revents & (POLLOUT | POLLERR | POLLHUP))) keep = send_pending(c);
      if (keep && (fds[i].revents & POLLIN)) keep = receive(c);
      if (keep && now >= c.deadline) keep = false;  // handshake or reply reading took too long
      if (!keep && c.fd >= 0) close(c.fd);
      if (!keep) c.fd = -1;
    }
    if (fds[1].revents & POLLIN) accept_one(connections);
    connections.erase(std::remove_if(connections.begin(), connections.end(), [](const Connection& c) { return c.fd < 0; }),
                      connections.end());
  }
  for (const auto& c : connections) close(c.fd);
}

StoreClient::StoreClient(const std::string& host, int port, std::string token, std::chrono::milliseconds timeout,
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
    if (fd_ >= 0) {
      try {
        handshake(token);
        return;
      } catch (const std::exception& error) {
        close(fd_);  // no destructor runs for a constructor that throws
        fd_ = -1;
        if (dynamic_cast<const StoreTrustError*>(&error) != nullptr) throw;
        last_error = error.what();  // dropped before trusted (the store was busy): retry
        in_ = LineReader();
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // node 0 not up yet: retry
  }
  throw std::runtime_error(last_error);
}

StoreClient::~StoreClient() {
  if (fd_ >= 0) close(fd_);
}

void StoreClient::handshake(const std::string& token) {
  const std::string greeting = read_line();
  if (greeting.rfind(kGreeting, 0) != 0 || greeting.size() != std::strlen(kGreeting) + 2 * kNonceBytes) {
    throw StoreTrustError("is not a ddprun store (it greeted with '" + greeting.substr(0, 80) + "')");
  }
  const std::string store_nonce = greeting.substr(std::strlen(kGreeting));
  const std::string nonce = random_hex(kNonceBytes);
  const std::string reply = request("AUTH " + nonce + " " + client_proof(token, store_nonce, nonce));
  if (reply.rfind("DENIED", 0) == 0) {
    throw StoreTrustError("refused this node's rendezvous token: every node of a job must be given the same one "
                          "(DDPRUN_RDZV_TOKEN or --rdzv-token-file)");
  }
  if (reply.rfind("WELCOME ", 0) != 0 || !same_secret(reply.substr(8), store_proof(token, store_nonce, nonce))) {
    throw StoreTrustError("did not prove it knows this job's rendezvous token: is it node 0's ddprun of this job, "
                          "started with the same token?");
  }
}

std::string StoreClient::read_line() {
  const auto deadline = Clock::now() + timeout_;
  while (true) {
    if (auto line = in_.next()) return *line;
    if (in_.too_long()) throw std::runtime_error("the store sent a line too long to be a reply");
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) throw std::runtime_error("store did not answer within the timeout");
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left)) <= 0) continue;
    char chunk[4096];
    const ssize_t n = recv(fd_, chunk, sizeof(chunk), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw std::runtime_error("store connection lost");
    in_.append(chunk, static_cast<size_t>(n));
  }
}

std::string StoreClient::request(const std::string& line) {
  write_all(fd_, line + "\n");
  return read_line();
}

void StoreClient::set(const std::string& key, const std::string& value) {
  std::string line = "SET " + key + " " + value;
  line.resize(std::min(line.size(), kMaxStoreLine));
  std::replace(line.begin(), line.end(), '\n', ' ');
  std::replace(line.begin(), line.end(), '\r', ' ');
  request(line);
}

std::optional<std::string> StoreClient::get(const std::string& key) {
  const std::string reply = request("GET " + key);
  if (reply.rfind("VALUE ", 0) == 0) return reply.substr(6);
  return std::nullopt;
}

long long StoreClient::add(const std::string& key, long long amount) {
  const std::string reply = request("ADD " + key + " " + std::to_string(amount));
  if (auto number = parse_number(reply, -kMaxStoreNumber, kMaxStoreNumber)) return *number;
  throw std::runtime_error("bad store reply '" + reply.substr(0, 200) + "'");
}

}  // namespace ddprun
