// MPI's one thread; see mpi_runtime.h and Note [One MPI thread].
#include "detail/mpi_runtime.h"

#include "detail/durations.h"
#include "detail/torch_compat.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <sched.h>

namespace accelerate::detail::mpi {


std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<size_t>(length));
}

void check_mpi(int code, const char* op, const char* call) {
  if (code == MPI_SUCCESS) return;
  C10_THROW_ERROR(Error, c10::str("[mpi] ", op, ": ", call, " failed: ", mpi_error_text(code)));
}

int count_of(int64_t elements, const char* op) {
  TORCH_CHECK_VALUE(elements <= INT_MAX, "[mpi] ", op, ": ", elements,
                    " elements exceed MPI's per-call limit of 2^31-1; split the tensor");
  return static_cast<int>(elements);
}

MpiWork::MpiWork(int rank, c10d::OpType type, const char* name, std::vector<at::Tensor> outputs)
    : c10d::Work(rank, type), name_(name), outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

bool MpiWork::wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (timeout == kNoTimeout) {
    cv_.wait(lock, [&] { return completed_; });
  } else if (!cv_.wait_for(lock, timeout, [&] { return completed_; })) {
    C10_THROW_ERROR(Error, c10::str("[mpi] ", name_, " did not complete within ", seconds_text(timeout),
                                    " (a process skipped it, or is stuck or dead)"));
  }
  if (exception_) std::rethrow_exception(exception_);
  return true;
}

void MpiWork::complete(std::exception_ptr error) {
  finish(error);
  if (error) {
    future_->setError(error);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
}

std::shared_ptr<MpiRuntime> MpiRuntime::get() {
  static std::mutex mutex;
  static std::shared_ptr<MpiRuntime> instance;
  std::lock_guard<std::mutex> lock(mutex);
  if (instance) return instance;
  instance = std::shared_ptr<MpiRuntime>(new MpiRuntime());
  std::atexit([] { instance->shutdown(); });
  return instance;
}

MpiRuntime::~MpiRuntime() { shutdown(); }

void MpiRuntime::enqueue(std::unique_ptr<Op> op) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!stopping_) {
      queue_.push_back(std::move(op));
      cv_.notify_one();
      return;
    }
  }
  op->work->complete(std::make_exception_ptr(
      compat::make_error(c10::str("[mpi] ", op->name, ": MPI has already been shut down in this process"))));
}

void MpiRuntime::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return;
    stopping_ = true;
    cv_.notify_one();
  }
  if (thread_.joinable()) thread_.join();
}

MpiRuntime::MpiRuntime() {
  std::promise<std::string> started;
  auto result = started.get_future();
  thread_ = std::thread([this, &started] { run(started); });
  const std::string error = result.get();
  if (!error.empty()) {
    thread_.join();
    C10_THROW_ERROR(Error, error);
  }
}

void MpiRuntime::run(std::promise<std::string>& started) {
  int provided = 0;
  int code = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
  if (code != MPI_SUCCESS) {
    started.set_value("[mpi] MPI_Init_thread failed: " + mpi_error_text(code));
    return;
  }
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size_);
  started.set_value("");

  bool abandoned = false;
  while (true) {
    std::unique_ptr<Op> op;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) break;
      op = std::move(queue_.front());
      queue_.pop_front();
    }
    if (!broken_.empty()) {
      op->work->complete(std::make_exception_ptr(compat::make_error(
          c10::str("[mpi] ", op->name, ": the process group is unusable since an earlier failure: ", broken_))));
      continue;
    }
    if (!execute(*op)) {
      abandoned = true;
      abandoned_.push_back(std::move(op));  // MPI may still write into its buffers
    }
  }
  if (!abandoned) MPI_Finalize();
}

// Runs one operation to completion; false when it was abandoned at its timeout.
//
// Note [Large collectives block]
// Open MPI's non-blocking collectives use generic algorithms that are 1.6-1.8x slower here
// for large payloads than its tuned blocking ones (6 MiB allreduce: 2.1 ms against 1.1 ms on
// two processes). A blocking call cannot be timed out, though, so a large operation first
// waits, polled and bounded by the timeout like any other, in a non-blocking barrier: once
// every rank has arrived, the blocking call can only stall if a peer dies, and then mpirun
// ends the job.
bool MpiRuntime::execute(Op& op) {
  std::vector<MPI_Request> requests;
  try {
    if (op.blocking) {
      requests.emplace_back();
      check_mpi(MPI_Ibarrier(*op.comm, &requests.back()), op.name, "MPI_Ibarrier");
    } else {
      op.start(*op.comm, requests);
    }
  } catch (...) {
    for (auto& request : requests) MPI_Wait(&request, MPI_STATUS_IGNORE);
    op.work->complete(std::current_exception());
    return true;
  }
  if (!wait_all(op, requests)) return false;
  try {
    if (op.blocking) op.blocking(*op.comm);
    if (op.done) op.done();
    op.work->complete(nullptr);
  } catch (...) {
    op.work->complete(std::current_exception());
  }
  return true;
}

// Polls `requests` to completion; false (the operation failed and the group is broken) on an
// MPI error or at the operation's timeout.
bool MpiRuntime::wait_all(Op& op, std::vector<MPI_Request>& requests) {
  const auto begin = Clock::now();
  const auto deadline = op.timeout.count() > 0 ? begin + op.timeout : Clock::time_point::max();
  auto sleep_for = std::chrono::microseconds(10);
  while (!requests.empty()) {
    int flag = 0;
    const int code = MPI_Testall(static_cast<int>(requests.size()), requests.data(), &flag, MPI_STATUSES_IGNORE);
    if (code != MPI_SUCCESS) {
      broken_ = c10::str(op.name, " failed: ", mpi_error_text(code));
      op.work->complete(std::make_exception_ptr(compat::make_error(c10::str("[mpi] ", broken_))));
      return false;
    }
    if (flag) return true;
    const auto now = Clock::now();
    if (now >= deadline) {
      broken_ = c10::str(op.name, " timed out after ", seconds_text(op.timeout));
      op.work->complete(std::make_exception_ptr(compat::make_error(
          c10::str("[mpi] ", op.name, " did not complete within the process group's timeout of ",
                   seconds_text(op.timeout), " (a process skipped it, or is stuck or dead)"))));
      return false;
    }
    // Spin briefly for small messages, then yield for a while, then sleep ever longer (capped).
    // Note [Waiting by yielding]: a peer that arrives a few milliseconds later (it is still
    // finishing its backward pass) is met at once instead of after a sleep of up to 0.5 ms.
    // Yielding costs nothing when the caller waits for this collective (the reducer's last
    // bucket, at the end of the backward pass) and gives the core away whenever another thread
    // wants it. On W1 (2 processes, MPI) it raised the step rate by ~8%.
    const auto waited = now - begin;
    if (waited < std::chrono::microseconds(50)) continue;
    if (waited < std::chrono::milliseconds(5)) {
      sched_yield();
      continue;
    }
    std::this_thread::sleep_for(sleep_for);
    sleep_for = std::min<std::chrono::microseconds>(sleep_for * 2, std::chrono::microseconds(500));
  }
  return true;
}

}  // namespace accelerate::detail::mpi
