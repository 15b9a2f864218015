#include "hosts.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "number.h"
#include "options.h"

namespace ddprun {
namespace {

int parse_slots(const std::string& text, const std::string& where) {
  const auto slots = parse_number(text, 1, kMaxRanksPerNode);
  if (!slots) {
    throw UsageError(where + ": slots must be a number from 1 to " + std::to_string(kMaxRanksPerNode) + " (got '" + text + "')");
  }
  return static_cast<int>(*slots);
}

void check_name(const std::string& name, const std::string& where) {
  if (name.empty() || name[0] == '-' || name.find_first_of(" \t'\"\\;&|`$@") != std::string::npos) {
    throw UsageError(where + ": '" + name + "' is not a host name");
  }
}

void check_unique(const std::vector<Host>& hosts, const std::string& where) {
  std::set<std::string> seen;
  for (const auto& host : hosts) {
    if (!seen.insert(host.name).second) {
      throw UsageError(where + ": host '" + host.name + "' is listed twice; list it once with all its slots");
    }
  }
}

// This machine's addresses in the textual form inet_ntop gives, loopback included.
std::set<std::string> own_addresses() {
  std::set<std::string> addresses;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return addresses;
  for (ifaddrs* entry = list; entry != nullptr; entry = entry->ifa_next) {
    if (entry->ifa_addr == nullptr) continue;
    char text[INET6_ADDRSTRLEN] = {};
    const int family = entry->ifa_addr->sa_family;
    if (family == AF_INET) {
      inet_ntop(family, &reinterpret_cast<sockaddr_in*>(entry->ifa_addr)->sin_addr, text, sizeof(text));
    } else if (family == AF_INET6) {
      inet_ntop(family, &reinterpret_cast<sockaddr_in6*>(entry->ifa_addr)->sin6_addr, text, sizeof(text));
    } else {
      continue;
    }
    addresses.insert(text);
  }
  freeifaddrs(list);
  return addresses;
}

// What `name` resolves to, as text; empty when it does not resolve (ssh will say so).
std::vector<std::string> resolve(const std::string& name) {
  std::vector<std::string> found;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  if (getaddrinfo(name.c_str(), nullptr, &hints, &result) != 0) return found;
  for (addrinfo* entry = result; entry != nullptr; entry = entry->ai_next) {
    char text[INET6_ADDRSTRLEN] = {};
    const void* address = entry->ai_family == AF_INET
                              ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(entry->ai_addr)->sin_addr)
                              : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(entry->ai_addr)->sin6_addr);
    if (inet_ntop(entry->ai_family, address, text, sizeof(text)) != nullptr) found.emplace_back(text);
  }
  freeaddrinfo(result);
  return found;
}

bool is_loopback_address(const std::string& text) { return text.rfind("127.", 0) == 0 || text == "::1"; }

}  // namespace

std::vector<Host> parse_host_list(const std::string& list) {
  std::vector<Host> hosts;
  std::stringstream items(list);
  for (std::string item; std::getline(items, item, ',');) {
    const auto colon = item.rfind(':');
    Host host;
    host.name = item.substr(0, colon);
    check_name(host.name, "-H entry '" + item + "'");
    if (colon != std::string::npos) host.slots = parse_slots(item.substr(colon + 1), "-H entry '" + item + "'");
    hosts.push_back(host);
  }
  if (hosts.empty() || list.back() == ',') throw UsageError("-H '" + list + "': expected host1:slots,host2:slots");
  check_unique(hosts, "-H");
  return hosts;
}

std::vector<Host> read_hostfile(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw UsageError("--hostfile " + path + ": cannot read it");
  std::vector<Host> hosts;
  int number = 0;
  for (std::string line; std::getline(in, line);) {
    const std::string where = "--hostfile " + path + " line " + std::to_string(++number);
    std::stringstream words(line.substr(0, line.find('#')));
    Host host;
    if (!(words >> host.name)) continue;  // blank or comment
    check_name(host.name, where);
    for (std::string word; words >> word;) {
      if (word.rfind("slots=", 0) != 0) throw UsageError(where + ": expected 'host slots=N', got '" + word + "'");
      host.slots = parse_slots(word.substr(6), where);
    }
    hosts.push_back(host);
  }
  if (hosts.empty()) throw UsageError("--hostfile " + path + ": no hosts in it");
  check_unique(hosts, "--hostfile " + path);
  return hosts;
}

bool is_this_host(const std::string& name) {
  char own_name[256] = {};
  if (name == "localhost" || (gethostname(own_name, sizeof(own_name) - 1) == 0 && name == own_name)) return true;
  const auto own = own_addresses();
  for (const auto& address : resolve(name)) {
    if (is_loopback_address(address) || own.count(address) > 0) return true;
  }
  return false;
}

bool is_address_literal(const std::string& name) {
  unsigned char bytes[sizeof(in6_addr)];
  return inet_pton(AF_INET, name.c_str(), bytes) == 1 || inet_pton(AF_INET6, name.c_str(), bytes) == 1;
}

bool is_loopback(const std::string& name) {
  const auto addresses = resolve(name);
  if (addresses.empty()) return name == "localhost";
  for (const auto& address : addresses) {
    if (!is_loopback_address(address)) return false;
  }
  return true;
}

}  // namespace ddprun
