// The collective watch; see collective_watch.h and Note [The collective watch].
#include "detail/collective_watch.h"

#include "detail/check.h"
#include "detail/durations.h"
#include "detail/state_impl.h"
#include "detail/warn.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

namespace accelerate::detail {

// Note [The collective watch]
// A collective that some processes skip (a gather on one process, a barrier on the other) used
// to hang until the process group's timeout, or, on MPI, to fail at once as if a peer had died.
// The watch names it within seconds at no cost per step:
// - Fast path. Entering a collective increments the group's counter (`enter_collective`): the
//   collective's number. Its wait is one wait of at most the check delay
//   (ACCELERATE_COLLECTIVE_CHECK_SECONDS, 5 s by default, 0 turns the watch off); nothing else.
// - Slow path. A wait that outlasts the delay publishes this process's record in the job's store
//   ("waiting", number, operation, calling API), then goes on waiting in short slices and, between
//   them, reads every process's record. When every process has a record (waiting, failed or
//   ended) and they are not all the same collective, and two reads a slice apart agree (a record
//   is rewritten as "done" the moment its wait ends, so a stale one cannot survive a slice), every
//   process raises naming what each one does. A process that ended its program ("ended", written
//   when its state or process group is destroyed) is named at once. A process without a record
//   is in no collective: slow, not wrong; the first waiting process warns about it, at the delay
//   and then at doubling intervals, until the process group's own timeout.
// - Failures. A collective that fails (MPI reports a mismatched pair as an error; Gloo a peer's
//   closed connection) publishes "failed" and waits, at most the check delay and a slice, for
//   every process's record: if they show a mismatch or an ended process, that is the error;
//   otherwise the failure is a death, and reported as before.
// - Names. A record's API is the library call the collective came from: the outermost
//   `CallingApi` scope of the thread (`get_state_dict`, `backward`, …), then the engine's own
//   name in brackets; only the slow path reads it.
// Waits that never block on the host are not watched: NCCL's wait only orders streams.

namespace {

thread_local const char* calling_api = nullptr;

// `api` inside the library call `context` (null outside any `CallingApi` scope).
std::string named_api(const char* context, const char* api) {
  if (context == nullptr || std::strcmp(context, api) == 0) return api;
  return c10::str(context, " (", api, ")");
}

enum class Kind { kNone, kDone, kWaiting, kFailed, kEnded };

struct Record {
  Kind kind = Kind::kNone;
  uint64_t number = 0;
  std::string operation;
  std::string api;
  std::string text;  // as stored, to compare two reads

  bool in_collective() const { return kind == Kind::kWaiting || kind == Kind::kFailed; }
  bool published() const { return in_collective() || kind == Kind::kEnded; }
};

std::string key_of(const PartialStateImpl& impl, int rank) { return impl.watch_prefix + std::to_string(rank); }

std::string encode(Kind kind, const CollectiveTicket& ticket, const char* api) {
  const char* name = kind == Kind::kWaiting ? "waiting" : kind == Kind::kFailed ? "failed" : "done";
  return c10::str(name, '\t', ticket.number, '\t', ticket.operation, '\t', api);
}

Record decode(std::string text) {
  Record r;
  std::vector<std::string> fields;
  std::istringstream in(text);
  for (std::string f; std::getline(in, f, '\t');) fields.push_back(f);
  r.text = std::move(text);
  if (fields.empty()) return r;
  if (fields[0] == "ended") {
    r.kind = Kind::kEnded;
    if (fields.size() >= 3) {
      r.number = std::stoull(fields[1]);
      r.operation = fields[2];
    }
    return r;
  }
  if (fields.size() < 4) return r;
  r.kind = fields[0] == "waiting" ? Kind::kWaiting : fields[0] == "failed" ? Kind::kFailed : Kind::kDone;
  r.number = std::stoull(fields[1]);
  r.operation = fields[2];
  r.api = fields[3];
  return r;
}

void publish(const PartialStateImpl& impl, const std::string& value) {
  impl.store->set(key_of(impl, impl.topology.rank), std::vector<uint8_t>(value.begin(), value.end()));
}

// Every process's record, this one's as `mine`.
std::vector<Record> read_records(const PartialStateImpl& impl, const Record& mine) {
  std::vector<Record> out(impl.topology.world_size);
  for (int rank = 0; rank < impl.topology.world_size; ++rank) {
    if (rank == impl.topology.rank) {
      out[rank] = mine;
      continue;
    }
    const std::string key = key_of(impl, rank);
    if (!impl.store->check({key})) continue;
    const auto bytes = impl.store->get(key);
    out[rank] = decode(std::string(bytes.begin(), bytes.end()));
  }
  return out;
}

std::string describe(const Record& r) {
  switch (r.kind) {
    case Kind::kWaiting: return c10::str(r.operation, " #", r.number, " from ", r.api);
    case Kind::kFailed: return c10::str(r.operation, " #", r.number, " from ", r.api, " (failed there)");
    case Kind::kEnded:
      return r.number == 0 ? "ended its program" : c10::str("ended its program after ", r.operation, " #", r.number);
    case Kind::kDone:
    case Kind::kNone: break;
  }
  return "in no collective";
}

// What the records say is wrong, or empty when they show no mismatch (yet).
std::string diagnosis(const std::vector<Record>& records) {
  std::vector<int> ended;
  bool all_published = true;
  bool same = true;
  const Record* first = nullptr;
  for (size_t rank = 0; rank < records.size(); ++rank) {
    const Record& r = records[rank];
    if (r.kind == Kind::kEnded) ended.push_back(static_cast<int>(rank));
    all_published = all_published && r.published();
    if (!r.in_collective()) continue;
    if (first == nullptr) first = &r;
    same = same && r.number == first->number && r.operation == first->operation;
  }
  if (ended.empty() && (!all_published || same)) return {};
  std::ostringstream out;
  if (!ended.empty()) {
    out << "process" << (ended.size() > 1 ? "es " : " ");
    for (size_t i = 0; i < ended.size(); ++i) out << (i == 0 ? "" : ", ") << ended[i];
    out << (ended.size() > 1 ? " ended their program" : " ended its program")
        << " while the others wait in a collective (a collective that some processes skip)";
  } else {
    out << "the processes wait in different collectives (a collective that some processes skip, or call in "
           "another order)";
  }
  for (size_t rank = 0; rank < records.size(); ++rank) {
    out << (rank == 0 ? ": " : "; ") << "process " << rank << ": " << describe(records[rank]);
  }
  return out.str();
}

[[noreturn]] void raise_mismatch(const PartialState& state, const char* api, const std::string& text) {
  C10_THROW_ERROR(Error, c10::str("[", api, "] ", text, " (seen by process ", state.process_index(), " of ",
                                  state.num_processes(), ")"));
}

// The pause between two reads of the records.
std::chrono::milliseconds slice_of(std::chrono::milliseconds delay, Clock::duration waited) {
  using std::chrono::milliseconds;
  if (waited > std::chrono::minutes(1)) return milliseconds(5000);
  return std::clamp(delay / 2, milliseconds(200), milliseconds(2000));
}

// A failed collective: the records explain it, or it is reported as `failure` reports it.
// `named` is the API as the records name it, `api` as the failure's own message does.
[[noreturn]] void explain_failure(const PartialState& state, const CollectiveTicket& ticket, const char* named,
                                  const char* api, FailureMessage failure, const std::exception& e) {
  const auto& impl = *state.impl();
  const auto delay = impl.check_delay;
  if (impl.store && delay.count() > 0) {
    std::string verdict;
    try {
      Record mine = decode(encode(Kind::kFailed, ticket, named));
      publish(impl, mine.text);
      // A peer in a collective publishes its record at the latest one delay after it began.
      const auto give_up = Clock::now() + delay + slice_of(delay, {});
      while (verdict.empty()) {
        const auto records = read_records(impl, mine);
        verdict = diagnosis(records);
        const bool all = std::all_of(records.begin(), records.end(), [](const Record& r) { return r.published(); });
        if (all || Clock::now() >= give_up) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    } catch (const std::exception&) {
      // The store is gone too (its process ended): nothing more to compare.
    }
    if (!verdict.empty()) raise_mismatch(state, named, verdict);
  }
  C10_THROW_ERROR(Error, failure(state, api, e));
}

// One wait past the check delay: publishes this process's record once, then at each `check`
// reads every process's and returns the diagnosis once two reads agree on it (empty until then),
// warning about the processes in no collective at the delay and then at doubling intervals.
class SlowWait {
 public:
  SlowWait(const CollectiveTicket& ticket, const char* api, Clock::time_point start, std::chrono::milliseconds delay)
      : mine_(decode(encode(Kind::kWaiting, ticket, api))), ticket_(ticket), api_(api), start_(start),
        next_warning_(delay) {}

  std::string check(const PartialState& state) {
    const auto& impl = *state.impl();
    std::string verdict;
    try {
      if (!published_) {
        publish(impl, mine_.text);
        published_ = true;
      }
      const auto records = read_records(impl, mine_);
      const std::string text = diagnosis(records);
      if (!text.empty() && text == previous_) verdict = text;
      previous_ = text;
      const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start_);
      // The first waiting process speaks for the others.
      int first_waiting = -1;
      std::vector<int> absent;
      for (int rank = 0; rank < static_cast<int>(records.size()); ++rank) {
        if (records[rank].in_collective() && first_waiting < 0) first_waiting = rank;
        if (!records[rank].published()) absent.push_back(rank);
      }
      if (waited >= next_warning_ && text.empty() && !absent.empty()) {
        next_warning_ = waited * 2;
        if (first_waiting == state.process_index()) {
          std::ostringstream who;
          for (size_t i = 0; i < absent.size(); ++i) {
            who << (i == 0 ? "" : i + 1 == absent.size() ? " and " : ", ") << absent[i];
          }
          warn("accelerate.state",
               c10::str("[", api_, "] process ", state.process_index(), " has waited ", seconds_text(waited), " in ",
                        describe(mine_), " for process", absent.size() > 1 ? "es " : " ", who.str(), ", which ",
                        absent.size() > 1 ? "are" : "is",
                        " in no collective yet (slow, busy or stopped; still waiting, up to the process group's "
                        "timeout of ", seconds_text(impl.timeout), ")"),
               {.every_process = true, .state = state});
        }
      }
    } catch (const std::exception&) {
      // The store failed: nothing to compare this time; the collective's own wait goes on.
    }
    return verdict;
  }

  // The wait ended: its record is rewritten, so that no process reads it stale.
  void done(const PartialState& state) noexcept {
    if (!published_) return;
    try {
      publish(*state.impl(), encode(Kind::kDone, ticket_, api_));
    } catch (const std::exception&) {
    }
  }

 private:
  Record mine_;
  CollectiveTicket ticket_;
  const char* api_;
  Clock::time_point start_;
  std::chrono::milliseconds next_warning_;
  bool published_ = false;
  std::string previous_;  // the last diagnosis, to be confirmed by the next read
};

// The future handed to the waiter of a collective watched through its future, completed or
// failed by whichever comes first: the collective's own completion or the watch.
struct Settlement {
  explicit Settlement(c10::intrusive_ptr<c10::ivalue::Future> r) : result(std::move(r)) {}
  c10::intrusive_ptr<c10::ivalue::Future> result;
  std::atomic<bool> settled{false};
};

// A collective watched through its future. Only the watcher thread holds it: the collective's
// completion callback, which runs on the process group's own thread, holds the settlement alone,
// so that it never holds the last reference to the state and its process group (whose
// destructor joins that very thread).
struct WatchedFuture {
  explicit WatchedFuture(PartialState s) : state(std::move(s)) {}
  PartialState state;
  CollectiveTicket ticket;
  const char* api;
  const char* context;  // the calling API of the thread that entered it, or null
  std::string named;    // the two together, once the slow path needs them
  Clock::time_point start;
  std::shared_ptr<Settlement> settlement;
  std::unique_ptr<SlowWait> slow;
  Clock::time_point next_check;
};

// The thread that compares the records of collectives watched through their futures: every
// 200 ms it looks at the oldest unsettled one of each process group, and past the check delay
// runs its slow path at the slices `watch_wait` uses. Joined at exit.
class FutureWatcher {
 public:
  static FutureWatcher& get() {
    static FutureWatcher watcher;
    return watcher;
  }

  void add(std::shared_ptr<WatchedFuture> f) {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_.push_back(std::move(f));
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
  }

  ~FutureWatcher() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  FutureWatcher() = default;

  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      cv_.wait_for(lock, std::chrono::milliseconds(200));
      if (stop_) break;
      std::vector<std::shared_ptr<WatchedFuture>> finished, oldest;
      std::vector<const PartialStateImpl*> groups;
      for (auto it = pending_.begin(); it != pending_.end();) {
        if ((*it)->settlement->settled.load()) {
          finished.push_back(std::move(*it));
          it = pending_.erase(it);
          continue;
        }
        const auto* group = (*it)->state.impl().get();
        if (std::find(groups.begin(), groups.end(), group) == groups.end()) {
          groups.push_back(group);
          oldest.push_back(*it);  // pending_ is in the order of entry
        }
        ++it;
      }
      lock.unlock();
      for (auto& f : finished) {
        if (f->slow) f->slow->done(f->state);
      }
      const auto now = Clock::now();
      for (auto& f : oldest) {
        const auto delay = f->state.impl()->check_delay;
        if (now - f->start < delay || now < f->next_check) continue;
        if (!f->slow) {
          f->named = named_api(f->context, f->api);
          f->slow = std::make_unique<SlowWait>(f->ticket, f->named.c_str(), f->start, delay);
        }
        const auto verdict = f->slow->check(f->state);
        f->next_check = Clock::now() + slice_of(delay, now - f->start);
        if (verdict.empty() || f->settlement->settled.exchange(true)) continue;
        try {
          raise_mismatch(f->state, f->named.c_str(), verdict);
        } catch (const c10::Error&) {
          f->settlement->result->setError(std::current_exception());
        }
      }
      lock.lock();
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::vector<std::shared_ptr<WatchedFuture>> pending_;
  std::thread thread_;
};

}  // namespace

CallingApi::CallingApi(const char* name) noexcept : outermost_(calling_api == nullptr) {
  if (outermost_) calling_api = name;
}

CallingApi::~CallingApi() {
  if (outermost_) calling_api = nullptr;
}

std::string api_in_context(const char* api) { return named_api(calling_api, api); }

// Note [Counting the bytes a process sends]
// `communication_counters()` reports what each collective's algorithm sends from this process,
// counted when the collective is entered: a formula per operation, no per-element work and no
// reading of sockets. Gloo and the project's MPI group run their allreduces, all-gathers and
// reduce-scatters around a ring: an allreduce of n bytes over p processes is a reduce-scatter
// ((p-1) pieces of n/p out) followed by an all-gather (as many again), 2(p-1)/p * n; an
// all-gather sends its own piece and the p-2 it forwards, (p-1) * m; a reduce-scatter (p-1)/p * n.
// A reduce-scatter that runs as an allreduce (Gloo's, flat or not, and any process group without
// the flat collective) is counted as the allreduce it is. A broadcast is counted at its root as
// (p-1) times the tensor: the total over the processes; Gloo's tree has inner processes forward
// part of it beyond two processes, so per process it is exact at two. What the DDP reducer runs
// on its own (the map of used parameters, sparse buckets) is not counted. The counts round down to whole bytes; on a link between two
// machines they match what the interface carries, less the framing (the multihost tests check it).
namespace {
std::atomic<uint64_t> process_collectives{0};
std::atomic<uint64_t> process_bytes_sent{0};
}  // namespace

CollectiveTicket enter_collective(const PartialState& state, const char* operation, uint64_t sent) noexcept {
  auto& impl = *state.impl();
  impl.last_operation.store(operation, std::memory_order_relaxed);
  count_unwatched(sent);
  return {impl.collectives.fetch_add(1, std::memory_order_relaxed) + 1, operation};
}

void count_unwatched(uint64_t sent) noexcept {
  process_collectives.fetch_add(1, std::memory_order_relaxed);
  process_bytes_sent.fetch_add(sent, std::memory_order_relaxed);
}

uint64_t all_reduce_sent(int processes, uint64_t bytes) noexcept {
  if (processes <= 1) return 0;
  const auto p = static_cast<uint64_t>(processes);
  return 2 * (p - 1) * bytes / p;
}

uint64_t all_gather_sent(int processes, uint64_t piece) noexcept {
  return processes <= 1 ? 0 : static_cast<uint64_t>(processes - 1) * piece;
}

uint64_t reduce_scatter_sent(int processes, uint64_t bytes) noexcept {
  if (processes <= 1) return 0;
  const auto p = static_cast<uint64_t>(processes);
  return (p - 1) * bytes / p;
}

uint64_t broadcast_sent(int processes, bool root, uint64_t bytes) noexcept {
  return root && processes > 1 ? static_cast<uint64_t>(processes - 1) * bytes : 0;
}

uint64_t bytes_of(const at::Tensor& t) noexcept {
  return t.defined() ? static_cast<uint64_t>(t.numel()) * static_cast<uint64_t>(t.element_size()) : 0;
}

Traffic communication_totals() noexcept {
  return {process_collectives.load(std::memory_order_relaxed), process_bytes_sent.load(std::memory_order_relaxed)};
}

void watch_wait(const PartialState& state, const CollectiveTicket& ticket, const c10::intrusive_ptr<c10d::Work>& work,
                const char* api, FailureMessage failure) {
  const auto& impl = *state.impl();
  const auto timeout = impl.timeout;
  const auto delay = impl.check_delay;
  const auto start = Clock::now();
  if (delay.count() <= 0 || delay >= timeout || !impl.store) {
    try {
      work->wait(timeout);
      return;
    } catch (const std::exception& e) {
      C10_THROW_ERROR(Error, failure(state, api, e));
    }
  }
  try {
    work->wait(delay);
    return;
  } catch (const std::exception& e) {
    if (work->isCompleted()) explain_failure(state, ticket, api_in_context(api).c_str(), api, failure, e);
  }

  // The slow path (Note [The collective watch]).
  const auto deadline = start + timeout;
  const std::string named = api_in_context(api);
  SlowWait slow(ticket, named.c_str(), start, delay);
  while (true) {
    const std::string verdict = slow.check(state);
    if (!verdict.empty()) raise_mismatch(state, named.c_str(), verdict);
    const auto now = Clock::now();
    const auto remaining = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now);
    const auto slice = std::max(std::min(slice_of(delay, now - start), remaining), std::chrono::milliseconds(1));
    try {
      work->wait(slice);
      break;
    } catch (const std::exception& e) {
      if (work->isCompleted() || remaining <= slice) {
        if (work->isCompleted()) explain_failure(state, ticket, named.c_str(), api, failure, e);
        C10_THROW_ERROR(Error, failure(state, api, e));
      }
    }
  }
  slow.done(state);
}

c10::intrusive_ptr<c10::ivalue::Future> watch_future(const PartialState& state, const CollectiveTicket& ticket,
                                                     const c10::intrusive_ptr<c10::ivalue::Future>& future,
                                                     const char* api) {
  const auto& impl = *state.impl();
  if (impl.check_delay.count() <= 0 || impl.check_delay >= impl.timeout || !impl.store) return future;
  auto watched = std::make_shared<WatchedFuture>(state);
  watched->ticket = ticket;
  watched->api = api;
  watched->context = calling_api;
  watched->start = Clock::now();
  auto settlement = std::make_shared<Settlement>(c10::make_intrusive<c10::ivalue::Future>(future->elementType()));
  watched->settlement = settlement;
  auto result = settlement->result;
  FutureWatcher::get().add(std::move(watched));
  future->addCallback([settlement](c10::ivalue::Future& done) {
    if (settlement->settled.exchange(true)) return;
    if (done.hasError()) {
      settlement->result->setError(done.exception_ptr());
    } else {
      settlement->result->markCompleted(done.value());
    }
  });
  return result;
}

void publish_ended(PartialStateImpl& impl) noexcept {
  if (!impl.store || impl.topology.world_size < 2 || impl.check_delay.count() <= 0) return;
  try {
    const std::string value = c10::str("ended\t", impl.collectives.load(std::memory_order_relaxed), '\t',
                                       impl.last_operation.load(std::memory_order_relaxed));
    impl.store->set(key_of(impl, impl.topology.rank), std::vector<uint8_t>(value.begin(), value.end()));
  } catch (...) {
    // The store has ended first: nobody is left to tell.
  }
}

}  // namespace accelerate::detail
