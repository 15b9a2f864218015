// The launchers' store alone (launch/src/store.h, store_protocol.h, secret.h): its parser and
// limits, and its handshake against clients that lie, stall or never read. ddprun end to end
// against the same attacks: test_launch.cpp (LaunchStore).
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "secret.h"
#include "store.h"
#include "store_protocol.h"
#include "stranger.h"

namespace {

using namespace std::chrono_literals;
using ddprun::LineReader;
using ddprun::parse_number;
using ddprun::StoreTable;
using launch_test::Stranger;

const std::string kToken = "0123456789abcdef-store-test";

bool never() { return false; }

// A free port on loopback, kept by nobody.
int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t size = sizeof(address);
  bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &size);
  close(fd);
  return ntohs(address.sin_port);
}

// Proves the token on a raw connection as a launcher would.
void authenticate(Stranger& client, const std::string& token) {
  const std::string greeting = client.line();
  ASSERT_EQ(greeting.rfind("DDPRUN-STORE 1 ", 0), 0u) << greeting;
  const std::string store_nonce = greeting.substr(15), nonce(32, 'a');
  client.send_text("AUTH " + nonce + " " + ddprun::hmac_hex(token, "ddprun client " + store_nonce + " " + nonce) + "\n");
  ASSERT_EQ(client.line().rfind("WELCOME ", 0), 0u);
}

TEST(StoreProtocol, HmacIsRfc4231sSha256) {
  // RFC 4231, test case 2.
  EXPECT_EQ(ddprun::hmac_hex("Jefe", "what do ya want for nothing?"),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  EXPECT_TRUE(ddprun::same_secret("abc", "abc"));
  EXPECT_FALSE(ddprun::same_secret("abc", "abd"));
  EXPECT_FALSE(ddprun::same_secret("abc", "abcd"));
  EXPECT_EQ(ddprun::random_hex(16).size(), 32u);
  EXPECT_NE(ddprun::random_hex(16), ddprun::random_hex(16));
}

TEST(StoreProtocol, NumbersAreWholeAndInRange) {
  EXPECT_EQ(parse_number("12", 1, 1024), 12);
  EXPECT_EQ(parse_number("-5", -10, 10), -5);
  for (const char* bad : {"", "abc", "1x", " 1", "+1", "1.5", "0", "-1", "1025", "99999999999999999999"}) {
    EXPECT_FALSE(parse_number(bad, 1, 1024)) << "'" << bad << "'";
  }
}

TEST(StoreProtocol, LinesArriveWholeHoweverTheBytesAreCut) {
  LineReader reader;
  const std::string stream = "SET a 1\nGET a\n\nADD n 5\n";
  for (char c : stream) reader.append(&c, 1);
  std::vector<std::string> lines;
  while (auto line = reader.next()) lines.push_back(*line);
  EXPECT_EQ(lines, (std::vector<std::string>{"SET a 1", "GET a", "", "ADD n 5"}));
  EXPECT_FALSE(reader.too_long());
}

TEST(StoreProtocol, ALineLongerThanTheLimitMarksTheStreamBad) {
  LineReader reader;
  const std::string chunk(1000, 'x');
  for (int i = 0; i < 4 && !reader.too_long(); ++i) {
    reader.append(chunk.data(), chunk.size());
    EXPECT_FALSE(reader.next());
  }
  EXPECT_FALSE(reader.too_long()) << "4000 bytes are within the limit";
  reader.append(chunk.data(), chunk.size());
  EXPECT_FALSE(reader.next());
  EXPECT_TRUE(reader.too_long());
  reader.append("\n", 1);
  EXPECT_FALSE(reader.next()) << "a bad stream stays bad";

  LineReader whole;  // the same, arriving at once with its newline
  const std::string line = std::string(ddprun::kMaxStoreLine + 1, 'y') + "\n";
  whole.append(line.data(), line.size());
  EXPECT_FALSE(whole.next());
  EXPECT_TRUE(whole.too_long());
}

TEST(StoreProtocol, TableAnswersAndRefusesBadNumbers) {
  StoreTable table;
  EXPECT_EQ(table.apply("GET k"), "NONE");
  EXPECT_EQ(table.apply("SET k some value"), "OK");
  EXPECT_EQ(table.apply("GET k"), "VALUE some value");
  EXPECT_EQ(table.apply("ADD n 2"), "2");
  EXPECT_EQ(table.apply("ADD n -5"), "-3");
  EXPECT_EQ(table.apply("ADD n abc"), "ERROR ADD needs a whole number within +-1e12");
  EXPECT_EQ(table.apply("ADD n 99999999999999999999"), "ERROR ADD needs a whole number within +-1e12");
  EXPECT_EQ(table.apply("ADD k 1"), "ERROR the key's value is not a number");
  EXPECT_EQ(table.apply("SET big 1000000000000"), "OK");
  EXPECT_EQ(table.apply("ADD big 1"), "ERROR the sum would leave +-1e12");
  EXPECT_EQ(table.apply("DEL k"), "ERROR unknown command");
  EXPECT_EQ(table.apply("GET"), "ERROR expected '<command> <key> [value]'");
  EXPECT_EQ(table.apply("GET "), "ERROR empty key");
  EXPECT_EQ(table.apply("ADD n 0"), "-3") << "refused requests change nothing";
}

TEST(StoreServer, LaunchersWithTheTokenShareKeys) {
  const int port = free_port();
  ddprun::StoreServer server("127.0.0.1", port, kToken);
  ddprun::StoreClient a("127.0.0.1", port, kToken, 5s, never), b("127.0.0.1", port, kToken, 5s, never);
  a.set("key", "value with spaces");
  EXPECT_EQ(b.get("key"), "value with spaces");
  EXPECT_EQ(a.add("n", 2), 2);
  EXPECT_EQ(b.add("n", 3), 5);
  EXPECT_FALSE(b.get("missing"));
}

TEST(StoreServer, AWrongTokenIsRefusedEitherWay) {
  const int port = free_port();
  ddprun::StoreServer server("127.0.0.1", port, kToken);
  try {
    ddprun::StoreClient client("127.0.0.1", port, "another-token-0123456789", 5s, never);
    FAIL() << "a client with another token was let in";
  } catch (const ddprun::StoreTrustError& error) {
    EXPECT_NE(std::string(error.what()).find("refused this node's rendezvous token: every node of a job must be "
                                             "given the same one"),
              std::string::npos)
        << error.what();
  }
}

// Something else on the port: it answers once with `greeting`, then welcomes whatever comes.
void expect_untrusted_store(const std::string& greeting, const std::string& message) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t size = sizeof(address);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  listen(listener, 1);
  getsockname(listener, reinterpret_cast<sockaddr*>(&address), &size);
  std::thread fake([&] {
    const int fd = accept(listener, nullptr, nullptr);
    timeval bound{5, 0};  // a client that neither answers nor closes fails the test, not hangs it
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &bound, sizeof(bound));
    const std::string said = greeting + "\n";
    (void)!send(fd, said.data(), said.size(), MSG_NOSIGNAL);
    char c;
    while (recv(fd, &c, 1, 0) == 1 && c != '\n') {
    }
    const std::string welcome = "WELCOME " + std::string(64, '0') + "\n";
    (void)!send(fd, welcome.data(), welcome.size(), MSG_NOSIGNAL);
    std::this_thread::sleep_for(200ms);
    close(fd);
  });
  try {
    ddprun::StoreClient client("127.0.0.1", ntohs(address.sin_port), kToken, 5s, never);
    ADD_FAILURE() << "a store that does not know the token was trusted";
  } catch (const ddprun::StoreTrustError& error) {
    EXPECT_NE(std::string(error.what()).find(message), std::string::npos) << error.what();
  }
  fake.join();
  close(listener);
}

TEST(StoreServer, AStoreIsTrustedOnlyOnceItProvedTheToken) {
  expect_untrusted_store("DDPRUN-STORE 1 " + std::string(32, 'b'),
                         "did not prove it knows this job's rendezvous token: is it node 0's ddprun of this job");
  expect_untrusted_store("HTTP/1.1 400 Bad Request", "is not a ddprun store (it greeted with 'HTTP/1.1 400 Bad Request')");
}

TEST(StoreServer, NothingIsAnsweredBeforeTheHandshake) {
  const int port = free_port();
  ddprun::StoreServer server("127.0.0.1", port, kToken);
  ddprun::StoreClient launcher("127.0.0.1", port, kToken, 5s, never);
  launcher.set("ddprun/r0/run_id", "0123456789abcdef");
  for (const std::string& request : {std::string("GET ddprun/r0/run_id"), std::string("SET ddprun/r0/failed stop"),
                                     "AUTH " + std::string(32, 'a') + " " + std::string(64, '0')}) {
    Stranger stranger(port);
    EXPECT_EQ(stranger.line().rfind("DDPRUN-STORE 1 ", 0), 0u);
    stranger.send_text(request + "\n");
    const std::string reply = stranger.line();
    EXPECT_EQ(reply.rfind("DENIED ", 0), 0u) << request << " -> " << reply;
    EXPECT_TRUE(stranger.closed_by_store(2s)) << request;
  }
  EXPECT_FALSE(launcher.get("ddprun/r0/failed")) << "a stranger's SET was stored";
}

TEST(StoreServer, ClientsThatStallOrFloodAreDroppedWhileLaunchersAreServed) {
  const int port = free_port();
  ddprun::StoreServer server("127.0.0.1", port, kToken, ddprun::StoreLimits{500ms, 500ms});
  ddprun::StoreClient launcher("127.0.0.1", port, kToken, 5s, never);
  launcher.set("big", std::string(3000, 'v'));

  Stranger silent(port);  // connects and never says a word
  Stranger no_newline(port);
  no_newline.send_text(std::string(64 * 1024, 'x'));
  Stranger non_reader(port);  // knows the token, asks for much and reads nothing
  authenticate(non_reader, kToken);
  std::string requests;
  for (int i = 0; i < 10000; ++i) requests += "GET big\n";
  std::thread flood([&] { non_reader.send_text(requests); });

  // The store keeps answering a launcher while the others stall.
  for (int i = 0; i < 20; ++i) EXPECT_EQ(launcher.add("n", 1), i + 1);
  EXPECT_TRUE(no_newline.closed_by_store(2s)) << "a line past the limit must end the connection";
  EXPECT_TRUE(silent.closed_by_store(2s)) << "a handshake never begun must end the connection";
  std::this_thread::sleep_for(1500ms);  // the non-reader's replies stay unread past the limit
  EXPECT_TRUE(non_reader.closed_by_store(5s)) << "a client that leaves its replies unread must be dropped";
  flood.join();
  EXPECT_EQ(launcher.get("big"), std::string(3000, 'v'));
}

}  // namespace
