// The addresses and networks of this machine; see network.h.
#include "detail/network.h"

#include "detail/check.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace accelerate::detail {

std::string source_address_towards(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  ACCELERATE_CHECK(rc == 0 && found != nullptr, "[PartialState] cannot resolve the main process's address '", host,
                   "': ", ::gai_strerror(rc));
  std::string chosen;
  std::string failure;
  for (addrinfo* a = found; a != nullptr && chosen.empty(); a = a->ai_next) {
    const int fd = ::socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t length = sizeof(local);
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0) {
      char text[INET6_ADDRSTRLEN] = {};
      const void* raw = local.ss_family == AF_INET
                            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr)
                            : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr);
      if (::inet_ntop(local.ss_family, raw, text, sizeof(text)) != nullptr) chosen = text;
    } else {
      failure = std::strerror(errno);
    }
    ::close(fd);
  }
  ::freeaddrinfo(found);
  ACCELERATE_CHECK(!chosen.empty(), "[PartialState] this machine has no route to the main process's address ", host,
                   " (", failure,
                   "); check MASTER_ADDR / --main_process_ip, or name the interface with GLOO_SOCKET_IFNAME");
  return chosen;
}

namespace {

// Whether `wanted` (an IPv4 or IPv6 socket address) is this machine's: a loopback address, or one
// an interface has.
bool is_address_of_this_machine(const sockaddr* wanted, const ifaddrs* all) {
  if (wanted->sa_family == AF_INET) {
    const auto address = reinterpret_cast<const sockaddr_in*>(wanted)->sin_addr.s_addr;
    // 127.0.0.0/8 is this machine whatever the interfaces list (Debian maps its host name to
    // 127.0.1.1, which no interface has).
    if ((ntohl(address) >> 24) == 127) return true;
    for (const ifaddrs* a = all; a != nullptr; a = a->ifa_next) {
      if (a->ifa_addr != nullptr && a->ifa_addr->sa_family == AF_INET &&
          reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr.s_addr == address) {
        return true;
      }
    }
    return false;
  }
  if (wanted->sa_family != AF_INET6) return false;
  const in6_addr& address = reinterpret_cast<const sockaddr_in6*>(wanted)->sin6_addr;
  if (IN6_IS_ADDR_LOOPBACK(&address)) return true;
  if (IN6_IS_ADDR_V4MAPPED(&address)) {  // ::ffff:a.b.c.d is the IPv4 address a.b.c.d
    sockaddr_in v4{};
    v4.sin_family = AF_INET;
    std::memcpy(&v4.sin_addr.s_addr, &address.s6_addr[12], 4);
    return is_address_of_this_machine(reinterpret_cast<const sockaddr*>(&v4), all);
  }
  for (const ifaddrs* a = all; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr != nullptr && a->ifa_addr->sa_family == AF_INET6 &&
        IN6_ARE_ADDR_EQUAL(&reinterpret_cast<const sockaddr_in6*>(a->ifa_addr)->sin6_addr, &address)) {
      return true;
    }
  }
  return false;
}

}  // namespace

bool is_local_address(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0 || found == nullptr) return false;
  ifaddrs* all = nullptr;
  bool local = false;
  if (::getifaddrs(&all) == 0) {
    for (addrinfo* f = found; f != nullptr && !local; f = f->ai_next) local = is_address_of_this_machine(f->ai_addr, all);
    ::freeifaddrs(all);
  }
  ::freeaddrinfo(found);
  return local;
}

std::string network_of_address(const std::string& address) {
  ifaddrs* all = nullptr;
  if (::getifaddrs(&all) != 0) return {};
  std::string network;
  for (ifaddrs* a = all; a != nullptr && network.empty(); a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_netmask == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    const auto* ip = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
    const auto* mask = reinterpret_cast<const sockaddr_in*>(a->ifa_netmask);
    char text[INET_ADDRSTRLEN] = {};
    if (::inet_ntop(AF_INET, &ip->sin_addr, text, sizeof(text)) == nullptr || address != text) continue;
    in_addr base{};
    base.s_addr = ip->sin_addr.s_addr & mask->sin_addr.s_addr;
    const int bits = __builtin_popcount(ntohl(mask->sin_addr.s_addr));
    if (::inet_ntop(AF_INET, &base, text, sizeof(text)) != nullptr)
      network = std::string(text) + "/" + std::to_string(bits);
  }
  ::freeifaddrs(all);
  return network;
}

}  // namespace accelerate::detail
