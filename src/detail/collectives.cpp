// Collectives over a state's process group; see collectives.h.
#include "detail/collectives.h"

#include "detail/check.h"
#include "detail/collective_watch.h"
#include "detail/state_impl.h"
#include "detail/torch_compat.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/serialize.h>

#include <cstring>
#include <sstream>

namespace accelerate::detail {
namespace {

std::string collective_failure(const PartialState& state, const char* api, const std::exception& e) {
  return c10::str("[", api, "] the collective failed on process ", state.process_index(), " of ",
                  state.num_processes(), " (a peer died, skipped it, or did not arrive within ",
                  state.timeout().count() / 1000.0, "s): ", collective_error_text(state, e));
}

// Starts `operation` through `start` (which returns its work) and waits for it, turning a
// failure or a timeout into an error that names the API; the wait is watched (Note [The
// collective watch]).
template <typename Start>
void run(const PartialState& state, const char* operation, uint64_t sent, const char* api, Start&& start) {
  const auto ticket = enter_collective(state, operation, sent);
  watch_wait(state, ticket, start(), api, collective_failure);
}

c10d::ReduceOp to_c10d(Reduction r) {
  switch (r) {
    case Reduction::kSum:
    case Reduction::kMean: return c10d::ReduceOp::SUM;
    case Reduction::kMax: return c10d::ReduceOp::MAX;
    case Reduction::kMin: return c10d::ReduceOp::MIN;
    case Reduction::kProduct: return c10d::ReduceOp::PRODUCT;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown reduction");
}

// 16-bit floats, which Gloo cannot reduce or move on every release: reductions and the generic
// collectives run them as float, gathers move their bytes.
bool needs_float_path(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf;
}

std::string signature(const at::Tensor& t, ShapeCheck check) {
  std::ostringstream out;
  if (!t.defined()) {
    out << "no tensor";
    return out.str();
  }
  out << "dtype " << t.scalar_type() << ", device " << t.device();
  if (check == ShapeCheck::kExact) {
    out << ", shape " << t.sizes();
  } else if (check == ShapeCheck::kTrailing) {
    out << ", shape [*";
    for (int64_t d = 1; d < t.dim(); ++d) out << ", " << t.size(d);
    out << "]";
  } else {
    out << ", " << t.dim() << " dims";
  }
  return out.str();
}

std::vector<std::vector<char>> raw_all_gather_bytes(const PartialState& state, const std::vector<char>& bytes,
                                                    const char* api) {
  auto pg = process_group(state, api);
  const int n = state.num_processes();
  // First the lengths, then payloads padded to the longest one.
  std::vector<at::Tensor> mine{on_collective_device(state, at::tensor({static_cast<int64_t>(bytes.size())}, at::kLong))};
  std::vector<std::vector<at::Tensor>> lengths(1);
  for (int i = 0; i < n; ++i) lengths[0].push_back(at::empty_like(mine[0]));
  run(state, "all_gather", all_gather_sent(n, bytes_of(mine[0])), api, [&] { return pg->allgather(lengths, mine); });
  int64_t longest = 0;
  for (auto& l : lengths[0]) longest = std::max(longest, l.item<int64_t>());
  auto payload = at::zeros({std::max<int64_t>(longest, 1)}, at::kByte);
  if (!bytes.empty()) std::memcpy(payload.data_ptr(), bytes.data(), bytes.size());
  std::vector<at::Tensor> send{on_collective_device(state, payload)};
  std::vector<std::vector<at::Tensor>> recv(1);
  for (int i = 0; i < n; ++i) recv[0].push_back(at::empty_like(send[0]));
  run(state, "all_gather", all_gather_sent(n, bytes_of(send[0])), api, [&] { return pg->allgather(recv, send); });
  std::vector<std::vector<char>> out(n);
  for (int i = 0; i < n; ++i) {
    const auto len = static_cast<size_t>(lengths[0][i].item<int64_t>());
    const auto received = recv[0][i].cpu();
    const char* data = static_cast<const char*>(received.data_ptr());
    out[i].assign(data, data + len);
  }
  return out;
}

}  // namespace

Reduction parse_reduction(const std::string& name, const char* api) {
  if (name == "sum") return Reduction::kSum;
  if (name == "mean") return Reduction::kMean;
  if (name == "max") return Reduction::kMax;
  if (name == "min") return Reduction::kMin;
  if (name == "prod" || name == "product") return Reduction::kProduct;
  C10_THROW_ERROR(ValueError, c10::str("[", api, "] expected a reduction among sum, mean, max, min, prod, got '",
                                       name, "'"));
}

// Note [Debug-mode collective check]
// Before a collective in debug mode, every process contributes a one-line signature of what it
// is about to do (operation, dtype, device, shape as far as the operation requires them to agree)
// through an all-gather of bytes whose lengths may differ. Every process then compares all
// signatures, so a mismatch raises on every process with the same table instead of hanging on
// one side or failing on the main process only.
void verify_signature(const PartialState& state, const char* api, const std::string& signature,
                      const char* must_agree) {
  if (!state.debug() || !state.use_distributed()) return;
  // The calling API is part of it, so that two different operations on alike tensors disagree.
  const std::string line = signature + ", from " + api_in_context(api);
  auto all = raw_all_gather_bytes(state, std::vector<char>(line.begin(), line.end()), api);
  bool same = true;
  for (const auto& s : all) same = same && std::string(s.begin(), s.end()) == line;
  if (same) return;
  std::ostringstream table;
  for (size_t i = 0; i < all.size(); ++i) {
    table << "\n  process " << i << ": " << std::string(all[i].begin(), all[i].end());
  }
  C10_THROW_ERROR(ValueError, c10::str("[", api, "] debug mode found processes disagreeing on a collective (every "
                                       "process must ", must_agree, "):", table.str()));
}

void verify_collective(const PartialState& state, const char* api, const at::Tensor& tensor, ShapeCheck check) {
  if (!state.debug() || !state.use_distributed()) return;
  verify_signature(state, api, signature(tensor, check),
                   "call the same operation with the same dtype, device and shape");
}

at::Tensor on_collective_device(const PartialState& state, const at::Tensor& t) {
  if (!t.is_cpu() || state.device().is_cpu() || !state.use_distributed()) return t;
  if (process_group(state, "collectives")->getBackendName() != "nccl") return t;
  return t.to(state.device());
}

std::vector<at::Tensor> all_gather(const PartialState& state, const at::Tensor& tensor, const char* api) {
  if (!state.use_distributed()) return {tensor};
  verify_collective(state, api, tensor, ShapeCheck::kExact);
  auto pg = process_group(state, api);
  const bool cast = needs_float_path(tensor);
  at::Tensor send = on_collective_device(state, (cast ? tensor.to(at::kFloat) : tensor).contiguous());
  std::vector<at::Tensor> inputs{send};
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int i = 0; i < state.num_processes(); ++i) outputs[0].push_back(at::empty_like(send));
  run(state, "all_gather", all_gather_sent(state.num_processes(), bytes_of(send)), api,
      [&] { return pg->allgather(outputs, inputs); });
  for (auto& t : outputs[0]) t = t.to(tensor.device(), tensor.scalar_type());
  return outputs[0];
}

at::Tensor pass_to_next(const PartialState& state, const at::Tensor& tensor, at::IntArrayRef incoming,
                        const char* api) {
  if (!state.use_distributed()) return tensor;
  verify_collective(state, api, tensor, ShapeCheck::kDtypeOnly);
  auto pg = process_group(state, api);
  const int n = state.num_processes(), rank = state.process_index();
  const bool cast = needs_float_path(tensor);
  at::Tensor send = on_collective_device(state, (cast ? tensor.to(at::kFloat) : tensor).contiguous().view(-1));
  at::Tensor received = at::empty(incoming, send.options());
  at::Tensor flat = received.view(-1);
  std::vector<int64_t> send_splits(static_cast<size_t>(n), 0), receive_splits(static_cast<size_t>(n), 0);
  send_splits[static_cast<size_t>((rank + 1) % n)] = send.numel();
  receive_splits[static_cast<size_t>((rank + n - 1) % n)] = flat.numel();
  run(state, "all_to_all", bytes_of(send), api,
      [&] { return compat::all_to_all_single(*pg, flat, send, receive_splits, send_splits); });
  return received.to(tensor.device(), tensor.scalar_type());
}

at::Tensor broadcast(const PartialState& state, const at::Tensor& tensor, int from_process, const char* api) {
  TORCH_CHECK_INDEX(from_process >= 0 && from_process < state.num_processes(), "[", api, "] from_process ",
                    from_process, " is outside [0, ", state.num_processes(), ")");
  if (!state.use_distributed()) return tensor;
  verify_collective(state, api, tensor, ShapeCheck::kExact);
  auto pg = process_group(state, api);
  const bool cast = needs_float_path(tensor);
  std::vector<at::Tensor> buf{on_collective_device(state, (cast ? tensor.to(at::kFloat) : tensor).contiguous().clone())};
  c10d::BroadcastOptions opts;
  opts.rootRank = from_process;
  const auto sent = broadcast_sent(state.num_processes(), state.process_index() == from_process, bytes_of(buf[0]));
  run(state, "broadcast", sent, api, [&] { return pg->broadcast(buf, opts); });
  return buf[0].to(tensor.device(), tensor.scalar_type());
}

at::Tensor all_reduce(const PartialState& state, const at::Tensor& tensor, Reduction reduction, const char* api) {
  if (!state.use_distributed()) return tensor.clone();
  verify_collective(state, api, tensor, ShapeCheck::kExact);
  auto pg = process_group(state, api);
  const bool cast = needs_float_path(tensor);
  std::vector<at::Tensor> buf{on_collective_device(state, (cast ? tensor.to(at::kFloat) : tensor).contiguous().clone())};
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(reduction);
  run(state, "all_reduce", all_reduce_sent(state.num_processes(), bytes_of(buf[0])), api,
      [&] { return pg->allreduce(buf, opts); });
  at::Tensor out = buf[0];
  if (reduction == Reduction::kMean) {
    out = out.is_floating_point() ? out.div_(state.num_processes()) : out.div(state.num_processes());
  }
  return out.to(tensor.device(), tensor.scalar_type());
}

namespace {

// Starts gathering every process's flat `input` into the flat `output`.
PendingCollective start_all_gather_into(const PartialState& state, at::Tensor& output, at::Tensor& input,
                                        const char* api) {
  auto pg = process_group(state, api);
  // Gathering moves bits: 16-bit floats travel as their bytes, which every back-end moves (Gloo
  // of LibTorch 1.13 refuses bf16 and 16-bit integers, that of 2.14 fp16 and bf16 alike).
  const bool as_bytes = needs_float_path(input);
  at::Tensor in = as_bytes ? input.view({-1}).view(at::kByte) : input;
  at::Tensor out = as_bytes ? output.view({-1}).view(at::kByte) : output;
  const auto ticket = enter_collective(state, "all_gather", all_gather_sent(state.num_processes(), bytes_of(in)));
  if (compat::has_flat_collectives(*pg)) return {compat::all_gather_single(*pg, out, in), nullptr, ticket};
  // The list form, into views of `output` (Note [LibTorch releases]).
  std::vector<std::vector<at::Tensor>> outputs(1);
  const int64_t n = in.numel();
  for (int r = 0; r < state.num_processes(); ++r) outputs[0].push_back(out.narrow(0, r * n, n));
  std::vector<at::Tensor> inputs{in};
  return {pg->allgather(outputs, inputs), nullptr, ticket};
}

}  // namespace

PendingCollective all_gather_into_async(const PartialState& state, at::Tensor& output, at::Tensor& input,
                                        const char* api) {
  if (!state.use_distributed()) {
    output.copy_(input);
    return {};
  }
  verify_collective(state, api, input, ShapeCheck::kExact);
  return start_all_gather_into(state, output, input, api);
}

// One output for every process's piece, not a list to concatenate: a gather makes one buffer of
// the result's size, which the process's pool serves again on the next call (Note [One pool for
// the process's large CPU buffers]).
at::Tensor all_gather_cat(const PartialState& state, const at::Tensor& tensor, const char* api) {
  TORCH_CHECK_VALUE(tensor.dim() >= 1, "[", api, "] expected a tensor of at least one dimension, got a 0-dim one");
  if (!state.use_distributed()) return tensor;
  verify_collective(state, api, tensor, ShapeCheck::kExact);
  at::Tensor send = on_collective_device(state, tensor.contiguous());
  std::vector<int64_t> sizes = send.sizes().vec();
  sizes[0] *= state.num_processes();
  at::Tensor out = at::empty(sizes, send.options());
  at::Tensor flat_in = send.view({-1});
  at::Tensor flat_out = out.view({-1});
  auto pending = start_all_gather_into(state, flat_out, flat_in, api);
  wait_collective(state, pending, api);
  return out.to(tensor.device());
}

void all_gather_into(const PartialState& state, at::Tensor& output, at::Tensor& input, const char* api) {
  auto pending = all_gather_into_async(state, output, input, api);
  wait_collective(state, pending, api);
}

namespace {

// Starts the sum of `input` over the processes, this process's piece into `output`.
PendingCollective start_reduce_scatter(const PartialState& state, const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                       at::Tensor& output, at::Tensor& input) {
  const int processes = state.num_processes();
  if (compat::has_flat_collectives(*pg)) {
    // Gloo's flat reduce-scatter (LibTorch 2.x) sums the whole input as an allreduce does.
    const auto sent = pg->getBackendName() == "gloo" ? all_reduce_sent(processes, bytes_of(input))
                                                     : reduce_scatter_sent(processes, bytes_of(input));
    const auto ticket = enter_collective(state, "reduce_scatter", sent);
    return {compat::reduce_scatter_single(*pg, output, input), nullptr, ticket};
  }
  const auto ticket = enter_collective(state, "reduce_scatter", all_reduce_sent(processes, bytes_of(input)));
  // An allreduce of the whole input, of which this process keeps its piece: the same sums.
  std::vector<at::Tensor> tensors{input};
  const int64_t offset = static_cast<int64_t>(state.process_index()) * output.numel();
  return {pg->allreduce(tensors),
          [output, input, offset]() mutable { output.copy_(input.narrow(0, offset, output.numel())); }, ticket};
}

}  // namespace

PendingCollective reduce_scatter_sum_async(const PartialState& state, at::Tensor& output, at::Tensor& input,
                                           const char* api) {
  if (!state.use_distributed()) {
    output.copy_(input);
    return {};
  }
  verify_collective(state, api, input, ShapeCheck::kExact);
  auto pg = process_group(state, api);
  if (needs_float_path(input) && pg->getBackendName() == "gloo") {
    // Gloo does not sum half-precision types on every release: the sum runs in fp32 and is
    // rounded once into `output` (as our MPI group does inside its reductions).
    at::Tensor wide_input = input.to(at::kFloat);
    at::Tensor wide_output = at::empty(output.sizes(), output.options().dtype(at::kFloat));
    auto pending = start_reduce_scatter(state, pg, wide_output, wide_input);
    return {pending.work,
            [finish = std::move(pending.finish), output, wide_output, wide_input]() mutable {
              if (finish) finish();
              output.copy_(wide_output);
            },
            pending.ticket};
  }
  return start_reduce_scatter(state, pg, output, input);
}

void wait_collective(const PartialState& state, PendingCollective& pending, const char* api) {
  if (pending.work) watch_wait(state, pending.ticket, pending.work, api, collective_failure);
  if (pending.finish) pending.finish();
  pending = {};
}

void reduce_scatter_sum(const PartialState& state, at::Tensor& output, at::Tensor& input, const char* api) {
  auto pending = reduce_scatter_sum_async(state, output, input, api);
  wait_collective(state, pending, api);
}

std::vector<std::vector<char>> all_gather_bytes(const PartialState& state, const std::vector<char>& bytes,
                                                const char* api) {
  if (!state.use_distributed()) return {bytes};
  verify_collective(state, api, at::empty({0}, at::kByte), ShapeCheck::kDtypeOnly);
  return raw_all_gather_bytes(state, bytes, api);
}

std::vector<char> broadcast_bytes(const PartialState& state, const std::vector<char>& bytes, int from_process,
                                  const char* api) {
  if (!state.use_distributed()) return bytes;
  verify_collective(state, api, at::empty({0}, at::kByte), ShapeCheck::kDtypeOnly);
  auto length = broadcast(state, at::tensor({static_cast<int64_t>(bytes.size())}, at::kLong), from_process, api);
  const auto n = length.item<int64_t>();
  auto payload = at::zeros({std::max<int64_t>(n, 1)}, at::kByte);
  if (state.process_index() == from_process && n > 0) std::memcpy(payload.data_ptr(), bytes.data(), bytes.size());
  payload = broadcast(state, payload, from_process, api);
  const char* data = static_cast<const char*>(payload.data_ptr());
  return std::vector<char>(data, data + n);
}

std::vector<c10::IValue> all_gather_ivalue(const PartialState& state, const c10::IValue& value, const char* api) {
  if (!state.use_distributed()) return {value};
  auto all = all_gather_bytes(state, torch::pickle_save(value), api);
  std::vector<c10::IValue> out;
  out.reserve(all.size());
  for (const auto& bytes : all) out.push_back(torch::pickle_load(bytes));
  return out;
}

c10::IValue broadcast_ivalue(const PartialState& state, const c10::IValue& value, int from_process, const char* api) {
  if (!state.use_distributed()) return value;
  const bool sender = state.process_index() == from_process;
  auto bytes = broadcast_bytes(state, sender ? torch::pickle_save(value) : std::vector<char>{}, from_process, api);
  return torch::pickle_load(bytes);
}

}  // namespace accelerate::detail
