// MPI's one thread in a process (Note [One MPI thread]): it starts MPI, runs the operations the
// MPI process group queues, in the order they were issued, completes them by polling, and fails
// those that outlast their timeout; also the checks every MPI call of the group goes through.
// What each collective asks of MPI is the process group's (process_group_mpi.cpp) and the ring's
// (mpi_ring.h). Like every file that includes <mpi.h>, it is compiled only when the build found
// MPI (Note [MPI back-end] in src/CMakeLists.txt).
//
// Note [One MPI thread]
// Every MPI call of the process happens on one thread owned by the MPI runtime (initialised
// with MPI_THREAD_SERIALIZED). Collectives are queued in the order the caller issues them, which
// is the order every rank issues them, started as non-blocking MPI operations and completed by
// polling: a short spin, then yielding, then sleeping with a growing interval, so that a rank
// waiting for a slow peer leaves the cores to compute (two processes on two cores would
// otherwise lose half their speed to a spinning wait). The thread also acts as the watchdog: a
// collective still incomplete after the group's timeout fails with an error naming it, and
// the group is then broken, because an MPI collective cannot be cancelled.
#pragma once

#include <ATen/core/ivalue.h>
#include <ATen/core/jit_type.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

// MPI's C interface only; the deprecated C++ bindings do not compile cleanly with our warnings.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace accelerate::detail::mpi {

/// MPI's text for the error `code`.
std::string mpi_error_text(int code);

/// Throws an error naming the operation `op` and the MPI `call` when `code` is not MPI_SUCCESS.
void check_mpi(int code, const char* op, const char* call);

/// `elements` as the count of one MPI call; refuses, naming `op`, more than MPI's 2^31-1.
int count_of(int64_t elements, const char* op);

/// The c10d work of one queued operation: completed by the MPI thread, waited for by the caller.
class MpiWork : public c10d::Work {
 public:
  MpiWork(int rank, c10d::OpType type, const char* name, std::vector<at::Tensor> outputs);

  bool wait(std::chrono::milliseconds timeout) override;
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

  /// Completes the work and its future, with `error` when it is not null.
  void complete(std::exception_ptr error);

  const char* name() const { return name_; }

 private:
  const char* name_;
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

/// One queued collective: `start` issues its non-blocking MPI calls, `done` copies results back.
struct Op {
  const char* name = "";
  std::function<void(MPI_Comm, std::vector<MPI_Request>&)> start;
  /// Large payloads run the blocking form instead, once every rank has arrived (Note [Large
  /// collectives block] in mpi_runtime.cpp).
  std::function<void(MPI_Comm)> blocking;
  std::function<void()> done;
  c10::intrusive_ptr<MpiWork> work;
  std::chrono::milliseconds timeout{0};
  MPI_Comm* comm = nullptr;
  std::vector<at::Tensor> keep_alive;  ///< buffers MPI may still touch after a timeout
};

/// MPI's one thread (Note [One MPI thread]).
class MpiRuntime {
 public:
  /// The process's runtime, which starts MPI on first use. MPI starts once per process; the
  /// runtime lives until exit, where MPI_Finalize runs (see shutdown) before static destructors.
  static std::shared_ptr<MpiRuntime> get();

  ~MpiRuntime();

  int world_rank() const { return world_rank_; }
  int world_size() const { return world_size_; }

  /// Queues `op` for the MPI thread; fails its work at once when MPI has been shut down.
  void enqueue(std::unique_ptr<Op> op);

  /// Stops the thread after the queued operations, then finalises MPI (unless a collective was
  /// abandoned: MPI_Finalize would wait for it forever).
  void shutdown();

 private:
  MpiRuntime();
  void run(std::promise<std::string>& started);
  bool execute(Op& op);
  bool wait_all(Op& op, std::vector<MPI_Request>& requests);

  int world_rank_ = 0;
  int world_size_ = 1;
  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Op>> queue_;
  bool stopping_ = false;
  std::string broken_;  // only touched by the MPI thread
  std::vector<std::unique_ptr<Op>> abandoned_;
};

}  // namespace accelerate::detail::mpi
