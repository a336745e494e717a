// The job's rendezvous store (src/detail/store_server.h, store_client.h) over real sockets: every
// operation the process groups use, waiting for keys that appear later, timeouts that leave the
// client usable, the secret, the address it listens on, clients that misbehave or flood it, and a
// server out of descriptors.
#include "detail/check.h"
#include "detail/network.h"
#include "detail/process_group.h"
#include "detail/store_client.h"
#include "detail/store_protocol.h"
#include "detail/store_server.h"
#include "support/process.h"
#include "support/test_support.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

namespace accelerate::detail {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }

// Connects a plain TCP socket to 127.0.0.x:port; returns the descriptor or -1.
int raw_connect(const char* address, int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, address, &to.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// A socket listening on 127.0.0.1 at a free port (stored in `port`), standing for another
// program; -1 when it cannot be made.
int loopback_listener(int& port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 || ::listen(fd, 4) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    ::close(fd);
    return -1;
  }
  port = ntohs(address.sin_port);
  return fd;
}

// Waits (up to a second) for the server's thread to report something.
void wait_for_report(const std::vector<std::string>& reports, std::mutex& mutex) {
  for (int i = 0; i < 100; ++i) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (!reports.empty()) return;
    }
    std::this_thread::sleep_for(10ms);
  }
}

// Connects a plain TCP socket from the local address `source` to `address`:port; returns the
// descriptor or -1.
int raw_connect_from(const std::string& source, const char* address, int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in from{};
  from.sin_family = AF_INET;
  ::inet_pton(AF_INET, source.c_str(), &from.sin_addr);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, address, &to.sin_addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof(from)) != 0 ||
      ::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// The greeting of a client that knows `secret` (store_protocol.h).
std::string greeting_with(const std::string& secret) {
  namespace proto = store_protocol;
  std::string greeting(proto::kMagic, sizeof(proto::kMagic));
  proto::put_u32(greeting, proto::kVersion);
  proto::put_u32(greeting, static_cast<uint32_t>(secret.size()));
  return greeting + secret;
}

// Descriptors closed when the object goes away.
struct Descriptors {
  std::vector<int> fds;
  Descriptors() = default;
  Descriptors(const Descriptors&) = delete;
  Descriptors& operator=(const Descriptors&) = delete;
  ~Descriptors() {
    for (int fd : fds) ::close(fd);
  }
};

// Whether the other end has closed the connection `fd`.
bool closed_by_peer(int fd) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, 0) != 1) return false;
  char c = 0;
  const ssize_t n = ::recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
}

// Whether `condition` holds within `within`, trying every 10ms.
bool eventually(const std::function<bool()>& condition, std::chrono::milliseconds within) {
  const auto deadline = std::chrono::steady_clock::now() + within;
  while (!condition()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(10ms);
  }
  return true;
}

// The lines a server reports, gathered from its thread.
class Reports {
 public:
  std::function<void(const std::string&)> sink() {
    return [this](const std::string& line) {
      std::lock_guard<std::mutex> lock(mutex_);
      lines_.push_back(line);
    };
  }
  std::string text() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::string all;
    for (auto& line : lines_) all += line + "\n";
    return all;
  }
  // How many refused connections the lines count: one a line that names one, N a line that
  // counts "N more".
  size_t refusals() {
    std::lock_guard<std::mutex> lock(mutex_);
    size_t total = 0;
    for (auto& line : lines_) {
      size_t more = 0;
      if (line.rfind("refused a rendezvous connection from ", 0) == 0) {
        ++total;
      } else if (std::sscanf(line.c_str(), "refused %zu more rendezvous connection", &more) == 1) {
        total += more;
      }
    }
    return total;
  }

 private:
  std::mutex mutex_;
  std::vector<std::string> lines_;
};

std::set<pid_t> thread_ids() {
  std::set<pid_t> ids;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) {
    ids.insert(static_cast<pid_t>(std::stol(entry.path().filename().string())));
  }
  return ids;
}

// The thread of this process that did not exist in `before` (a server's), or 0 unless just one.
pid_t new_thread(const std::set<pid_t>& before) {
  std::vector<pid_t> added;
  for (pid_t id : thread_ids()) {
    if (before.count(id) == 0) added.push_back(id);
  }
  return added.size() == 1 ? added[0] : 0;
}

// The CPU time (user and system) a thread of this process has used, read from a file opened
// beforehand, so that it can be read when no descriptor is left.
class ThreadCpuTime {
 public:
  explicit ThreadCpuTime(pid_t id)
      : fd_(::open(("/proc/self/task/" + std::to_string(id) + "/stat").c_str(), O_RDONLY | O_CLOEXEC)) {}
  ~ThreadCpuTime() {
    if (fd_ >= 0) ::close(fd_);
  }
  ThreadCpuTime(const ThreadCpuTime&) = delete;
  ThreadCpuTime& operator=(const ThreadCpuTime&) = delete;

  // In seconds; negative when it cannot be read.
  double seconds() const {
    char buffer[1024];
    const ssize_t n = ::pread(fd_, buffer, sizeof(buffer) - 1, 0);
    if (n <= 0) return -1;
    const std::string stat(buffer, static_cast<size_t>(n));
    // The fields after the command name, which may hold spaces: state (3rd), ..., utime (14th), stime.
    std::istringstream fields(stat.substr(stat.rfind(')') + 1));
    std::string field;
    for (int i = 3; i < 14; ++i) fields >> field;
    long long user = -1, system = -1;
    fields >> user >> system;
    if (user < 0 || system < 0) return -1;
    return static_cast<double>(user + system) / static_cast<double>(::sysconf(_SC_CLK_TCK));
  }

 private:
  int fd_;
};

// The highest descriptor this process has open.
int highest_fd() {
  int highest = 2;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    highest = std::max(highest, std::stoi(entry.path().filename().string()));
  }
  return highest;
}

// Lowers this process's limit on open descriptors for a scope: a new descriptor must be below
// `limit`.
class OpenFileLimit {
 public:
  explicit OpenFileLimit(rlim_t limit) {
    ::getrlimit(RLIMIT_NOFILE, &saved_);
    rlimit lowered = saved_;
    lowered.rlim_cur = std::min(limit, saved_.rlim_cur);
    ok_ = ::setrlimit(RLIMIT_NOFILE, &lowered) == 0;
  }
  ~OpenFileLimit() { ::setrlimit(RLIMIT_NOFILE, &saved_); }
  OpenFileLimit(const OpenFileLimit&) = delete;
  OpenFileLimit& operator=(const OpenFileLimit&) = delete;
  bool ok() const { return ok_; }

 private:
  rlimit saved_{};
  bool ok_ = false;
};

TEST(JobStore, EveryOperationBehavesAsAStoreShould) {
  StoreServer server("127.0.0.1", 0, "s3cret");
  JobStoreClient store("127.0.0.1", server.port(), "s3cret", 10s);
  store.set("a", bytes("one"));
  EXPECT_EQ(text(store.get("a")), "one");
  EXPECT_EQ(store.add("n", 5), 5);
  EXPECT_EQ(store.add("n", -2), 3);
  EXPECT_EQ(text(store.get("n")), "3");  // counters read back as their decimal text
  EXPECT_TRUE(store.check({"a", "n"}));
  EXPECT_FALSE(store.check({"a", "missing"}));
  EXPECT_EQ(store.getNumKeys(), 2);
  // compareSet: creates only from an empty expectation, replaces only the expected value.
  EXPECT_EQ(text(store.compareSet("c", bytes("x"), bytes("y"))), "x");
  EXPECT_FALSE(store.check({"c"}));
  EXPECT_EQ(text(store.compareSet("c", {}, bytes("first"))), "first");
  EXPECT_EQ(text(store.compareSet("c", bytes("other"), bytes("second"))), "first");
  EXPECT_EQ(text(store.compareSet("c", bytes("first"), bytes("second"))), "second");
  EXPECT_TRUE(store.deleteKey("c"));
  EXPECT_FALSE(store.deleteKey("c"));
  EXPECT_EQ(store.getNumKeys(), 2);
  // Values are bytes, not text.
  const std::vector<uint8_t> binary = {0, 255, 10, 0, 7};
  store.set("bin", binary);
  EXPECT_EQ(store.get("bin"), binary);
}

TEST(JobStore, AGetOrWaitIsAnsweredWhenAnotherClientWritesTheKey) {
  StoreServer server("127.0.0.1", 0, "");
  JobStoreClient reader("127.0.0.1", server.port(), "", 10s);
  JobStoreClient writer("127.0.0.1", server.port(), "", 10s);
  std::thread later([&] {
    std::this_thread::sleep_for(100ms);
    writer.set("late", bytes("here"));
    writer.add("counter", 1);
  });
  EXPECT_EQ(text(reader.get("late")), "here");
  reader.wait({"late", "counter"});
  later.join();
  EXPECT_EQ(text(reader.get("counter")), "1");
}

TEST(JobStore, ACloneIsAClientOfTheSameStoreWithTheSameTimeoutThatOutlivesTheOriginal) {
  StoreServer server("127.0.0.1", 0, "k");
  auto original = c10::make_intrusive<JobStoreClient>("127.0.0.1", server.port(), "k", 10s);
  original->setTimeout(1234ms);
  original->set("from_original", bytes("1"));
  c10::intrusive_ptr<c10d::Store> copy = original->clone();
  EXPECT_EQ(copy->getTimeout(), 1234ms);
  EXPECT_EQ(text(copy->get("from_original")), "1");
  copy->set("from_copy", bytes("2"));
  EXPECT_EQ(text(original->get("from_copy")), "2");
  original.reset();  // the copy has a connection of its own
  EXPECT_EQ(copy->add("n", 3), 3);
}

TEST(JobStore, ATimedOutWaitFailsNamingTheStoreAndTheClientStaysUsable) {
  StoreServer server("127.0.0.1", 0, "k");
  JobStoreClient store("127.0.0.1", server.port(), "k", 10s);
  try {
    store.wait({"never"}, 200ms);
    ADD_FAILURE() << "the wait did not time out";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("did not answer within 0.2s"));
  }
  store.set("after", bytes("ok"));
  EXPECT_EQ(text(store.get("after")), "ok");
}

TEST(JobStore, AClientWithoutTheSecretIsRefusedAndTheServerReportsIt) {
  std::vector<std::string> reports;
  std::mutex mutex;
  StoreServer server("127.0.0.1", 0, "right", [&](const std::string& line) {
    std::lock_guard<std::mutex> lock(mutex);
    reports.push_back(line);
  });
  try {
    JobStoreClient store("127.0.0.1", server.port(), "wrong", 5s);
    ADD_FAILURE() << "a wrong secret was let in";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("refused this process: it does not know the job's secret"));
  }
  // The report comes from the server's thread.
  wait_for_report(reports, mutex);
  std::lock_guard<std::mutex> lock(mutex);
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_THAT(reports[0], HasSubstr("refused a rendezvous connection from 127.0.0.1:"));
  EXPECT_THAT(reports[0], HasSubstr("does not know the job's secret"));
}

TEST(JobStore, AnotherVersionOfTheProtocolIsRefusedAndNamedOnBothSides) {
  namespace proto = store_protocol;
  std::vector<std::string> reports;
  std::mutex mutex;
  StoreServer server("127.0.0.1", 0, "k", [&](const std::string& line) {
    std::lock_guard<std::mutex> lock(mutex);
    reports.push_back(line);
  });
  // A client of another version gets the version's refusal, and the server says why.
  const int client = raw_connect("127.0.0.1", server.port());
  ASSERT_GE(client, 0);
  std::string greeting(proto::kMagic, sizeof(proto::kMagic));
  proto::put_u32(greeting, proto::kVersion + 1);
  proto::put_u32(greeting, 1);
  greeting += "k";
  ASSERT_EQ(::write(client, greeting.data(), greeting.size()), static_cast<ssize_t>(greeting.size()));
  char answer = 0;
  ASSERT_EQ(::read(client, &answer, 1), 1);
  EXPECT_EQ(static_cast<uint8_t>(answer), proto::kGreetingWrongVersion);
  ::close(client);
  wait_for_report(reports, mutex);
  {
    std::lock_guard<std::mutex> lock(mutex);
    ASSERT_EQ(reports.size(), 1u);
    EXPECT_THAT(reports[0], HasSubstr("it speaks version " + std::to_string(proto::kVersion + 1) +
                                      " of the store's protocol, not " + std::to_string(proto::kVersion)));
  }

  // A server of another version (a stand-in that answers the greeting so) is named by the client.
  int port = 0;
  const int listener = loopback_listener(port);
  ASSERT_GE(listener, 0);
  std::thread stand_in([listener] {
    const int peer = ::accept(listener, nullptr, nullptr);
    char greeting_bytes[17];
    (void)!::read(peer, greeting_bytes, sizeof(greeting_bytes));
    const char refusal = static_cast<char>(store_protocol::kGreetingWrongVersion);
    (void)!::write(peer, &refusal, 1);
    ::close(peer);
  });
  EXPECT_THROWS_WITH(JobStoreClient("127.0.0.1", port, "k", 5s),
                     "speaks another version of the store's protocol");
  stand_in.join();
  ::close(listener);
}

// What `body` returns when run in a child process in a network namespace of its own (needs
// root), or "skip: <why>" when the namespace cannot be made.
std::string in_own_network_namespace(const std::function<std::string()>& body) {
  int pipe_fds[2];
  if (::pipe(pipe_fds) != 0) return "skip: pipe failed";
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(pipe_fds[0]);
    std::string result;
    if (::unshare(CLONE_NEWNET) != 0) {
      result = "skip: " + std::string(std::strerror(errno));
    } else {
      try {
        result = body();
      } catch (const std::exception& e) {
        result = error_text(e);
      }
    }
    (void)!::write(pipe_fds[1], result.data(), result.size());
    ::_exit(0);
  }
  ::close(pipe_fds[1]);
  std::string result;
  char buffer[4096];
  for (ssize_t n; (n = ::read(pipe_fds[0], buffer, sizeof(buffer))) > 0;) result.append(buffer, static_cast<size_t>(n));
  ::close(pipe_fds[0]);
  ::waitpid(child, nullptr, 0);
  return result;
}

// The address towards a host this machine has no route to is refused by name: checked in a
// network namespace of its own, which has no route at all (needs root; skipped otherwise).
TEST(SourceAddress, AHostWithoutARouteIsNamed) {
  const std::string result =
      in_own_network_namespace([] { return "address " + source_address_towards("10.9.9.9", 29500); });
  if (result.rfind("skip: ", 0) == 0) GTEST_SKIP() << "cannot make a network namespace: " << result.substr(6);
  EXPECT_THAT(result, HasSubstr("this machine has no route to the main process's address 10.9.9.9"));
  EXPECT_THAT(result, HasSubstr("GLOO_SOCKET_IFNAME"));
  EXPECT_THROWS_WITH(source_address_towards("no-such-host.invalid", 29500),
                     "cannot resolve the main process's address 'no-such-host.invalid'");
}

// The machine that serves the rendezvous knows itself by --main_process_ip: its loopback addresses
// and its interfaces' addresses, IPv4 and IPv6. Checked in a network namespace of its own, whose
// loopback interface is given one address of each family (needs root; skipped otherwise).
TEST(LocalAddress, LoopbackAndInterfaceAddressesOfBothFamiliesAreThisMachines) {
  const std::string result = in_own_network_namespace([]() -> std::string {
    if (std::system("ip link set lo up && ip addr add 198.51.100.5/32 dev lo && "
                    "ip addr add 2001:db8::5/128 dev lo nodad") != 0) {
      return "skip: ip could not give the namespace's loopback interface the addresses";
    }
    std::string answers;
    for (const char* host : {"127.0.0.1", "127.0.1.1", "localhost", "::1", "::ffff:127.0.0.1", "198.51.100.5",
                             "2001:db8::5", "::ffff:198.51.100.5", "198.51.100.6", "2001:db8::6", "192.0.2.1",
                             "no-such-host.invalid"}) {
      answers += std::string(host) + (is_local_address(host) ? " local\n" : " not local\n");
    }
    return answers;
  });
  if (result.rfind("skip: ", 0) == 0) GTEST_SKIP() << "cannot make a network namespace: " << result.substr(6);
  EXPECT_EQ(result,
            "127.0.0.1 local\n127.0.1.1 local\nlocalhost local\n::1 local\n::ffff:127.0.0.1 local\n"
            "198.51.100.5 local\n2001:db8::5 local\n::ffff:198.51.100.5 local\n"
            "198.51.100.6 not local\n2001:db8::6 not local\n192.0.2.1 not local\nno-such-host.invalid not local\n");
}

TEST(JobStore, ItListensOnlyOnTheAddressItWasGiven) {
  StoreServer server("127.0.0.1", 0, "");
  const int here = raw_connect("127.0.0.1", server.port());
  EXPECT_GE(here, 0);
  if (here >= 0) ::close(here);
  // Another address of this machine (the loopback network has them all) is not served.
  EXPECT_EQ(raw_connect("127.0.0.2", server.port()), -1);
}

TEST(JobStore, APortInUseAndAForeignAddressAreNamed) {
  StoreServer first("127.0.0.1", 0, "");
  try {
    StoreServer second("127.0.0.1", first.port(), "");
    ADD_FAILURE() << "two stores on one port";
  } catch (const StoreError& e) {
    EXPECT_THAT(e.what(), HasSubstr("port " + std::to_string(first.port()) + " is already in use"));
  }
  try {
    StoreServer elsewhere("192.0.2.1", 0, "");  // TEST-NET-1: never an address of this machine
    ADD_FAILURE() << "served on an address this machine does not have";
  } catch (const StoreError& e) {
    EXPECT_THAT(e.what(), HasSubstr("192.0.2.1 is not an address of this machine"));
  }
}

TEST(JobStore, AClientThatSpeaksAnotherProtocolIsDroppedAndOthersAreServed) {
  StoreServer server("127.0.0.1", 0, "");
  const int stranger = raw_connect("127.0.0.1", server.port());
  ASSERT_GE(stranger, 0);
  const std::string junk = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_EQ(::write(stranger, junk.data(), junk.size()), static_cast<ssize_t>(junk.size()));
  char c = 0;
  EXPECT_EQ(::read(stranger, &c, 1), 0);  // closed by the server
  ::close(stranger);
  JobStoreClient store("127.0.0.1", server.port(), "", 5s);
  store.set("still", bytes("served"));
  EXPECT_EQ(text(store.get("still")), "served");
}

TEST(JobStore, AFloodOfConnectionsThatNeverGreetIsCrowdedOutAndAWorkerStillGetsIn) {
  // As at a launcher whose descriptors would not hold the flood: enough for the flood's own
  // sockets, the strangers the store keeps (at most 128) and a worker, not for all of it.
  constexpr int kFlood = 300;
  constexpr int kKept = 128;
  Reports reports;
  const auto before = thread_ids();
  StoreServer server("127.0.0.1", 0, "k", reports.sink());
  const pid_t serving = new_thread(before);
  ASSERT_NE(serving, 0) << "cannot tell the store's thread";
  OpenFileLimit limit(static_cast<rlim_t>(highest_fd() + 1 + kFlood + kKept + 64));
  ASSERT_TRUE(limit.ok());
  const ThreadCpuTime cpu_time(serving);
  const auto start = std::chrono::steady_clock::now();
  const double cpu_at_start = cpu_time.seconds();
  ASSERT_GE(cpu_at_start, 0) << "cannot read the CPU time of the store's thread";

  // A third from the worker's own address, the rest from eight others; none greets.
  Descriptors flood;
  for (int i = 0; i < kFlood; ++i) {
    const std::string from = i % 3 == 0 ? "127.0.0.1" : "127.0.0." + std::to_string(2 + i % 8);
    const int fd = raw_connect_from(from, "127.0.0.1", server.port());
    ASSERT_GE(fd, 0) << "connection " << i << " from " << from << ": " << std::strerror(errno);
    flood.fds.push_back(fd);
  }
  // The store closes the oldest, keeping at most kKept.
  const auto closed = [&] {
    return std::count_if(flood.fds.begin(), flood.fds.end(), [](int fd) { return closed_by_peer(fd); });
  };
  EXPECT_TRUE(eventually([&] { return closed() >= kFlood - kKept; }, 5000ms))
      << closed() << " of " << kFlood << " connections without a greeting were closed";
  EXPECT_TRUE(closed_by_peer(flood.fds.front()));
  EXPECT_FALSE(closed_by_peer(flood.fds.back()));

  // A worker comes while the rest of the flood waits, and is served.
  try {
    JobStoreClient worker("127.0.0.1", server.port(), "k", 10s);
    worker.set("key", bytes("value"));
    EXPECT_EQ(text(worker.get("key")), "value");
  } catch (const c10::Error& e) {
    ADD_FAILURE() << "the worker was kept out: " << e.what_without_backtrace();
  }
  // The closed ones are reported, in a line and a count a second.
  EXPECT_TRUE(eventually([&] { return reports.refusals() >= static_cast<size_t>(kFlood - kKept); }, 5000ms))
      << reports.text();
  EXPECT_THAT(reports.text(), HasSubstr("crowded out by newer connections without a greeting"));

  // Holding the flood costs the store's thread little.
  std::this_thread::sleep_until(start + 1500ms);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double cpu = cpu_time.seconds() - cpu_at_start;
  EXPECT_LT(cpu, 0.3 * wall) << "the store's thread used " << cpu << "s of CPU in " << wall << "s";
}

TEST(JobStore, OutOfDescriptorsTheStoreWaitsWithoutSpinningAndLetsTheQueuedWorkerInOnceSomeAreFree) {
  namespace proto = store_protocol;
  Reports reports;
  const auto before = thread_ids();
  StoreServer server("127.0.0.1", 0, "k", reports.sink());
  const pid_t serving = new_thread(before);
  ASSERT_NE(serving, 0) << "cannot tell the store's thread";
  // The worker's socket is made before the descriptors run out; it connects after.
  Descriptors worker;
  worker.fds.push_back(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  ASSERT_GE(worker.fds[0], 0);
  const ThreadCpuTime cpu_time(serving);
  ASSERT_GE(cpu_time.seconds(), 0) << "cannot read the CPU time of the store's thread";
  {
    OpenFileLimit limit(static_cast<rlim_t>(highest_fd() + 1 + 16));
    ASSERT_TRUE(limit.ok());
    Descriptors filler;
    for (int fd; (fd = ::eventfd(0, EFD_CLOEXEC)) >= 0;) filler.fds.push_back(fd);
    ASSERT_EQ(errno, EMFILE);
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(static_cast<uint16_t>(server.port()));
    ::inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
    ASSERT_EQ(::connect(worker.fds[0], reinterpret_cast<sockaddr*>(&to), sizeof(to)), 0) << std::strerror(errno);
    // The store cannot accept it, and neither spins nor closes it meanwhile.
    const auto start = std::chrono::steady_clock::now();
    const double cpu_at_start = cpu_time.seconds();
    std::this_thread::sleep_for(1500ms);
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double cpu = cpu_time.seconds() - cpu_at_start;
    EXPECT_LT(cpu, 0.3 * wall) << "the store's thread used " << cpu << "s of CPU in " << wall << "s";
    EXPECT_FALSE(closed_by_peer(worker.fds[0]));
  }
  EXPECT_THAT(reports.text(), HasSubstr("the rendezvous store cannot accept connections for now: Too many open files "
                                        "(this process is out of file descriptors: raise `ulimit -n` if this lasts); "
                                        "those waiting are let in once it can"));
  // Descriptors are free again: the queued worker is let in, and so is a new one.
  const std::string greeting = greeting_with("k");
  ASSERT_EQ(::write(worker.fds[0], greeting.data(), greeting.size()), static_cast<ssize_t>(greeting.size()));
  pollfd answer_ready{worker.fds[0], POLLIN, 0};
  ASSERT_EQ(::poll(&answer_ready, 1, 10000), 1) << "the queued worker got no answer";
  char answer = 1;
  ASSERT_EQ(::read(worker.fds[0], &answer, 1), 1);
  EXPECT_EQ(static_cast<uint8_t>(answer), proto::kGreetingAccepted);
  JobStoreClient another("127.0.0.1", server.port(), "k", 10s);
  another.set("key", bytes("value"));
  EXPECT_EQ(text(another.get("key")), "value");
}

TEST(JobStore, ABurstOfRefusalsIsReportedInFullWithoutWaitingForAnother) {
  Reports reports;
  StoreServer server("127.0.0.1", 0, "right", reports.sink());
  // Two processes of another job, then four programs that speak something else, from two other
  // addresses; then nothing more.
  for (int i = 0; i < 2; ++i) {
    EXPECT_THROWS_WITH(JobStoreClient("127.0.0.1", server.port(), "wrong", 5s), "does not know the job's secret");
  }
  for (const char* from : {"127.0.0.2", "127.0.0.3", "127.0.0.2", "127.0.0.3"}) {
    const int fd = raw_connect_from(from, "127.0.0.1", server.port());
    ASSERT_GE(fd, 0) << std::strerror(errno);
    const std::string junk = "GET / HTTP/1.1\r\n\r\n";
    EXPECT_EQ(::write(fd, junk.data(), junk.size()), static_cast<ssize_t>(junk.size()));
    char c = 0;
    EXPECT_EQ(::read(fd, &c, 1), 0);  // refused
    ::close(fd);
  }
  // All six are counted within a few seconds, naming every address they came from.
  EXPECT_TRUE(eventually([&] { return reports.refusals() == 6; }, 5000ms)) << reports.text();
  const std::string said = reports.text();
  EXPECT_THAT(said, HasSubstr("refused a rendezvous connection from 127.0.0.1:"));
  EXPECT_THAT(said, HasSubstr("more rendezvous connections since the last report, from "));
  for (const char* from : {"127.0.0.2", "127.0.0.3"}) EXPECT_THAT(said, HasSubstr(from));
  EXPECT_THAT(said, HasSubstr("not speaking the store's protocol"));
}

TEST(JobStore, SomethingElseThatClosesTheConnectionIsNamedAsSuch) {
  // Another program listens on the port and hangs up on whatever connects.
  int port = 0;
  const int listener = loopback_listener(port);
  ASSERT_GE(listener, 0);
  timeval wait{.tv_sec = 0, .tv_usec = 200000};
  ::setsockopt(listener, SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof(wait));
  std::atomic<bool> done{false};
  std::thread hangs_up([&] {
    while (!done) {
      const int fd = ::accept(listener, nullptr, nullptr);
      if (fd >= 0) ::close(fd);
    }
  });
  const std::string error = testing::error_of([&] { JobStoreClient store("127.0.0.1", port, "k", 5s); });
  done = true;
  hangs_up.join();
  ::close(listener);
  EXPECT_THAT(error, HasSubstr("[rendezvous] the rendezvous store at 127.0.0.1:" + std::to_string(port) +
                               " closed the connection during the greeting (is something else listening on that "
                               "port?)"));
}

// A connection that has shown the secret `secret` to the store at 127.0.0.1:`port`, or -1.
int greeted_connection(int port, const std::string& secret) {
  const int fd = raw_connect("127.0.0.1", port);
  if (fd < 0) return -1;
  const std::string greeting = greeting_with(secret);
  char answer = 1;
  if (::write(fd, greeting.data(), greeting.size()) != static_cast<ssize_t>(greeting.size()) ||
      ::read(fd, &answer, 1) != 1 || answer != static_cast<char>(store_protocol::kGreetingAccepted)) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// A request as a client sends it (store_protocol.h).
std::string request_bytes(store_protocol::Op op, const std::vector<std::string>& args) {
  std::string message(1, static_cast<char>(static_cast<uint8_t>(op)));
  store_protocol::put_strings(message, args);
  return message;
}

// Sends all of `data` unless the peer is gone; whether it did.
bool send_all(int fd, const std::string& data) {
  for (size_t sent = 0; sent < data.size();) {
    const ssize_t n = ::send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
  }
  return true;
}

// "127.0.0.1:<port>" of this end of a connection, as the store names it.
std::string local_name(int fd) {
  sockaddr_in address{};
  socklen_t length = sizeof(address);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  return "127.0.0.1:" + std::to_string(ntohs(address.sin_port));
}

// Note [What a client may hold] in store_server.cpp: what a client that knows the secret may
// hold. The limits are lowered so that a test reaches them at once; the deadlines leave margins
// of seconds, and only what must happen eventually is waited for.
TEST(JobStore, AClientThatStopsMidRequestIsDroppedAtTheStallDeadlineNamingIt) {
  namespace proto = store_protocol;
  Reports reports;
  StoreLimits limits;
  limits.stall_timeout = 500ms;
  StoreServer server("127.0.0.1", 0, "k", reports.sink(), limits);
  Descriptors held;
  held.fds.push_back(greeted_connection(server.port(), "k"));
  ASSERT_GE(held.fds[0], 0);
  // Half of a set of 1 MiB, then nothing.
  const std::string whole = request_bytes(proto::Op::kSet, {"key", std::string(size_t{1} << 20, 'v')});
  ASSERT_TRUE(send_all(held.fds[0], whole.substr(0, whole.size() / 2)));
  EXPECT_TRUE(eventually([&] { return closed_by_peer(held.fds[0]); }, 30000ms)) << reports.text();
  EXPECT_TRUE(eventually(
      [&] { return reports.text().find("dropped the rendezvous connection from " + local_name(held.fds[0])) !=
                   std::string::npos; },
      5000ms))
      << reports.text();
  EXPECT_THAT(reports.text(), HasSubstr(": it sent " + std::to_string(whole.size() / 2) +
                                        " bytes of a request and nothing moved for 0.5s"));
  // A client that waits for a key is not stalled, however long it waits: its client decides.
  JobStoreClient reader("127.0.0.1", server.port(), "k", 30s);
  std::thread later([&] {
    std::this_thread::sleep_for(1500ms);
    JobStoreClient writer("127.0.0.1", server.port(), "k", 30s);
    writer.set("late", bytes("here"));
  });
  EXPECT_EQ(text(reader.get("late")), "here");
  later.join();
}

TEST(JobStore, AClientThatLeavesItsRepliesUnreadIsDroppedAtTheStallDeadline) {
  namespace proto = store_protocol;
  Reports reports;
  StoreLimits limits;
  // Long enough that the writer's own 32 MiB, on a loaded machine under a sanitizer, never stall
  // for as long.
  limits.stall_timeout = 3s;
  StoreServer server("127.0.0.1", 0, "k", reports.sink(), limits);
  JobStoreClient writer("127.0.0.1", server.port(), "k", 30s);
  writer.set("big", std::vector<uint8_t>(size_t{32} << 20, 7));  // more than the sockets' buffers take
  Descriptors held;
  held.fds.push_back(greeted_connection(server.port(), "k"));
  ASSERT_GE(held.fds[0], 0);
  // Gets sent one after another, their replies never read: one is taken, the others held back.
  std::string gets;
  for (int i = 0; i < 8; ++i) gets += request_bytes(proto::Op::kGet, {"big"});
  ASSERT_TRUE(send_all(held.fds[0], gets));
  EXPECT_TRUE(eventually(
      [&] { return reports.text().find("dropped the rendezvous connection from " + local_name(held.fds[0])) !=
                   std::string::npos; },
      30000ms))
      << reports.text();
  EXPECT_THAT(reports.text(), HasSubstr("bytes of replies unread and nothing moved for 3s"));
  EXPECT_EQ(writer.get("big").size(), size_t{32} << 20);  // the store serves the others
}

TEST(JobStore, ConnectionsBeyondTheCapAreRefusedAtTheirGreetingNamingTheClient) {
  Reports reports;
  StoreLimits limits;
  limits.max_clients = 3;
  StoreServer server("127.0.0.1", 0, "k", reports.sink(), limits);
  std::vector<std::unique_ptr<JobStoreClient>> clients;
  for (int i = 0; i < 3; ++i) clients.push_back(std::make_unique<JobStoreClient>("127.0.0.1", server.port(), "k", 10s));
  EXPECT_THROWS_WITH(JobStoreClient("127.0.0.1", server.port(), "k", 10s),
                     "the rendezvous store at 127.0.0.1:" + std::to_string(server.port()) +
                         " refused this process: it already serves as many connections that know the job's secret "
                         "as it lets in at once");
  EXPECT_TRUE(eventually([&] { return !reports.text().empty(); }, 5000ms));
  EXPECT_THAT(reports.text(), HasSubstr("refused a rendezvous connection from 127.0.0.1:"));
  EXPECT_THAT(reports.text(), HasSubstr("it knows the job's secret, but the store already serves 3 connections that "
                                        "do, as many as it lets in at once"));
  // The others are served; once one has gone, another gets in.
  clients[0]->set("key", bytes("value"));
  clients.erase(clients.begin());
  std::unique_ptr<JobStoreClient> another;
  EXPECT_TRUE(eventually(
      [&] {
        try {
          another = std::make_unique<JobStoreClient>("127.0.0.1", server.port(), "k", 10s);
          return true;
        } catch (const c10::Error&) {
          return false;
        }
      },
      10000ms));
  if (another) {
    EXPECT_EQ(text(another->get("key")), "value");
  }
}

TEST(JobStore, KeysAndValuesBeyondTheCapAreRefusedNamingTheClientAndChangeNothing) {
  Reports reports;
  StoreLimits limits;
  limits.max_stored_bytes = size_t{1} << 20;
  StoreServer server("127.0.0.1", 0, "k", reports.sink(), limits);
  JobStoreClient store("127.0.0.1", server.port(), "k", 10s);
  const std::vector<uint8_t> kb600(600 << 10, 1);
  store.set("a", kb600);
  const std::string refused = testing::error_of([&] { store.set("b", kb600); });
  EXPECT_THAT(refused,
              HasSubstr("[rendezvous] the rendezvous store refused a request: refused a request from 127.0.0.1:"));
  EXPECT_THAT(refused, HasSubstr("storing 'b' (614400 bytes) would take the store's keys and values to"));
  EXPECT_THAT(refused, HasSubstr("over their cap of 1 MiB (1 key stored)"));
  EXPECT_THROWS_WITH((void)store.compareSet("b", {}, kb600), "storing 'b' (614400 bytes)");
  EXPECT_FALSE(store.check({"b"}));
  EXPECT_EQ(store.get("a"), kb600);
  // A value replaced counts once; a key deleted makes room.
  store.set("a", std::vector<uint8_t>(900 << 10, 2));
  EXPECT_EQ(store.add("n", 1), 1);
  EXPECT_TRUE(store.deleteKey("a"));
  store.set("b", kb600);
  EXPECT_EQ(store.get("b"), kb600);
  EXPECT_TRUE(eventually([&] { return !reports.text().empty(); }, 5000ms));
  EXPECT_THAT(reports.text(), HasSubstr("refused a request from 127.0.0.1:"));

  // Small keys are paid for too: each counts for more than its bytes.
  StoreLimits small;
  small.max_stored_bytes = size_t{64} << 10;
  StoreServer tight("127.0.0.1", 0, "k", {}, small);
  JobStoreClient many("127.0.0.1", tight.port(), "k", 10s);
  int kept = 0;
  for (; kept < 5000; ++kept) {
    try {
      many.set("k" + std::to_string(kept), {});
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr("over their cap of 64 KiB"));
      break;
    }
  }
  EXPECT_LT(kept, 1000) << "keys of a few bytes are stored as if they cost nothing";
  EXPECT_GT(kept, 100);
}

TEST(JobStore, WhenWhatConnectionsHoldGoesOverTheCapTheOneThatHoldsTheMostIsDropped) {
  namespace proto = store_protocol;
  Reports reports;
  StoreLimits limits;
  limits.max_buffered_bytes = size_t{16} << 20;
  limits.stall_timeout = 600s;  // the second connection holds its request for the whole test
  StoreServer server("127.0.0.1", 0, "k", reports.sink(), limits);
  Descriptors held;
  for (int i = 0; i < 2; ++i) held.fds.push_back(greeted_connection(server.port(), "k"));
  ASSERT_GE(held.fds[0], 0);
  ASSERT_GE(held.fds[1], 0);
  // The second connection holds 3 MiB of a set of 64 MiB; the first sends 24 MiB of another.
  const std::string set = request_bytes(proto::Op::kSet, {"key", std::string(size_t{64} << 20, 'v')});
  ASSERT_TRUE(send_all(held.fds[1], set.substr(0, size_t{3} << 20)));
  (void)send_all(held.fds[0], set.substr(0, size_t{24} << 20));  // cut off when it is dropped
  EXPECT_TRUE(eventually([&] { return closed_by_peer(held.fds[0]); }, 30000ms)) << reports.text();
  EXPECT_TRUE(eventually(
      [&] { return reports.text().find("dropped the rendezvous connection from " + local_name(held.fds[0])) !=
                   std::string::npos; },
      5000ms))
      << reports.text();
  EXPECT_THAT(reports.text(), HasSubstr("bytes of unfinished requests and unread replies, the most of any connection, "
                                        "when what the store holds for its connections went over its cap of 16 MiB"));
  EXPECT_FALSE(closed_by_peer(held.fds[1]));
  JobStoreClient worker("127.0.0.1", server.port(), "k", 10s);
  worker.set("still", bytes("served"));
  EXPECT_EQ(text(worker.get("still")), "served");
}

TEST(JobStore, AClientReachesAServerThatStartsAfterIt) {
  // Process 0 may serve the store a little after the others start connecting.
  const int port = testing::free_port();
  std::unique_ptr<StoreServer> server;
  std::thread starter([&] {
    std::this_thread::sleep_for(300ms);
    server = std::make_unique<StoreServer>("127.0.0.1", port, "");
  });
  JobStoreClient store("127.0.0.1", port, "", 10s);
  starter.join();
  store.set("k", bytes("v"));
  EXPECT_EQ(text(store.get("k")), "v");
}

TEST(JobStore, NoServerWithinTheTimeoutIsNamed) {
  const int port = testing::free_port();
  try {
    JobStoreClient store("127.0.0.1", port, "", 300ms);
    ADD_FAILURE() << "connected to nothing";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(),
                HasSubstr("could not reach the rendezvous store at 127.0.0.1:" + std::to_string(port) + " within 0.3s"));
  }
}

TEST(Rendezvous, AStoreThatGoesAwayIsNamedAtOnceNotReportedAsATimeout) {
  // Process 1 of 2 waits in the rendezvous for process 0, whose store then goes away (its process
  // ended): the wait fails at once, and the rendezvous says what the store said, instead of a
  // timeout it never reached, and without waiting for the store to come back.
  auto server = std::make_unique<StoreServer>("127.0.0.1", 0, "k");
  RendezvousConfig config;
  config.topology.rank = 1;
  config.topology.world_size = 2;
  config.topology.local_world_size = 2;
  config.topology.master_port = server->port();
  config.backend = "gloo";
  config.secret = "k";
  config.store_hosted = true;
  config.rdzv_timeout = 60s;
  std::thread stopper([&] {
    // Once process 1 has counted itself, it waits (or is about to) for the others.
    try {
      JobStoreClient watcher("127.0.0.1", config.topology.master_port, "k", 10s);
      for (int i = 0; i < 3000 && !watcher.check({"accelerate/attempt0/joined"}); ++i) {
        std::this_thread::sleep_for(10ms);
      }
    } catch (const std::exception& e) {
      ADD_FAILURE() << "cannot watch the store: " << e.what();
    }
    server.reset();
  });
  const auto start = std::chrono::steady_clock::now();
  std::string error;
  try {
    (void)rendezvous(config);
    ADD_FAILURE() << "the rendezvous succeeded without process 0";
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  }
  stopper.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
  EXPECT_THAT(error, HasSubstr("rendezvous at 127.0.0.1:" + std::to_string(config.topology.master_port) +
                               " failed while process 1 of 2 waited for the others"));
  EXPECT_THAT(error, HasSubstr("lost the connection to the rendezvous store"));
  EXPECT_THAT(error, ::testing::Not(HasSubstr("timed out")));
}

TEST(Rendezvous, AStoreWhoseJobAlreadyHasAllItsProcessesIsNamedAsAnotherJobs) {
  // The store at MASTER_ADDR:MASTER_PORT already counts the 2 processes of another job; a third
  // process joining it is refused at once instead of joining that job.
  StoreServer server("127.0.0.1", 0, "k");
  JobStoreClient other_job("127.0.0.1", server.port(), "k", 5s);
  (void)other_job.add("accelerate/attempt0/joined", 2);
  RendezvousConfig config;
  config.topology.rank = 1;
  config.topology.world_size = 2;
  config.topology.local_world_size = 2;
  config.topology.master_addr = "127.0.0.1";
  config.topology.master_port = server.port();
  config.backend = "gloo";
  config.secret = "k";
  config.store_hosted = true;
  config.rdzv_timeout = 60s;
  EXPECT_THROWS_WITH((void)rendezvous(config),
                     "[PartialState] rendezvous saw 3 processes join a job of 2: another job is using the same "
                     "MASTER_ADDR:MASTER_PORT (127.0.0.1:" +
                         std::to_string(server.port()) + ")");
}

TEST(Rendezvous, APeerThatNeverComesIsStillReportedAsATimeoutWithTheCount) {
  StoreServer server("127.0.0.1", 0, "k");
  RendezvousConfig config;
  config.topology.rank = 1;
  config.topology.world_size = 3;
  config.topology.local_world_size = 3;
  config.topology.master_port = server.port();
  config.backend = "gloo";
  config.secret = "k";
  config.store_hosted = true;
  config.rdzv_timeout = 500ms;
  EXPECT_THROWS_WITH((void)rendezvous(config), "rendezvous timed out after 0.5s: only 1 of 3 processes joined");
}

// The job's store as one process sees it, with a process that ends (`ended` runs, then the
// rendezvous ends with an error) right after building its process group, as it is about to say so.
class EndsAfterBuildingItsGroup : public c10d::PrefixStore {
 public:
  EndsAfterBuildingItsGroup(const c10::intrusive_ptr<c10d::Store>& store, std::function<void()> ended)
      : c10d::PrefixStore("job", store), ended_(std::move(ended)) {}
  int64_t add(const std::string& key, int64_t value) override {
    if (key.ends_with("pg_built")) {
      ended_();
      throw std::runtime_error("the process ended after building its group");
    }
    return c10d::PrefixStore::add(key, value);
  }

 private:
  std::function<void()> ended_;
};

// The store as the other process sees it: `added` runs when it has counted itself built.
class SaysItIsBuilt : public c10d::PrefixStore {
 public:
  SaysItIsBuilt(const c10::intrusive_ptr<c10d::Store>& store, std::function<void()> added)
      : c10d::PrefixStore("job", store), added_(std::move(added)) {}
  int64_t add(const std::string& key, int64_t value) override {
    const int64_t count = c10d::PrefixStore::add(key, value);
    if (key.ends_with("pg_built") && value > 0) added_();  // not when a timed-out barrier asks for the count
    return count;
  }

 private:
  std::function<void()> added_;
};

RendezvousConfig group_built_config(int rank, int port, c10::intrusive_ptr<c10d::Store> store) {
  RendezvousConfig config;
  config.topology.rank = rank;
  config.topology.world_size = 2;
  config.topology.local_world_size = 2;
  config.topology.master_port = port;
  config.backend = "gloo";
  config.store = std::move(store);
  config.rdzv_timeout = 2s;
  config.collective_timeout = 30s;
  return config;
}

std::string rendezvous_error(const RendezvousConfig& config) {
  try {
    (void)rendezvous(config);
  } catch (const std::exception& e) {
    return error_text(e);
  }
  return "";
}

TEST(Rendezvous, AProcessThatEndsAfterBuildingItsGroupIsReportedByTheOthersWithTheCount) {
  // Both processes build their Gloo group; process 1 ends before it counts itself built, and
  // process 0 reports, once the rendezvous timeout has passed, how many did.
  StoreServer server("127.0.0.1", 0, "k");
  auto client = [&] { return c10::make_intrusive<JobStoreClient>("127.0.0.1", server.port(), "k", 10s); };
  // Process 1 ends only once process 0 has counted itself: a group destroyed while its peer still
  // connects would fail the peer's build instead (Note [Every process group is built]).
  std::promise<void> counted;
  auto store1 = c10::make_intrusive<EndsAfterBuildingItsGroup>(
      client(), [&] { (void)counted.get_future().wait_for(30s); });
  auto store0 = c10::make_intrusive<SaysItIsBuilt>(client(), [&] { counted.set_value(); });
  std::string error1;
  std::thread process1([&] { error1 = rendezvous_error(group_built_config(1, server.port(), store1)); });
  const std::string error0 = rendezvous_error(group_built_config(0, server.port(), store0));
  process1.join();
  EXPECT_THAT(error1, HasSubstr("the process ended after building its group"));
  EXPECT_THAT(error0, HasSubstr("[PartialState] process 0 of 2 built its process group, but only 1 of 2 processes "
                                "did within 2s (the others ended, failed, or were still building theirs)"));
}

TEST(Rendezvous, AStoreThatGoesAwayAfterTheGroupIsBuiltIsNamedAtOnce) {
  // Process 0 has built its group and counted itself; then the store's process ends. Process 0's
  // wait for the others fails at once with what the store said, not after the timeout.
  auto server = std::make_unique<StoreServer>("127.0.0.1", 0, "k");
  const int port = server->port();
  auto client = [&] { return c10::make_intrusive<JobStoreClient>("127.0.0.1", port, "k", 10s); };
  std::promise<void> counted;
  auto store1 = c10::make_intrusive<EndsAfterBuildingItsGroup>(client(), [&] {
    (void)counted.get_future().wait_for(30s);  // process 0 is in its wait (bounded, should it fail before)
    server.reset();
  });
  auto store0 = c10::make_intrusive<SaysItIsBuilt>(client(), [&] { counted.set_value(); });
  auto config0 = group_built_config(0, port, store0);
  config0.rdzv_timeout = 60s;
  std::string error1;
  std::thread process1([&] { error1 = rendezvous_error(group_built_config(1, port, store1)); });
  const auto start = std::chrono::steady_clock::now();
  const std::string error0 = rendezvous_error(config0);
  const auto waited = std::chrono::steady_clock::now() - start;
  process1.join();
  EXPECT_LT(waited, 30s) << "the wait outlasted the store";
  EXPECT_THAT(error1, HasSubstr("the process ended after building its group"));
  EXPECT_THAT(error0, HasSubstr("[PartialState] process 0 of 2 built its process group, but the rendezvous store "
                                "failed while it waited for the others: "));
  EXPECT_THAT(error0, HasSubstr("lost the connection to the rendezvous store"));
  EXPECT_THAT(error0, ::testing::Not(HasSubstr("within 60s")));
}

}  // namespace
}  // namespace accelerate::detail
