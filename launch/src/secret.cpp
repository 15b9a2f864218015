#include "secret.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <iostream>
#include <stdexcept>

#include "options.h"

namespace ddprun {
namespace {

constexpr size_t kMinTokenLength = 16;    // 16 hex digits are 64 bits: no guessing over a network
constexpr size_t kMaxTokenLength = 1024;  // a token, not a file's worth of data
constexpr int kStdinTokenTimeoutMs = 30000;
const char* const kTokenVariable = "DDPRUN_RDZV_TOKEN";

std::string to_hex(const unsigned char* bytes, size_t size) {
  static const char digits[] = "0123456789abcdef";
  std::string text;
  for (size_t i = 0; i < size; ++i) {
    text += digits[bytes[i] >> 4];
    text += digits[bytes[i] & 15];
  }
  return text;
}

std::string trimmed(std::string text) {
  text.erase(text.find_last_not_of(" \t\r\n") + 1);
  text.erase(0, text.find_first_not_of(" \t\r\n"));
  return text;
}

std::string checked(std::string token, const std::string& where) {
  token = trimmed(token);
  if (token.size() < kMinTokenLength || token.size() > kMaxTokenLength ||
      token.find_first_of(" \t\r\n") != std::string::npos) {
    throw UsageError(where + ": the rendezvous token must be one word of " + std::to_string(kMinTokenLength) + " to " +
                     std::to_string(kMaxTokenLength) + " characters (make one: head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n')");
  }
  return token;
}

// The file must be ours and private: a token other users can read keeps nobody out.
std::string read_token_file(const std::string& path) {
  const std::string where = "--rdzv-token-file " + path;
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw UsageError(where + ": cannot open it (" + strerror(errno) + ")");
  struct stat info {};
  std::string text;
  if (fstat(fd, &info) == 0 && S_ISREG(info.st_mode) && info.st_uid == geteuid() && (info.st_mode & 077) == 0 &&
      info.st_size <= static_cast<off_t>(kMaxTokenLength + 2)) {
    char buffer[kMaxTokenLength + 2];
    const ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n > 0) text.assign(buffer, static_cast<size_t>(n));
  }
  close(fd);
  if (!S_ISREG(info.st_mode)) throw UsageError(where + ": not a regular file");
  if (info.st_uid != geteuid()) throw UsageError(where + ": owned by another user; use a token file of your own");
  if ((info.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(info.st_mode & 07777));
    throw UsageError(where + ": other users can read or change it (mode " + mode + "): chmod 600 " + path);
  }
  return checked(text, where);
}

// One line from the -H coordinator, written right after it started this node launcher.
std::string read_stdin_token() {
  std::string line;
  for (char c = 0; line.size() <= kMaxTokenLength;) {
    pollfd p{STDIN_FILENO, POLLIN, 0};
    if (poll(&p, 1, kStdinTokenTimeoutMs) <= 0) break;
    const ssize_t n = read(STDIN_FILENO, &c, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0 || c == '\n') return checked(line, "--rdzv-token-stdin");
    line += c;
  }
  throw UsageError("--rdzv-token-stdin: no token line arrived on stdin within " +
                   std::to_string(kStdinTokenTimeoutMs / 1000) + " s");
}

}  // namespace

std::string random_hex(size_t bytes) {
  std::string raw(bytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(raw.data()), static_cast<int>(bytes)) != 1) {
    throw std::runtime_error("the system's random generator failed");
  }
  return to_hex(reinterpret_cast<const unsigned char*>(raw.data()), bytes);
}

std::string hmac_hex(const std::string& key, const std::string& message) {
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(message.data()),
       message.size(), mac, &size);
  return to_hex(mac, size);
}

bool same_secret(const std::string& a, const std::string& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::string job_token(const Options& options) {
  const char* variable = std::getenv(kTokenVariable);
  const std::string from_environment = variable == nullptr ? "" : variable;
  unsetenv(kTokenVariable);
  if (!options.rdzv_token_file.empty()) return read_token_file(options.rdzv_token_file);
  if (variable != nullptr) return checked(from_environment, kTokenVariable);
  if (options.rdzv_token_stdin) return read_stdin_token();
  if (!options.hosts.empty()) return random_hex(16);  // the -H coordinator hands it to its nodes
  if (options.node_rank != 0) {
    throw UsageError("node " + std::to_string(options.node_rank) +
                     " needs the job's rendezvous token: node 0's ddprun printed one (or give every node the same "
                     "one): DDPRUN_RDZV_TOKEN=<token> or --rdzv-token-file FILE (mode 0600)");
  }
  const std::string token = random_hex(16);
  std::cerr << "ddprun: no rendezvous token given; made one for this job. Start the other nodes with "
            << kTokenVariable << "=" << token << " (or put it in a file of mode 0600: --rdzv-token-file)\n";
  return token;
}

}  // namespace ddprun
