// Context parallelism: the sequence of each batch split over the processes of a context-parallel
// group, attention computed as ring attention over them (upstream:
// `accelerator.maybe_context_parallel`, PyTorch's `context_parallel`). A `ContextParallel` is a
// scope: while it lives, the given tensors hold this process's piece of their sequence dimension
// and `accelerate::scaled_dot_product_attention` exchanges keys and values with the group; when
// it ends they hold their whole sequence again (except those listed as not to restore).
//
// Pieces are load-balanced for causal attention: the sequence is cut into 2·cp chunks (the first
// ones one token longer when cp does not divide it) and process i of the group takes chunk i and
// chunk 2·cp−1−i, so every process does the same share of a causal mask's work. Positional
// tensors (position ids, rotary tables) must be among the split tensors so that each token keeps
// its position.
//
// Example (one training step of a causal language model):
//   auto ids = batch.data, labels = batch.target;
//   {
//     auto cp = accelerator.maybe_context_parallel({ids, labels}, {1, 1}, /*no_restore_buffers=*/{ids, labels});
//     auto logits = model(ids);  // its attention calls accelerate::scaled_dot_product_attention
//     auto loss = torch::nn::functional::cross_entropy(logits.flatten(0, 1), labels.flatten()) * cp.loss_weight();
//     accelerator.backward(loss);
//   }
#pragma once

#include "accelerate/state.h"

#include <ATen/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace accelerate {

namespace detail::context_parallel {
struct ContextParallelImpl;
}  // namespace detail::context_parallel

class ContextParallel {
 public:
  /// A scope that changes nothing (context parallelism off, or a group of one process).
  ContextParallel();
  /// Splits each of `buffers` along its `buffer_seq_dims` entry over the processes of `group`
  /// (all of one sequence length, at least 2 tokens per process), in place: every handle to those
  /// tensors sees this process's piece. `no_restore_buffers` (a subset of `buffers`) keep their
  /// piece when the scope ends; the others get their whole tensor back. `cp_comm_strategy` is
  /// "allgather" or "alltoall" (see `TorchContextParallelConfig`). With a group of one process
  /// nothing is split. Throws `c10::ValueError` naming a bad argument, before changing anything.
  ContextParallel(const PartialState& group, const std::vector<at::Tensor>& buffers,
                  const std::vector<int64_t>& buffer_seq_dims, const std::vector<at::Tensor>& no_restore_buffers = {},
                  const std::string& cp_comm_strategy = "allgather");
  ContextParallel(ContextParallel&& other) noexcept;
  ContextParallel& operator=(ContextParallel&&) = delete;
  ContextParallel(const ContextParallel&) = delete;
  ContextParallel& operator=(const ContextParallel&) = delete;
  /// Restores the buffers and ends ring attention on this thread.
  ~ContextParallel();

  /// Whether sequences are split (a group of more than one process).
  bool enabled() const;
  /// The whole sequence's length (0 when not enabled).
  int64_t sequence_length() const;
  /// The positions in the whole sequence of this process's tokens, in their local order (every
  /// position when not enabled: empty).
  at::Tensor positions() const;
  /// The factor that turns the mean of a per-token loss over this process's tokens into this
  /// process's share of the mean over the whole sequence, once gradients are averaged over the
  /// group (local tokens × cp ÷ sequence length; 1 when the pieces are equal or not enabled).
  double loss_weight() const;
  /// The whole sequence of `piece` (this process's piece along `seq_dim`), gathered from the
  /// group and put back in order, on every process of the group: per-token outputs and metrics
  /// without a token counted twice.
  at::Tensor gather_sequence(const at::Tensor& piece, int64_t seq_dim) const;

 private:
  std::shared_ptr<detail::context_parallel::ContextParallelImpl> impl_;  // shared with recomputations
};

}  // namespace accelerate
