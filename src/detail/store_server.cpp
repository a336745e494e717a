// The job's rendezvous store; see store_server.h and store_protocol.h.
#include "detail/store_server.h"

#include "detail/byte_sizes.h"
#include "detail/durations.h"
#include "detail/store_protocol.h"
#include "detail/store_refusals.h"
#include "detail/store_table.h"

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
// constant time; a client without it gets a refusal it can name, and the server reports it
// (Note [Reporting refusals] in store_refusals.cpp). Connections that have not greeted yet are
// bounded (Note [Strangers]), and so is what those that have may hold (Note [What a client may
// hold]).
// It speaks a protocol of its own (store_protocol.h) to `JobStoreClient`, a c10d::Store, so
// Gloo, NCCL and the MPI group use it like any store. One thread serves every connection with
// poll(); a request for a key that does not exist yet (get, wait) is answered when a later write
// creates it, and the client alone decides how long to wait (it drops the connection when it
// gives up, and reconnects for its next request). It needs no LibTorch, like the launcher.

namespace {

namespace proto = store_protocol;

constexpr auto kGreetingTime = std::chrono::seconds(10);
constexpr auto kShortageReportInterval = std::chrono::seconds(10);

// Note [Strangers]
// A connection is a stranger until its greeting has shown the job's secret, and strangers are
// bounded: at most kMaxStrangersPerAddress from one address and kMaxStrangers in all, so that
// connections that never greet (a scanner, a flood) cannot take the descriptors that the job's
// workers need. A newcomer beyond a bound crowds out the stranger that has waited longest, from
// the newcomer's address when that address is over its bound, else from anywhere. A worker
// greets as soon as it connects, so it is never the oldest for long; to keep it from being
// closed all the same, a connection's greeting is read as soon as it is accepted, the oldest
// stranger gets a last read before it is crowded out, and the server accepts kAcceptBatch
// connections at a time, after serving those it has. (An IPv6 host that speaks from many
// addresses meets only the bound in all.)
constexpr size_t kMaxStrangersPerAddress = 32;
constexpr size_t kMaxStrangers = 128;
constexpr int kAcceptBatch = 16;

// Note [Out of descriptors]
// When accept fails for want of descriptors (EMFILE, ENFILE) or memory, the connection stays
// queued and the listening socket stays readable: polling it again at once would spin. The
// server stops polling it for kAcceptPause, or until it closes a connection of its own, and
// says so (at most every kShortageReportInterval). The other remedy, a spare descriptor closed
// to accept the newcomer and hang up on it, turns away whoever came, a worker as likely as a
// stranger; a queued worker instead waits (its greeting may take 10s) and is let in once
// descriptors are free, and strangers hold few of them (Note [Strangers]).
constexpr auto kAcceptPause = std::chrono::milliseconds(200);

// Note [What a client may hold]
// The secret keeps strangers out, but every worker of the job has it in its environment, and a
// program of the job that misbehaves must not make the store's process (the launcher, or process
// 0) take memory and descriptors at will. So what the clients that greeted may hold is bounded
// (StoreLimits), and each bound is reported naming the client:
//  - A connection that holds an unfinished request, or a reply it does not read, with no byte
//    going either way for `stall_timeout` (10s) is dropped. A real client sends a request in one
//    go and reads its reply as it comes, so bytes move within milliseconds; 10s outlasts TCP's
//    retransmissions of a lost segment (0.2s, doubled each time) several times over, and is the
//    time a new connection has for its greeting. A request that waits for a key (get, wait) is
//    not stalled: its client decides how long it waits.
//  - At most `max_clients` (32768) connections past their greeting; the next is refused at its
//    greeting (kGreetingTooManyClients). A process of a job holds one connection, two where
//    LibTorch clones the store, and each launcher one or two: a job of 8192 GPUs holds about 20000.
//  - Keys and values take at most `max_stored_bytes` (1 GiB), each key counted with
//    kEntryOverhead (store_table.cpp) more for what the map spends on it, so that many small keys are paid for too.
//    A set, add or compare-set beyond it is refused with an error its client reports, and changes
//    nothing. The largest user is Gloo: a group of N processes stores, per process, the addresses
//    of its N-1 peers, 136 bytes each on LibTorch 1.13 (newer Gloo stores 8 bytes a peer), so
//    142 MB for 1024 processes; NCCL and MPI store a few hundred bytes a group, the rendezvous and
//    the elastic rendezvous a few keys a process and a round. The keys of a job's attempts stay
//    (each attempt has its prefix): 1 GiB holds seven attempts of a 1024-process Gloo job.
//  - What connections hold in the store's buffers (unfinished requests, unsent replies, the keys of
//    requests that wait), counted by the buffers' capacity, is at most `max_buffered_bytes`
//    (1 GiB). A request may be 257 MiB (store_protocol.h), in a buffer of up to twice that; real
//    requests and replies are a few KB (Gloo's largest is 1.1 MB at 8192 processes). When a read
//    or a reply takes the total beyond it, the connections that hold the most are dropped until
//    it is within: the connection that filled it is the likeliest of them.
// A connection is not read while kReplyBacklog of its replies wait to be sent, so a client that
// sends requests without reading the replies holds one reply at most, and strangers are read no
// further than a greeting. In all, the store holds at most max_stored_bytes + max_buffered_bytes
// and a few hundred bytes a connection. (Before these bounds, one client could keep 257 MiB of an
// unfinished request for ever, and the values had no bound at all.)
constexpr size_t kReplyBacklog = size_t{64} << 10;
constexpr size_t kKeptCapacity = size_t{64} << 10;  // an emptied buffer keeps at most this
constexpr size_t kMaxGreetingBytes = 16 + proto::kMaxSecretBytes;
constexpr size_t kMaxRequestBytes = proto::kMaxStringBytes + (size_t{1} << 20);

std::string errno_text(int e) { return std::strerror(e); }

// The bytes a string holds outside itself.
size_t heap_bytes(const std::string& s) {
  static const size_t kInline = std::string().capacity();
  return s.capacity() > kInline ? s.capacity() : 0;
}

std::chrono::milliseconds until(Clock::time_point when, Clock::time_point now) {
  return std::max(std::chrono::milliseconds(0), std::chrono::ceil<std::chrono::milliseconds>(when - now));
}

struct Client {
  int fd = -1;
  std::string host;  // the peer's address
  std::string peer;  // and its port: "127.0.0.1:40000", "[::1]:40000"
  std::string in;
  std::string out;
  bool greeted = false;
  bool closing = false;  // close once `out` is written
  Clock::time_point greeting_deadline;
  short revents = 0;  // from the last poll
  bool pending = false;
  proto::Op op{};
  std::vector<std::string> args;
  // Note [What a client may hold]
  Clock::time_point last_progress;  // when a byte was last read from it or written to it
  bool partial = false;             // `in` begins with a request not all here yet
  bool held_back = false;           // `in` holds requests not taken while replies wait to be sent
  bool dropped = false;             // closed at the end of the server's round
  size_t waiting_bytes = 0;         // the keys of its request that waits, while it waits
};

void name_peer(Client& c) {
  c.host = c.peer = "an unknown peer";
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  if (::getpeername(c.fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) return;
  char host[NI_MAXHOST] = {}, service[NI_MAXSERV] = {};
  if (::getnameinfo(reinterpret_cast<sockaddr*>(&address), length, host, sizeof(host), service, sizeof(service),
                    NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return;
  }
  c.host = host;
  c.peer = address.ss_family == AF_INET6 ? "[" + c.host + "]:" + service : c.host + ":" + service;
}

bool same_secret(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

struct StoreServer::State {
  State(std::string job_secret, std::function<void(const std::string&)> reporter, StoreLimits store_limits)
      : secret(std::move(job_secret)), report(reporter), limits(store_limits), table(store_limits.max_stored_bytes),
        reports(std::move(reporter)) {}

  int listen_fd = -1;
  int wake_fd = -1;
  std::string secret;
  std::function<void(const std::string&)> report;
  StoreLimits limits;
  StoreTable table;
  size_t buffered = 0;  // every connection's buffers and waiting keys (Note [What a client may hold])
  std::list<Client> clients;  // greeted, in the order they came
  std::list<Client> strangers;  // not yet greeted, oldest first (Note [Strangers])
  std::unordered_map<std::string, size_t> strangers_from;  // how many per address
  Clock::time_point accept_paused_until{};
  Clock::time_point last_shortage_report{};
  RefusalReport reports;  // Note [Reporting refusals] in store_refusals.cpp
  bool maybe_written = false;  // a client may have written a key since waiting requests were tried

  ~State() {
    for (auto& c : clients) ::close(c.fd);
    for (auto& c : strangers) ::close(c.fd);
    if (listen_fd >= 0) ::close(listen_fd);
    if (wake_fd >= 0) ::close(wake_fd);
  }

  // Reports a refusal, `what` naming what was refused: "refused a rendezvous connection from ".
  void refused(const Client& c, Refusal kind, const std::string& why,
               const char* what = "refused a rendezvous connection from ") {
    reports.refused(c.host, c.peer, kind, why, what);
  }

  // Changes a buffer of a connection with `change`, keeping `buffered` up to date; an emptied
  // buffer lets go of its memory beyond kKeptCapacity.
  template <typename Change>
  void change_buffer(std::string& buffer, Change&& change) {
    const size_t before = heap_bytes(buffer);
    change();
    if (buffer.empty() && buffer.capacity() > kKeptCapacity) std::string().swap(buffer);
    buffered = buffered - before + heap_bytes(buffer);
  }

  // Lets go of what a connection holds (Note [What a client may hold]).
  void release_buffers(Client& c) {
    buffered -= heap_bytes(c.in) + heap_bytes(c.out) + c.waiting_bytes;
    std::string().swap(c.in);
    std::string().swap(c.out);
    c.args.clear();
    c.waiting_bytes = 0;
    c.pending = false;
  }

  void close_connection(Client& c) {
    release_buffers(c);
    ::close(c.fd);
  }

  static size_t held(const Client& c) { return heap_bytes(c.in) + heap_bytes(c.out) + c.waiting_bytes; }

  // Drops a connection that knows the secret, reporting why: its buffers now, its descriptor at
  // the end of the round.
  void drop(Client& c, Refusal kind, const std::string& why) {
    refused(c, kind, why, "dropped the rendezvous connection from ");
    release_buffers(c);
    c.dropped = true;
  }

  // Drops the connections that hold the most until the buffers are within their cap.
  void keep_within_budget() {
    while (buffered > limits.max_buffered_bytes) {
      Client* most = nullptr;
      for (auto& c : clients) {
        if (!c.dropped && (most == nullptr || held(c) > held(*most))) most = &c;
      }
      if (most == nullptr) return;
      drop(*most, Refusal::kOverBudget,
           "it held " + std::to_string(held(*most)) +
               " bytes of unfinished requests and unread replies, the most of any connection, when what the "
               "store holds for its connections went over its cap of " +
               bytes_text(limits.max_buffered_bytes));
    }
  }

  void reply(Client& c, uint8_t status, const std::vector<std::string>& strings) {
    change_buffer(c.out, [&] {
      c.out.push_back(static_cast<char>(status));
      proto::put_strings(c.out, strings);
    });
  }

  // Answers the client's request if it can be answered now; returns false when it must wait.
  bool execute(Client& c) {
    auto answer = table.execute(c.op, c.args);
    if (!answer) return false;
    if (answer->wrote) maybe_written = true;
    if (!answer->over_cap.empty()) {  // Note [What a client may hold]
      reply(c, proto::kReplyError, {"refused a request from " + c.peer + ": " + answer->over_cap});
      refused(c, Refusal::kValuesFull, answer->over_cap, "refused a request from ");
      return true;
    }
    reply(c, answer->status, answer->strings);
    return true;
  }

  // Consumes what the client sent; returns false when the connection must end at once.
  bool consume(Client& c) {
    if (c.closing) return true;  // refused: what else it sends is not read
    if (!c.greeted) {
      if (c.in.size() < 16) return true;
      if (std::memcmp(c.in.data(), proto::kMagic, sizeof(proto::kMagic)) != 0) {
        refused(c, Refusal::kNotTheProtocol, "it does not speak the store's protocol");
        return false;
      }
      const uint32_t version = proto::get_u32(c.in.data() + 8);
      const uint32_t length = proto::get_u32(c.in.data() + 12);
      if (version != proto::kVersion) {
        change_buffer(c.out, [&] { c.out.push_back(static_cast<char>(proto::kGreetingWrongVersion)); });
        c.closing = true;
        refused(c, Refusal::kOtherVersion,
                "it speaks version " + std::to_string(version) + " of the store's protocol, not " +
                    std::to_string(proto::kVersion) + " (another release of accelerate-cpp?)");
        return true;
      }
      if (length > proto::kMaxSecretBytes) {
        refused(c, Refusal::kMalformedGreeting, "its greeting is malformed");
        return false;
      }
      if (c.in.size() < 16 + length) return true;
      if (!same_secret(c.in.substr(16, length), secret)) {
        change_buffer(c.out, [&] { c.out.push_back(static_cast<char>(proto::kGreetingWrongSecret)); });
        c.closing = true;
        refused(c, Refusal::kWrongSecret, "it does not know the job's secret (ACCELERATE_RDZV_SECRET)");
        return true;
      }
      if (clients.size() >= limits.max_clients) {
        change_buffer(c.out, [&] { c.out.push_back(static_cast<char>(proto::kGreetingTooManyClients)); });
        c.closing = true;
        refused(c, Refusal::kTooManyClients,
                "it knows the job's secret, but the store already serves " + std::to_string(clients.size()) +
                    " connections that do, as many as it lets in at once");
        return true;
      }
      change_buffer(c.in, [&] { c.in.erase(0, 16 + length); });
      c.greeted = true;
      c.last_progress = Clock::now();
      change_buffer(c.out, [&] { c.out.push_back(static_cast<char>(proto::kGreetingAccepted)); });
    }
    // Requests are taken while their replies are sent (Note [What a client may hold]).
    while (!c.pending && !c.in.empty() && c.out.size() < kReplyBacklog) {
      std::vector<std::string> args;
      const long taken = proto::parse_strings(c.in.data() + 1, c.in.size() - 1, args);
      if (taken < 0) return false;
      c.partial = taken == 0;
      c.held_back = false;
      if (c.partial) return true;
      c.op = static_cast<proto::Op>(static_cast<uint8_t>(c.in[0]));
      c.args = std::move(args);
      change_buffer(c.in, [&] { c.in.erase(0, 1 + static_cast<size_t>(taken)); });
      if (execute(c)) {
        c.args.clear();
      } else {
        c.pending = true;
        for (const auto& arg : c.args) c.waiting_bytes += arg.size();
        buffered += c.waiting_bytes;
      }
      keep_within_budget();
      if (c.dropped) return false;
    }
    if (c.in.empty()) c.partial = false;
    c.held_back = !c.pending && !c.in.empty();  // behind kReplyBacklog of replies
    return true;
  }

  // A request that waited has been answered.
  void answered(Client& c) {
    buffered -= c.waiting_bytes;
    c.waiting_bytes = 0;
    c.args.clear();
    c.pending = false;
  }

  void serve() {
    std::vector<pollfd> fds;
    while (true) {
      auto now = Clock::now();
      reports.report_counted(now);
      const bool accepting = now >= accept_paused_until;
      auto timeout = std::chrono::milliseconds(1000);
      if (!strangers.empty()) timeout = std::min(timeout, until(strangers.front().greeting_deadline, now));
      for (const auto& c : clients) {
        if (stalls(c)) timeout = std::min(timeout, until(c.last_progress + limits.stall_timeout, now));
      }
      if (reports.counting()) timeout = std::min(timeout, until(reports.due(), now));
      if (!accepting) timeout = std::min(timeout, until(accept_paused_until, now));
      fds.clear();
      fds.push_back({wake_fd, POLLIN, 0});
      fds.push_back({accepting ? listen_fd : -1, POLLIN, 0});  // poll skips a negative descriptor
      for (auto* list : {&strangers, &clients}) {
        for (auto& c : *list) {
          fds.push_back({c.fd, static_cast<short>((reads(c) ? POLLIN : 0) | (c.out.empty() ? 0 : POLLOUT)), 0});
        }
      }
      if (::poll(fds.data(), fds.size(), static_cast<int>(timeout.count())) < 0 && errno != EINTR) {
        if (report) report("the rendezvous store stopped: poll failed: " + errno_text(errno));
        return;
      }
      if (fds[0].revents != 0) return;
      size_t i = 2;
      for (auto* list : {&strangers, &clients}) {
        for (auto& c : *list) c.revents = fds[i++].revents;
      }
      now = Clock::now();
      const size_t before = strangers.size() + clients.size();
      for (auto it = strangers.begin(); it != strangers.end();) {
        const auto next = std::next(it);
        settle(it, now);
        it = next;
      }
      for (auto it = clients.begin(); it != clients.end();) {
        if ((it->revents & POLLIN) != 0) maybe_written = true;
        if (serve_one(*it, now)) {
          ++it;
        } else {
          close_connection(*it);
          it = clients.erase(it);
        }
      }
      answer_waiting();
      close_dropped();
      // A closed connection frees a descriptor (Note [Out of descriptors]).
      if (strangers.size() + clients.size() < before) accept_paused_until = {};
      if (accepting && (fds[1].revents & POLLIN) != 0) {
        accept_some(now);
        answer_waiting();
        close_dropped();
      }
    }
  }

  // Whether the server reads what the connection sends: a stranger no further than a greeting, a
  // client while its replies are sent (Note [What a client may hold]).
  static bool reads(const Client& c) {
    if (!c.greeted) return !c.closing && c.in.size() < kMaxGreetingBytes;
    return c.out.size() < kReplyBacklog;
  }

  // Whether the connection is held up mid-request or mid-reply, so that its stall deadline runs.
  static bool stalls(const Client& c) { return !c.dropped && (c.partial || !c.out.empty()); }

  void close_dropped() {
    for (auto it = clients.begin(); it != clients.end();) {
      if (it->dropped) {
        close_connection(*it);
        it = clients.erase(it);
      } else {
        ++it;
      }
    }
  }

  // Answers the requests that wait for keys, when a client may have written since the last try.
  void answer_waiting() {
    while (maybe_written) {
      maybe_written = false;
      for (auto& c : clients) {
        if (c.dropped || !c.pending) continue;
        if (execute(c)) {
          answered(c);
          keep_within_budget();
          if (c.dropped) continue;
          if (!c.in.empty()) maybe_written = true;
          if (!consume(c)) {  // requests queued behind it
            c.dropped = true;
            continue;
          }
          write_to(c, Clock::now());
        }
      }
    }
  }

  // Reads, answers and writes what the poll found; returns false when the connection must end.
  bool serve_one(Client& c, Clock::time_point now) {
    if (c.dropped) return false;
    bool keep = true;
    bool take = false;  // whether there may be requests to take
    if ((c.revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
      keep = read_from(c, now);
      take = true;
    }
    c.revents = 0;
    // Requests held back while replies were sent are taken once they are (Note [What a client may hold]).
    while (keep) {
      if (take || (c.held_back && c.out.size() < kReplyBacklog)) keep = consume(c);
      take = false;
      if (!keep || c.out.empty()) break;
      const size_t unsent = c.out.size();
      keep = write_to(c, now);
      if (c.out.size() == unsent || !c.held_back || c.out.size() >= kReplyBacklog) break;
    }
    if (c.dropped) return false;
    if (keep && c.closing && c.out.empty()) keep = false;
    if (keep && !c.greeted && !c.closing && now >= c.greeting_deadline) {
      refused(c, Refusal::kSilent, "it sent no greeting within 10s");
      keep = false;
    }
    if (keep && c.greeted && stalls(c) && now - c.last_progress >= limits.stall_timeout) {
      refused(c,
              Refusal::kStalled,
              std::string(c.partial ? "it sent " + std::to_string(c.in.size()) + " bytes of a request"
                                    : "it left " + std::to_string(c.out.size()) + " bytes of replies unread") +
                  " and nothing moved for " + seconds_text(limits.stall_timeout),
              "dropped the rendezvous connection from ");
      keep = false;
    }
    return keep;
  }

  enum class Settled { kStranger, kGreeted, kClosed };

  // Serves a stranger, then closes it, or moves it to the clients once it is greeted.
  Settled settle(std::list<Client>::iterator it, Clock::time_point now) {
    if (!serve_one(*it, now)) {
      drop_stranger(it);
      return Settled::kClosed;
    }
    if (!it->greeted) return Settled::kStranger;
    forget_stranger(*it);
    maybe_written = true;
    clients.splice(clients.end(), strangers, it);
    return Settled::kGreeted;
  }

  void forget_stranger(const Client& c) {
    auto from = strangers_from.find(c.host);
    if (from != strangers_from.end() && --from->second == 0) strangers_from.erase(from);
  }

  void drop_stranger(std::list<Client>::iterator it) {
    forget_stranger(*it);
    close_connection(*it);
    strangers.erase(it);
  }

  // Makes room for one more stranger from `host` (Note [Strangers]).
  void make_room(const std::string& host, Clock::time_point now) {
    while (true) {
      const auto from = strangers_from.find(host);
      const bool address_full = from != strangers_from.end() && from->second >= kMaxStrangersPerAddress;
      if (!address_full && strangers.size() < kMaxStrangers) return;
      const auto oldest = address_full ? std::find_if(strangers.begin(), strangers.end(),
                                                      [&](const Client& c) { return c.host == host; })
                                       : strangers.begin();
      // A last read: a worker whose greeting has come is let in, not crowded out.
      oldest->revents = POLLIN;
      if (settle(oldest, now) != Settled::kStranger) continue;
      refused(*oldest, Refusal::kCrowdedOut,
              "it had waited longest of too many connections without a greeting (at most " +
                  std::to_string(kMaxStrangersPerAddress) + " from one address and " + std::to_string(kMaxStrangers) +
                  " in all may wait)");
      drop_stranger(oldest);
    }
  }

  // Accepts up to kAcceptBatch connections and reads their greetings (Note [Strangers]).
  void accept_some(Clock::time_point now) {
    for (int i = 0; i < kAcceptBatch; ++i) {
      const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        const int error = errno;
        if (error == EAGAIN || error == EWOULDBLOCK) return;
        // The connection failed before it was accepted: take the next.
        if (error == EINTR || error == ECONNABORTED || error == EPROTO || error == ENETDOWN || error == ENOPROTOOPT ||
            error == EHOSTDOWN || error == ENONET || error == EHOSTUNREACH || error == ENETUNREACH) {
          continue;
        }
        pause_accepting(error, now);
        return;
      }
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      Client c;
      c.fd = fd;
      name_peer(c);
      c.greeting_deadline = now + kGreetingTime;
      c.last_progress = now;
      c.revents = POLLIN;  // the greeting usually comes with the connection
      make_room(c.host, now);
      ++strangers_from[c.host];
      strangers.push_back(std::move(c));
      settle(std::prev(strangers.end()), now);
    }
  }

  // Stops accepting for a while when accept fails for want of resources (Note [Out of descriptors]).
  void pause_accepting(int error, Clock::time_point now) {
    accept_paused_until = now + kAcceptPause;
    if (!report || now - last_shortage_report < kShortageReportInterval) return;
    last_shortage_report = now;
    std::string hint;
    if (error == EMFILE) hint = " (this process is out of file descriptors: raise `ulimit -n` if this lasts)";
    if (error == ENFILE) hint = " (the machine is out of file descriptors: see fs.file-max)";
    report("the rendezvous store cannot accept connections for now: " + errno_text(error) + hint +
           "; those waiting are let in once it can");
  }

  // Reads what the connection sent, within Note [What a client may hold]; returns false when it
  // must end.
  bool read_from(Client& c, Clock::time_point now) {
    char buf[65536];
    while (true) {
      size_t room = sizeof(buf);
      if (!c.greeted) room = std::min(room, kMaxGreetingBytes - std::min(c.in.size(), kMaxGreetingBytes));
      if (room == 0) return true;
      const ssize_t n = ::read(c.fd, buf, room);
      if (n > 0) {
        c.last_progress = now;
        change_buffer(c.in, [&] { c.in.append(buf, static_cast<size_t>(n)); });
        if (c.in.size() > kMaxRequestBytes) {
          refused(c, Refusal::kTooLarge,
                  "it sent more than " + bytes_text(kMaxRequestBytes) + " of requests that the store had not taken",
                  "dropped the rendezvous connection from ");
          return false;
        }
        keep_within_budget();
        if (c.dropped) return false;
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
    }
  }

  bool write_to(Client& c, Clock::time_point now) {
    while (!c.out.empty()) {
      const ssize_t n = ::send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
      if (n > 0) {
        c.last_progress = now;
        change_buffer(c.out, [&] { c.out.erase(0, static_cast<size_t>(n)); });
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
                         std::function<void(const std::string&)> report, StoreLimits limits)
    : state_(std::make_unique<State>(std::move(secret), std::move(report), limits)), host_(host) {
  if (port < 0 || port > 65535) {
    throw StoreError("[rendezvous] expected a TCP port in 0-65535, got " + std::to_string(port));
  }

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
