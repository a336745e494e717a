// Sums of 16-bit tensors around a ring of point-to-point messages, for the DDP compression hooks
// over Gloo (Note [Ring sums of 16-bit buckets]).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue_inl.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>

namespace accelerate::detail {

/// Sums tensors in place over the processes of a process group, one tensor after the other in
/// the order they were given, on a thread of its own: a ring reduce-scatter then a ring all-gather
/// of sends and receives, the additions ATen's in the tensor's own dtype, so every process ends
/// with the same bits and each sends 2(p-1)/p of the tensor's bytes.
class RingSum {
 public:
  /// `number` tells the rings of one group apart (every process numbers its rings alike: the
  /// group's `rings_made`); `api` names the caller in errors; a send or receive that has not
  /// completed within `timeout` fails the sum.
  RingSum(c10::intrusive_ptr<c10d::ProcessGroup> group, int number, std::chrono::milliseconds timeout,
          std::string api);
  ~RingSum();
  RingSum(const RingSum&) = delete;
  RingSum& operator=(const RingSum&) = delete;

  /// Starts summing the flat, contiguous `tensor` in place; the future completes with `tensor`
  /// once it holds the sum, or fails naming this process, the peer and the timeout. After a
  /// failure every later sum fails at once (the processes no longer agree where the ring is).
  /// `tensor` must be a CPU tensor: Gloo's messages move host memory.
  c10::intrusive_ptr<c10::ivalue::Future> sum(at::Tensor tensor);

 private:
  struct Task {
    at::Tensor tensor;
    c10::intrusive_ptr<c10::ivalue::Future> done;
  };
  void run();
  void sum_now(at::Tensor& tensor);

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::chrono::milliseconds timeout_;
  std::string api_;
  int tag_;  // of this ring's messages
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<Task> tasks_;
  bool stopping_ = false;
  std::string failed_;  // the first failure's message, once there is one
  at::Tensor incoming_[2];  // the reduce-scatter's receive buffers, kept between sums (the worker's)
  std::thread worker_;
};

}  // namespace accelerate::detail
