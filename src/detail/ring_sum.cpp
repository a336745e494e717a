// Ring sums of 16-bit tensors; see ring_sum.h.
#include "detail/ring_sum.h"

#include "detail/check.h"
#include "detail/collective_watch.h"
#include "detail/half_math.h"
#include "detail/torch_compat.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <exception>
#include <vector>

namespace accelerate::detail {

// Note [Ring sums of 16-bit buckets]
// The fp16 and bf16 compression hooks exist to halve the bytes of DDP's bucket sums, and over
// Gloo an allreduce of a 16-bit tensor does not deliver that: Debian's LibTorch 1.13 sums fp16
// element by element in a generic loop (a 28 MB fp16 sum takes over three times as long as the
// 56 MB fp32 one, so the hook made a step slower while halving its bytes), cannot sum bf16 at
// all, and LibTorch 2.14's Gloo refuses both. So over Gloo the hooks sum around a ring of their
// own, built on the process group's point-to-point messages, which move bytes whatever their
// dtype:
// - The tensor is cut into p pieces (piece c holds elements [c n / p, (c + 1) n / p)). In p - 1
//   steps of a reduce-scatter, process r sends piece (r - s) mod p to the next process, receives
//   piece (r - s - 1) mod p from the previous one and adds it into its own (each 16-bit value
//   widened to fp32 and the sum rounded once, as ATen adds; Note [fp16 arithmetic of the
//   compression hook] in half_math.cpp). Process r then holds the whole sum of piece
//   (r + 1) mod p; p - 1 steps of an all-gather pass the summed pieces on, each copied as
//   received. Every process ends with the bits of the pieces' owners: the same
//   bits everywhere, which DDP needs. With two processes each element is one rounded addition,
//   the exact 16-bit sum.
// - Each process sends 2 (p - 1) / p of the tensor's bytes, as a ring allreduce does, counted as
//   one collective in the process's communication counters.
// - The sums run on a thread of the RingSum, one tensor after the other in the order the reducer
//   handed them over (which every process shares: the reducer's bucket order), so a bucket's sum
//   overlaps with the rest of the backward pass as the process group's own allreduce would. All
//   messages of a ring use the ring's tag: between two processes they are matched in the order
//   posted, and each step waits for its send and its oldest receive before the next begins. Two
//   rings (two models with compression hooks) have tags of their own.
// - Each receive is posted a step ahead (into the second of two buffers in the reduce-scatter),
//   for Gloo sends a message only once the receiver has said it waits for it: posted when the
//   step began, that notice crossed the link while the sender still sent the step before, and
//   the link no longer idles a round trip and a wake-up of three threads at every step. On W13's
//   1 Gbit/s link a 14 MB bucket's sum took 186-204 ms when each receive was posted at its own
//   step, and a median of 181 ms since, against 177 ms for its bytes at the measured rate.
// - A send or receive not completed within the timeout (a peer died, or skipped its backward
//   pass) fails the bucket's future with a message naming this process, its peers and the
//   timeout; the pending message is aborted, and every later sum of this RingSum fails at once
//   (Gloo closes a pair whose message timed out: the group is broken, as after any collective
//   that timed out). Sums still queued when the RingSum is destroyed fail without running.
namespace {

// The tags of the rings' messages: one per RingSum, numbered in the order the group's processes
// make them, which is the same on every process (the models are prepared in the same order), so
// two models' rings never take each other's messages. Gloo's collectives build their slots with
// prefixes of their own, so raw point-to-point tags do not meet them.
constexpr int kFirstRingTag = 0x52530000;  // "RS"

struct Piece {
  int64_t begin;
  int64_t length;
};

Piece piece_of(int64_t n, int p, int c) {
  const int64_t begin = n * c / p;
  return {begin, n * (c + 1) / p - begin};
}

}  // namespace

RingSum::RingSum(c10::intrusive_ptr<c10d::ProcessGroup> group, int number, std::chrono::milliseconds timeout,
                 std::string api)
    : group_(std::move(group)),
      timeout_(timeout),
      api_(std::move(api)),
      tag_(kFirstRingTag + (number & 0xffff)),
      worker_([this] { run(); }) {}

RingSum::~RingSum() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  ready_.notify_all();
  worker_.join();
}

c10::intrusive_ptr<c10::ivalue::Future> RingSum::sum(at::Tensor tensor) {
  TORCH_INTERNAL_ASSERT(tensor.dim() == 1 && tensor.is_contiguous(), "RingSum sums flat, contiguous tensors");
  auto done = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
  count_unwatched(all_reduce_sent(group_->getSize(), bytes_of(tensor)));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    tasks_.push_back({std::move(tensor), done});
  }
  ready_.notify_one();
  return done;
}

void RingSum::run() {
  for (;;) {
    Task task;
    bool stopping = false;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      ready_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
      stopping = stopping_;
    }
    if (failed_.empty() && stopping) {
      failed_ = "[" + api_ + "] the ring sum of a compressed gradient bucket was abandoned: its model was destroyed";
    }
    if (!failed_.empty()) {
      task.done->setError(std::make_exception_ptr(compat::make_error(failed_)));
      continue;
    }
    try {
      sum_now(task.tensor);
      task.done->markCompleted(c10::IValue(task.tensor));
    } catch (const std::exception& e) {
      failed_ = e.what();
      task.done->setError(std::make_exception_ptr(compat::make_error(failed_)));
    }
  }
}

void RingSum::sum_now(at::Tensor& tensor) {
  const int p = group_->getSize();
  if (p <= 1) return;
  at::NoGradGuard no_grad;
  const int r = group_->getRank();
  const int next = (r + 1) % p, previous = (r + p - 1) % p;
  const int64_t n = tensor.numel();
  const auto piece = [&](int c) { return piece_of(n, p, ((c % p) + p) % p); };
  const auto part = [&](const Piece& c) { return tensor.narrow(0, c.begin, c.length); };
  // Two buffers for the reduce-scatter's incoming pieces: the next step's receive is posted into
  // one while the current step's piece is added from the other. Kept for the next sums (a
  // bucket's are as large every step): fresh ones were new pages from the kernel every time.
  const int64_t largest = n / p + 1;  // no piece is longer
  for (auto& buffer : incoming_) {
    if (!buffer.defined() || buffer.numel() < largest || buffer.scalar_type() != tensor.scalar_type()) {
      buffer = at::empty({largest}, tensor.options());
    }
  }

  // The receives posted and not yet waited for, oldest first, and the send under way: aborted
  // when one fails.
  std::deque<c10::intrusive_ptr<c10d::Work>> receives;
  c10::intrusive_ptr<c10d::Work> sending;
  const auto fail = [&](const std::exception& e) {
    receives.push_back(sending);
    for (auto& work : receives) {
      if (work && !work->isCompleted()) {
        try {
          work->abort();
        } catch (const std::exception&) {
        }
      }
    }
    C10_THROW_ERROR(Error, c10::str("[", api_, "] the ring sum of a compressed gradient bucket failed on process ", r,
                                    " of ", p, " (sending to process ", next, ", receiving from process ", previous,
                                    "): a peer died, skipped its backward pass, or did not arrive within ",
                                    timeout_.count() / 1000.0, "s: ", error_text(e)));
  };
  // Posts a receive from the previous process (none for an empty piece: the sender skips it too).
  const auto post_receive = [&](const at::Tensor& into) {
    try {
      std::vector<at::Tensor> tensors{into};
      receives.push_back(into.numel() > 0 ? group_->recv(tensors, previous, tag_) : c10::intrusive_ptr<c10d::Work>());
    } catch (const std::exception& e) {
      fail(e);
    }
  };
  // Sends `out` to the next process and waits for it and for the oldest receive posted.
  const auto step = [&](const at::Tensor& out) {
    try {
      if (out.numel() > 0) {
        std::vector<at::Tensor> tensors{out};
        sending = group_->send(tensors, next, tag_);
        sending->wait(timeout_);
        sending.reset();
      }
      if (receives.front()) receives.front()->wait(timeout_);
      receives.pop_front();
    } catch (const std::exception& e) {
      fail(e);
    }
  };

  // The reduce-scatter: step s sends piece r - s and receives piece r - s - 1, added into this
  // process's own. Each step's receive is posted a step ahead, so that the previous process
  // finds it waiting when it sends (Note [Ring sums of 16-bit buckets]).
  const int steps = p - 1;
  post_receive(incoming_[0].narrow(0, 0, piece(r - 1).length));
  for (int s = 0; s < steps; ++s) {
    if (s + 1 < steps) {
      post_receive(incoming_[(s + 1) % 2].narrow(0, 0, piece(r - s - 2).length));
    } else if (s > 0) {
      // The all-gather's first receive fills piece r, which only step 0 reads (it sends it).
      post_receive(part(piece(r)));
    }
    step(part(piece(r - s)));
    const Piece in = piece(r - s - 1);
    const at::Tensor own = part(in);
    add_out(own, own, incoming_[s % 2].narrow(0, 0, in.length));
  }
  if (steps == 1) post_receive(part(piece(r)));
  // The all-gather of the summed pieces: step s sends piece r + 1 - s (summed here, or received
  // the step before) and receives piece r - s, as it arrives.
  for (int s = 0; s < steps; ++s) {
    if (s + 1 < steps) post_receive(part(piece(r - s - 1)));
    step(part(piece(r + 1 - s)));
  }
}

}  // namespace accelerate::detail
