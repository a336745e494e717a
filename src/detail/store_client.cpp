// The client of the job's store; see store_client.h and Note [The job's store].
#include "detail/store_client.h"

#include "detail/store_protocol.h"

#include <c10/util/Exception.h>

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

using Clock = std::chrono::steady_clock;
namespace proto = store_protocol;

std::string seconds_text(std::chrono::milliseconds ms) {
  std::ostringstream out;
  out << static_cast<double>(ms.count()) / 1000.0 << "s";
  return out.str();
}

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }
std::string string_of(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }

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

JobStoreClient::JobStoreClient(std::string host, int port, std::string secret, std::chrono::milliseconds timeout,
                               std::shared_ptr<StoreServer> server)
    : c10d::Store(timeout),
      host_(std::move(host)),
      port_(port),
      secret_(std::move(secret)),
      connect_timeout_(timeout),
      server_(std::move(server)) {
  std::lock_guard<std::mutex> lock(mutex_);
  connect_locked(connect_timeout_);
}

JobStoreClient::~JobStoreClient() { disconnect_locked(); }

c10::intrusive_ptr<c10d::Store> JobStoreClient::clone() {
  auto copy = c10::make_intrusive<JobStoreClient>(host_, port_, secret_, connect_timeout_, server_);
  copy->setTimeout(getTimeout());
  return copy;
}

void JobStoreClient::disconnect_locked() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void JobStoreClient::connect_locked(std::chrono::milliseconds timeout) {
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
    TORCH_CHECK(Clock::now() < deadline, "[rendezvous] could not reach the rendezvous store at ", host_, ":", port_,
                " within ", seconds_text(timeout), " (", last_error,
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
  const bool sent = ::send(fd_, greeting.data(), greeting.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(greeting.size());
  const bool answered = sent && ready(fd_, POLLIN, std::max(deadline, Clock::now() + std::chrono::seconds(10))) &&
                        ::recv(fd_, &answer, 1, 0) == 1;
  if (answered && answer == proto::kGreetingAccepted) return;
  disconnect_locked();
  TORCH_CHECK(answer != proto::kGreetingWrongSecret, "[rendezvous] the rendezvous store at ", host_, ":", port_,
              " refused this process: it does not know the job's secret. Every process of a job needs the same "
              "ACCELERATE_RDZV_SECRET; `accelerate launch` sets it for its workers, and the launchers of a job on "
              "several machines take it from ACCELERATE_RDZV_SECRET or --rdzv_secret_file");
  TORCH_CHECK(answer != proto::kGreetingWrongVersion, "[rendezvous] the rendezvous store at ", host_, ":", port_,
              " speaks another version of the store's protocol (another release of accelerate-cpp serves it)");
  TORCH_CHECK(false, "[rendezvous] the rendezvous store at ", host_, ":", port_,
              " closed the connection during the greeting (is something else listening on that port?)");
}

std::vector<std::string> JobStoreClient::request(uint8_t op, const std::vector<std::string>& args,
                                                 std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mutex_);
  // A connection dropped after a timeout (or a broken one) is made again for the next request.
  if (fd_ < 0) connect_locked(connect_timeout_);
  std::string message(1, static_cast<char>(op));
  proto::put_strings(message, args);
  size_t sent = 0;
  while (sent < message.size()) {
    const ssize_t n = ::send(fd_, message.data() + sent, message.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = std::strerror(errno);
      disconnect_locked();
      TORCH_CHECK(false, "[rendezvous] lost the connection to the rendezvous store at ", host_, ":", port_, ": ", why,
                  " (the main process or its launcher has ended)");
    }
    sent += static_cast<size_t>(n);
  }
  const auto deadline = timeout == kNoTimeout ? Clock::time_point::max() : Clock::now() + timeout;
  std::string reply;
  std::vector<std::string> strings;
  while (true) {
    if (reply.size() >= 1) {
      const long taken = proto::parse_strings(reply.data() + 1, reply.size() - 1, strings);
      TORCH_CHECK(taken >= 0, "[rendezvous] the rendezvous store sent a malformed reply");
      if (taken > 0) break;
    }
    if (!ready(fd_, POLLIN, deadline)) {
      disconnect_locked();
      C10_THROW_ERROR(Error, c10::str("[rendezvous] the rendezvous store at ", host_, ":", port_,
                                      " did not answer within ", seconds_text(timeout), " (Wait timeout)"));
    }
    char buf[65536];
    const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      disconnect_locked();
      TORCH_CHECK(false, "[rendezvous] lost the connection to the rendezvous store at ", host_, ":", port_,
                  " (the main process or its launcher has ended)");
    }
    reply.append(buf, static_cast<size_t>(n));
  }
  TORCH_CHECK(static_cast<uint8_t>(reply[0]) == proto::kReplyOk, "[rendezvous] the rendezvous store refused a request: ",
              strings.empty() ? std::string("no reason given") : strings.front());
  return strings;
}

void JobStoreClient::set(const std::string& key, const std::vector<uint8_t>& value) {
  request(static_cast<uint8_t>(proto::Op::kSet), {key, string_of(value)}, timeout_);
}

std::vector<uint8_t> JobStoreClient::compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                                const std::vector<uint8_t>& desired) {
  auto r = request(static_cast<uint8_t>(proto::Op::kCompareSet), {key, string_of(expected), string_of(desired)},
                   timeout_);
  TORCH_CHECK(r.size() == 1, "[rendezvous] the rendezvous store sent a malformed reply");
  return bytes_of(r[0]);
}

std::vector<uint8_t> JobStoreClient::get(const std::string& key) {
  auto r = request(static_cast<uint8_t>(proto::Op::kGet), {key}, timeout_);
  TORCH_CHECK(r.size() == 1, "[rendezvous] the rendezvous store sent a malformed reply");
  return bytes_of(r[0]);
}

int64_t JobStoreClient::add(const std::string& key, int64_t value) {
  auto r = request(static_cast<uint8_t>(proto::Op::kAdd), {key, std::to_string(value)}, timeout_);
  TORCH_CHECK(r.size() == 1, "[rendezvous] the rendezvous store sent a malformed reply");
  return std::stoll(r[0]);
}

bool JobStoreClient::deleteKey(const std::string& key) {
  auto r = request(static_cast<uint8_t>(proto::Op::kDelete), {key}, timeout_);
  return r.size() == 1 && r[0] == "1";
}

bool JobStoreClient::check(const std::vector<std::string>& keys) {
  auto r = request(static_cast<uint8_t>(proto::Op::kCheck), keys, timeout_);
  return r.size() == 1 && r[0] == "1";
}

int64_t JobStoreClient::getNumKeys() {
  auto r = request(static_cast<uint8_t>(proto::Op::kNumKeys), {}, timeout_);
  TORCH_CHECK(r.size() == 1, "[rendezvous] the rendezvous store sent a malformed reply");
  return std::stoll(r[0]);
}

void JobStoreClient::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void JobStoreClient::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  request(static_cast<uint8_t>(proto::Op::kWait), keys, timeout);
}

}  // namespace accelerate::detail
