#pragma once
// A raw TCP connection to a launchers' store on loopback, for a client that does what no
// launcher does: speaks out of turn, stalls, floods, never reads.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>

namespace launch_test {

struct Stranger {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  bool connected = false;

  explicit Stranger(int port) {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    address.sin_port = htons(static_cast<uint16_t>(port));
    connected = connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  }
  ~Stranger() { close(fd); }
  Stranger(const Stranger&) = delete;
  Stranger& operator=(const Stranger&) = delete;

  void send_text(const std::string& text) { (void)!send(fd, text.data(), text.size(), MSG_NOSIGNAL); }

  // One line without its '\n'; "" when the store closed the connection or was silent for `timeout`.
  std::string line(std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
    std::string text;
    char c;
    pollfd p{fd, POLLIN, 0};
    while (poll(&p, 1, static_cast<int>(timeout.count())) > 0 && recv(fd, &c, 1, 0) == 1 && c != '\n') text += c;
    return text;
  }

  // True when the store closed the connection within `timeout` (what it sent first is read away).
  bool closed_by_store(std::chrono::milliseconds timeout) {
    const auto end = std::chrono::steady_clock::now() + timeout;
    char buffer[65536];
    while (std::chrono::steady_clock::now() < end) {
      pollfd p{fd, POLLIN, 0};
      if (poll(&p, 1, 100) > 0 && recv(fd, buffer, sizeof(buffer), 0) <= 0) return true;
    }
    return false;
  }
};

}  // namespace launch_test
