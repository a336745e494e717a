// The job's rendezvous store; see store_server.h and store_protocol.h.
#include "detail/store_server.h"

#include "detail/store_protocol.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <list>
#include <sstream>
#include <unordered_map>
#include <vector>

namespace accelerate::detail {

// Note [The job's store]
// The processes of a job find each other through a key-value store that the launcher serves
// (or, without the launcher, process 0). LibTorch's TCPStore server cannot be used for that: in
// LibTorch 1.13 it listens on every interface whatever address it is given, and no release
// authenticates its clients, so any host that reaches the port could join the job or overwrite
// its keys. This server listens only on the address it is given (loopback for a job on one
// machine) and lets a client in only after a greeting that carries the job's secret, compared in
// constant time; a client without it gets a refusal it can name, and the server reports it.
// It speaks a protocol of its own (store_protocol.h) to `JobStoreClient`, a c10d::Store, so
// Gloo, NCCL and the MPI group use it like any store. One thread serves every connection with
// poll(); a request for a key that does not exist yet (get, wait) is answered when a later write
// creates it, and the client alone decides how long to wait (it drops the connection when it
// gives up, and reconnects for its next request). It needs no LibTorch, like the launcher.

namespace {

using Clock = std::chrono::steady_clock;
namespace proto = store_protocol;

constexpr auto kGreetingTime = std::chrono::seconds(10);
constexpr auto kReportInterval = std::chrono::seconds(1);

std::string errno_text(int e) { return std::strerror(e); }

struct Client {
  int fd = -1;
  std::string peer;
  std::string in;
  std::string out;
  bool greeted = false;
  bool closing = false;  // close once `out` is written
  Clock::time_point greeting_deadline;
  bool pending = false;
  proto::Op op{};
  std::vector<std::string> args;
};

std::string peer_of(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) return "an unknown peer";
  char host[NI_MAXHOST] = {}, service[NI_MAXSERV] = {};
  if (::getnameinfo(reinterpret_cast<sockaddr*>(&address), length, host, sizeof(host), service, sizeof(service),
                    NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return "an unknown peer";
  }
  return std::string(host) + ":" + service;
}

bool same_secret(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

bool parse_integer(const std::string& text, long long& value) {
  if (text.empty()) return false;
  char* end = nullptr;
  errno = 0;
  value = std::strtoll(text.c_str(), &end, 10);
  return errno == 0 && end == text.c_str() + text.size();
}

}  // namespace

struct StoreServer::State {
  int listen_fd = -1;
  int wake_fd = -1;
  std::string secret;
  std::function<void(const std::string&)> report;
  std::unordered_map<std::string, std::string> data;
  std::list<Client> clients;
  Clock::time_point last_report{};
  int unreported = 0;

  ~State() {
    for (auto& c : clients) ::close(c.fd);
    if (listen_fd >= 0) ::close(listen_fd);
    if (wake_fd >= 0) ::close(wake_fd);
  }

  void refused(const Client& c, const std::string& why) {
    if (!report) return;
    const auto now = Clock::now();
    if (now - last_report < kReportInterval) {
      ++unreported;
      return;
    }
    std::string line = "refused a rendezvous connection from " + c.peer + ": " + why;
    if (unreported > 0) line += " (and " + std::to_string(unreported) + " more since the last report)";
    unreported = 0;
    last_report = now;
    report(line);
  }

  void reply(Client& c, uint8_t status, const std::vector<std::string>& strings) {
    c.out.push_back(static_cast<char>(status));
    proto::put_strings(c.out, strings);
  }

  // Answers the client's request if it can be answered now; returns false when it must wait.
  bool execute(Client& c) {
    auto& a = c.args;
    auto arity = [&](size_t n) {
      if (a.size() == n) return true;
      reply(c, proto::kReplyError, {"malformed request"});
      return false;
    };
    switch (c.op) {
      case proto::Op::kSet:
        if (!arity(2)) return true;
        data[a[0]] = a[1];
        reply(c, proto::kReplyOk, {});
        return true;
      case proto::Op::kGet: {
        if (!arity(1)) return true;
        auto it = data.find(a[0]);
        if (it == data.end()) return false;
        reply(c, proto::kReplyOk, {it->second});
        return true;
      }
      case proto::Op::kAdd: {
        if (!arity(2)) return true;
        long long delta = 0, current = 0;
        auto it = data.find(a[0]);
        if (!parse_integer(a[1], delta) || (it != data.end() && !parse_integer(it->second, current))) {
          reply(c, proto::kReplyError, {"add: the key '" + a[0] + "' does not hold an integer"});
          return true;
        }
        current += delta;
        data[a[0]] = std::to_string(current);
        reply(c, proto::kReplyOk, {std::to_string(current)});
        return true;
      }
      case proto::Op::kCheck: {
        const bool all = std::all_of(a.begin(), a.end(), [&](const std::string& k) { return data.count(k) > 0; });
        reply(c, proto::kReplyOk, {all ? "1" : "0"});
        return true;
      }
      case proto::Op::kWait: {
        const bool all = std::all_of(a.begin(), a.end(), [&](const std::string& k) { return data.count(k) > 0; });
        if (!all) return false;
        reply(c, proto::kReplyOk, {});
        return true;
      }
      case proto::Op::kCompareSet: {
        if (!arity(3)) return true;
        auto it = data.find(a[0]);
        if (it == data.end()) {
          if (a[1].empty()) data[a[0]] = a[2];
          reply(c, proto::kReplyOk, {a[1].empty() ? a[2] : a[1]});
        } else {
          if (it->second == a[1]) it->second = a[2];
          reply(c, proto::kReplyOk, {it->second});
        }
        return true;
      }
      case proto::Op::kDelete:
        if (!arity(1)) return true;
        reply(c, proto::kReplyOk, {data.erase(a[0]) > 0 ? "1" : "0"});
        return true;
      case proto::Op::kNumKeys:
        reply(c, proto::kReplyOk, {std::to_string(data.size())});
        return true;
    }
    reply(c, proto::kReplyError, {"unknown operation"});
    return true;
  }

  // Consumes what the client sent; returns false when the connection must end at once.
  bool consume(Client& c) {
    if (!c.greeted) {
      if (c.in.size() < 16) return true;
      if (std::memcmp(c.in.data(), proto::kMagic, sizeof(proto::kMagic)) != 0) {
        refused(c, "it does not speak the store's protocol");
        return false;
      }
      const uint32_t version = proto::get_u32(c.in.data() + 8);
      const uint32_t length = proto::get_u32(c.in.data() + 12);
      if (version != proto::kVersion) {
        c.out.push_back(static_cast<char>(proto::kGreetingWrongVersion));
        c.closing = true;
        refused(c, "it speaks version " + std::to_string(version) + " of the store's protocol, not " +
                       std::to_string(proto::kVersion) + " (another release of accelerate-cpp?)");
        return true;
      }
      if (length > proto::kMaxSecretBytes) {
        refused(c, "its greeting is malformed");
        return false;
      }
      if (c.in.size() < 16 + length) return true;
      if (!same_secret(c.in.substr(16, length), secret)) {
        c.out.push_back(static_cast<char>(proto::kGreetingWrongSecret));
        c.closing = true;
        refused(c, "it does not know the job's secret (ACCELERATE_RDZV_SECRET)");
        return true;
      }
      c.in.erase(0, 16 + length);
      c.greeted = true;
      c.out.push_back(static_cast<char>(proto::kGreetingAccepted));
    }
    while (!c.pending && !c.in.empty()) {
      std::vector<std::string> args;
      const long taken = proto::parse_strings(c.in.data() + 1, c.in.size() - 1, args);
      if (taken < 0) return false;
      if (taken == 0) return true;
      c.op = static_cast<proto::Op>(static_cast<uint8_t>(c.in[0]));
      c.args = std::move(args);
      c.in.erase(0, 1 + static_cast<size_t>(taken));
      c.pending = !execute(c);
    }
    return true;
  }

  void serve() {
    while (true) {
      std::vector<pollfd> fds;
      fds.push_back({wake_fd, POLLIN, 0});
      fds.push_back({listen_fd, POLLIN, 0});
      auto timeout = std::chrono::milliseconds(1000);
      const auto now = Clock::now();
      for (auto& c : clients) {
        fds.push_back({c.fd, static_cast<short>(POLLIN | (c.out.empty() ? 0 : POLLOUT)), 0});
        if (!c.greeted) {
          timeout = std::min(timeout, std::max(std::chrono::milliseconds(0),
                                               std::chrono::duration_cast<std::chrono::milliseconds>(
                                                   c.greeting_deadline - now)));
        }
      }
      if (::poll(fds.data(), fds.size(), static_cast<int>(timeout.count())) < 0 && errno != EINTR) return;
      if (fds[0].revents != 0) return;
      if ((fds[1].revents & POLLIN) != 0) accept_all();
      bool changed = false;
      size_t i = 2;
      for (auto it = clients.begin(); it != clients.end(); ++i) {
        Client& c = *it;
        bool keep = true;
        const short revents = i < fds.size() && fds[i].fd == c.fd ? fds[i].revents : 0;
        if ((revents & (POLLIN | POLLHUP | POLLERR)) != 0) keep = read_from(c) && consume(c);
        if (keep && (revents & POLLOUT) != 0) keep = write_to(c);
        if (keep && !c.out.empty() && (revents & POLLOUT) == 0) keep = write_to(c);  // try at once
        if (keep && c.closing && c.out.empty()) keep = false;
        if (keep && !c.greeted && Clock::now() >= c.greeting_deadline) keep = false;
        if (!keep) {
          ::close(c.fd);
          it = clients.erase(it);
          continue;
        }
        changed = true;
        ++it;
      }
      // Writes may have created what waiting requests need.
      if (changed) {
        for (auto& c : clients) {
          if (c.pending && execute(c)) {
            c.pending = false;
            consume(c);  // requests queued behind it
            write_to(c);
          }
        }
      }
    }
  }

  void accept_all() {
    while (true) {
      const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      Client c;
      c.fd = fd;
      c.peer = peer_of(fd);
      c.greeting_deadline = Clock::now() + kGreetingTime;
      clients.push_back(std::move(c));
    }
  }

  static bool read_from(Client& c) {
    char buf[65536];
    while (true) {
      const ssize_t n = ::read(c.fd, buf, sizeof(buf));
      if (n > 0) {
        c.in.append(buf, static_cast<size_t>(n));
        if (c.in.size() > proto::kMaxStringBytes + (1u << 20)) return false;
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
    }
  }

  static bool write_to(Client& c) {
    while (!c.out.empty()) {
      const ssize_t n = ::send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
      if (n > 0) {
        c.out.erase(0, static_cast<size_t>(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
    }
    return true;
  }
};

bool is_loopback_address(const std::string& address) {
  return address == "localhost" || address == "::1" || address.rfind("127.", 0) == 0;
}

std::string store_bind_address(const std::string& address, bool several_machines) {
  if (!several_machines || is_loopback_address(address)) return address;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(address.c_str(), nullptr, &hints, &found) != 0 || found == nullptr) return address;
  bool only_loopback = true;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      const auto* ip = reinterpret_cast<const sockaddr_in*>(a->ai_addr);
      if ((ntohl(ip->sin_addr.s_addr) >> 24) != 127) only_loopback = false;
    } else if (a->ai_family == AF_INET6) {
      const auto* ip = reinterpret_cast<const sockaddr_in6*>(a->ai_addr);
      if (!IN6_IS_ADDR_LOOPBACK(&ip->sin6_addr)) only_loopback = false;
    }
  }
  ::freeaddrinfo(found);
  return only_loopback ? std::string() : address;
}

std::string new_job_secret() {
  std::ifstream random("/dev/urandom", std::ios::binary);
  unsigned char bytes[16] = {};
  random.read(reinterpret_cast<char*>(bytes), sizeof(bytes));
  if (!random) throw StoreError("[rendezvous] cannot read /dev/urandom to make the job's secret");
  static constexpr char kHex[] = "0123456789abcdef";
  std::string secret;
  for (unsigned char b : bytes) {
    secret.push_back(kHex[b >> 4]);
    secret.push_back(kHex[b & 15]);
  }
  return secret;
}

StoreServer::StoreServer(const std::string& host, int port, std::string secret,
                         std::function<void(const std::string&)> report)
    : state_(std::make_unique<State>()), host_(host) {
  if (port < 0 || port > 65535) {
    throw StoreError("[rendezvous] expected a TCP port in 0-65535, got " + std::to_string(port));
  }
  state_->secret = std::move(secret);
  state_->report = std::move(report);

  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (rc != 0 || found == nullptr) {
    throw StoreError("[rendezvous] cannot resolve the address '" + host + "' to serve the store on: " +
                     ::gai_strerror(rc));
  }
  int last_error = 0;
  for (addrinfo* a = found; a != nullptr && state_->listen_fd < 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      last_error = errno;
      continue;
    }
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 1024) == 0) {
      state_->listen_fd = fd;
    } else {
      last_error = errno;
      ::close(fd);
    }
  }
  ::freeaddrinfo(found);
  if (state_->listen_fd < 0) {
    if (last_error == EADDRINUSE) {
      throw StoreError("[rendezvous] port " + std::to_string(port) + " is already in use on this machine; pick "
                       "another with --main_process_port (0 picks a free one) or MASTER_PORT");
    }
    if (last_error == EADDRNOTAVAIL) {
      throw StoreError("[rendezvous] " + host + " is not an address of this machine, so the store cannot be "
                       "served there; --main_process_ip (MASTER_ADDR) must name the machine of rank 0");
    }
    throw StoreError("[rendezvous] could not serve the rendezvous store on " + host + ":" + std::to_string(port) +
                     ": " + errno_text(last_error));
  }
  sockaddr_storage bound{};
  socklen_t length = sizeof(bound);
  ::getsockname(state_->listen_fd, reinterpret_cast<sockaddr*>(&bound), &length);
  port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  state_->wake_fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (state_->wake_fd < 0) throw StoreError("[rendezvous] eventfd failed: " + errno_text(errno));
  thread_ = std::thread([state = state_.get()] { state->serve(); });
}

StoreServer::~StoreServer() {
  if (thread_.joinable()) {
    const uint64_t one = 1;
    (void)!::write(state_->wake_fd, &one, sizeof(one));
    thread_.join();
  }
}

}  // namespace accelerate::detail
