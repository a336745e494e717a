// The connection to the job's store; see store_connection.h and Note [The job's store].
#include "detail/store_connection.h"

#include "detail/check.h"
#include "detail/durations.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <sstream>
#include <thread>

namespace accelerate::detail {
namespace {

namespace proto = store_protocol;

// Waits until `fd` is ready for `events` or `deadline` passes (max(): forever).
bool ready(int fd, short events, Clock::time_point deadline) {
  while (true) {
    int timeout_ms = -1;
    if (deadline != Clock::time_point::max()) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return false;
      timeout_ms = static_cast<int>(std::min<long long>(left, 1000 * 1000));
    }
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, timeout_ms);
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) return false;
  }
}

}  // namespace

StoreConnection::StoreConnection(std::string host, int port, std::string secret,
                                 std::chrono::milliseconds connect_timeout)
    : host_(std::move(host)), port_(port), secret_(std::move(secret)), connect_timeout_(connect_timeout) {
  connect(connect_timeout_);
}

StoreConnection::~StoreConnection() { disconnect(); }

void StoreConnection::disconnect() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void StoreConnection::connect(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  std::string last_error = "nothing answered";
  while (true) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    const int rc = ::getaddrinfo(host_.c_str(), std::to_string(port_).c_str(), &hints, &found);
    if (rc != 0) {
      last_error = std::string("cannot resolve the address: ") + ::gai_strerror(rc);
    }
    for (addrinfo* a = found; a != nullptr && fd_ < 0; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
        fd_ = fd;
      } else {
        last_error = std::strerror(errno);
        ::close(fd);
      }
    }
    if (found != nullptr) ::freeaddrinfo(found);
    if (fd_ >= 0) break;
    ACCELERATE_CHECK(Clock::now() < deadline, "[rendezvous] could not reach the rendezvous store at ", host_, ":",
                     port_, " within ", seconds_text(timeout), " (", last_error,
                     "; is the main process running, and are MASTER_ADDR/MASTER_PORT right?)");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  int one = 1;
  ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  std::string greeting(proto::kMagic, sizeof(proto::kMagic));
  proto::put_u32(greeting, proto::kVersion);
  proto::put_u32(greeting, static_cast<uint32_t>(secret_.size()));
  greeting += secret_;
  uint8_t answer = 255;
  const bool sent =
      ::send(fd_, greeting.data(), greeting.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(greeting.size());
  const bool answered = sent && ready(fd_, POLLIN, std::max(deadline, Clock::now() + std::chrono::seconds(10))) &&
                        ::recv(fd_, &answer, 1, 0) == 1;
  if (answered && answer == proto::kGreetingAccepted) return;
  disconnect();
  ACCELERATE_CHECK(answer != proto::kGreetingWrongSecret, "[rendezvous] the rendezvous store at ", host_, ":", port_,
                   " refused this process: it does not know the job's secret. Every process of a job needs the same "
                   "ACCELERATE_RDZV_SECRET; `accelerate launch` sets it for its workers, and the launchers of a job on "
                   "several machines take it from ACCELERATE_RDZV_SECRET or --rdzv_secret_file");
  ACCELERATE_CHECK(answer != proto::kGreetingTooManyClients, "[rendezvous] the rendezvous store at ", host_, ":",
                   port_, " refused this process: it already serves as many connections that know the job's secret as "
                   "it lets in at once (the store's process names the connection it refused)");
  ACCELERATE_CHECK(answer != proto::kGreetingWrongVersion, "[rendezvous] the rendezvous store at ", host_, ":", port_,
                   " speaks another version of the store's protocol (another release of accelerate-cpp serves it)");
  ACCELERATE_CHECK(false, "[rendezvous] the rendezvous store at ", host_, ":", port_,
                   " closed the connection during the greeting (is something else listening on that port?)");
}

std::vector<std::string> StoreConnection::request(store_protocol::Op op, const std::vector<std::string>& args,
                                                  std::chrono::milliseconds timeout) {
  // A connection dropped after a timeout (or a broken one) is made again for the next request.
  if (fd_ < 0) connect(connect_timeout_);
  std::string message(1, static_cast<char>(static_cast<uint8_t>(op)));
  proto::put_strings(message, args);
  size_t sent = 0;
  while (sent < message.size()) {
    const ssize_t n = ::send(fd_, message.data() + sent, message.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = std::strerror(errno);
      disconnect();
      ACCELERATE_CHECK(false, "[rendezvous] lost the connection to the rendezvous store at ", host_, ":", port_, ": ",
                       why, " (the main process or its launcher has ended)");
    }
    sent += static_cast<size_t>(n);
  }
  const auto deadline =
      timeout == std::chrono::milliseconds::zero() ? Clock::time_point::max() : Clock::now() + timeout;
  std::string reply;
  std::vector<std::string> strings;
  while (true) {
    if (reply.size() >= 1) {
      const long taken = proto::parse_strings(reply.data() + 1, reply.size() - 1, strings);
      ACCELERATE_CHECK(taken >= 0, "[rendezvous] the rendezvous store sent a malformed reply");
      if (taken > 0) break;
    }
    if (!ready(fd_, POLLIN, deadline)) {
      disconnect();
      raise_error(concat("[rendezvous] the rendezvous store at ", host_, ":", port_, " did not answer within ",
                         seconds_text(timeout), " (Wait timeout)"));
    }
    char buf[65536];
    const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      disconnect();
      ACCELERATE_CHECK(false, "[rendezvous] lost the connection to the rendezvous store at ", host_, ":", port_,
                       " (the main process or its launcher has ended)");
    }
    reply.append(buf, static_cast<size_t>(n));
  }
  ACCELERATE_CHECK(static_cast<uint8_t>(reply[0]) == proto::kReplyOk,
                   "[rendezvous] the rendezvous store refused a request: ",
                   strings.empty() ? std::string("no reason given") : strings.front());
  return strings;
}

}  // namespace accelerate::detail
