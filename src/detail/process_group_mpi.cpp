// The MPI process group: c10d's collectives as the operations MPI's one thread runs (Note [One
// MPI thread] in mpi_runtime.h), their tensors checked, staged in buffers MPI can use and written
// back; large sums go around the ring of mpi_ring.h. See process_group_mpi.h.
#include "detail/process_group_mpi.h"

#include "detail/mpi_ring.h"
#include "detail/mpi_runtime.h"
#include "detail/process_group.h"
#include "detail/torch_compat.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <functional>
#include <memory>

namespace accelerate::detail {
namespace {

using mpi::check_mpi;
using mpi::count_of;
using mpi::MpiRuntime;
using mpi::MpiWork;
using mpi::Op;
using mpi::ring_allreduce_sum;
using mpi::ring_reduce_scatter_sum;

// ---- Types and buffers ----------------------------------------------------------------------

// The MPI type that moves elements of `t` without arithmetic, and how many per element.
std::pair<MPI_Datatype, int> raw_type(const at::Tensor& t) {
  switch (t.element_size()) {
    case 1: return {MPI_UINT8_T, 1};
    case 2: return {MPI_UINT16_T, 1};
    case 4: return {MPI_UINT32_T, 1};
    case 8: return {MPI_UINT64_T, 1};
    case 16: return {MPI_UINT64_T, 2};
    default: C10_THROW_ERROR(TypeError, c10::str("[mpi] unsupported element size for ", t.scalar_type()));
  }
}

// The MPI type for reductions over `type` (bf16/fp16 are reduced as float).
MPI_Datatype reduce_type(at::ScalarType type, const char* op) {
  switch (type) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kChar: return MPI_INT8_T;
    case at::kByte: return MPI_UINT8_T;
    case at::kShort: return MPI_INT16_T;
    case at::kInt: return MPI_INT32_T;
    case at::kLong: return MPI_INT64_T;
    case at::kBool: return MPI_C_BOOL;
    default:
      C10_THROW_ERROR(TypeError, c10::str("[mpi] ", op, ": cannot reduce tensors of type ", type,
                                          " (supported: floating point, integer and bool)"));
  }
}

bool reduced_as_float(at::ScalarType type) { return type == at::kHalf || type == at::kBFloat16; }

MPI_Op mpi_op(c10d::ReduceOp::RedOpType op, at::ScalarType type, const char* name) {
  const bool boolean = type == at::kBool;
  switch (op) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::AVG: return boolean ? MPI_LOR : MPI_SUM;
    case c10d::ReduceOp::PRODUCT: return boolean ? MPI_LAND : MPI_PROD;
    case c10d::ReduceOp::MIN: return boolean ? MPI_LAND : MPI_MIN;
    case c10d::ReduceOp::MAX: return boolean ? MPI_LOR : MPI_MAX;
    case c10d::ReduceOp::BAND:
    case c10d::ReduceOp::BOR:
    case c10d::ReduceOp::BXOR:
      TORCH_CHECK_VALUE(!at::isFloatingType(type), "[mpi] ", name, ": bitwise reductions need integer tensors, got ",
                        type);
      return op == c10d::ReduceOp::BAND ? MPI_BAND : op == c10d::ReduceOp::BOR ? MPI_BOR : MPI_BXOR;
    default: C10_THROW_ERROR(ValueError, c10::str("[mpi] ", name, ": reduce operation ", static_cast<int>(op), " is not supported"));
  }
}

// A contiguous buffer MPI can use for `t`: `t` itself when possible, else a copy (converted to
// float for 16-bit reductions). `write_back` puts the buffer's contents into `t`.
struct Staged {
  at::Tensor user;
  at::Tensor buffer;
  void write_back() const {
    if (!buffer.is_same(user)) user.copy_(buffer);
  }
};

Staged stage(const at::Tensor& t, bool for_reduction) {
  Staged s{t, t};
  if (for_reduction && reduced_as_float(t.scalar_type())) {
    s.buffer = t.to(at::kFloat).contiguous();
  } else if (!t.is_contiguous()) {
    s.buffer = t.contiguous();
  }
  return s;
}

void check_cpu(const at::Tensor& t, const char* op) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "[mpi] ", op, ": the MPI back-end handles CPU tensors only, got a tensor on ",
                    t.device(), " (use \"nccl\" for GPU tensors)");
}

const at::Tensor& single(const std::vector<at::Tensor>& tensors, const char* op) {
  TORCH_CHECK_VALUE(tensors.size() == 1, "[mpi] ", op, ": expected exactly one tensor per process, got ",
                    tensors.size());
  check_cpu(tensors[0], op);
  return tensors[0];
}

void check_like(const at::Tensor& t, const at::Tensor& reference, const char* op, const char* what) {
  check_cpu(t, op);
  TORCH_CHECK_VALUE(t.scalar_type() == reference.scalar_type() && t.numel() == reference.numel(), "[mpi] ", op, ": ",
                    what, " must match the input's type and size (", reference.scalar_type(), ", ", reference.numel(),
                    " elements), got ", t.scalar_type(), " with ", t.numel(), " elements");
}

void check_root(int64_t root, int size, const char* op) {
  TORCH_CHECK_VALUE(root >= 0 && root < size, "[mpi] ", op, ": root rank ", root, " is outside [0, ", size, ")");
}

// Divides in place after an AVG reduction (integer types divide with truncation, like PyTorch).
void finish_average(const at::Tensor& t, c10d::ReduceOp::RedOpType op, int size) {
  if (op != c10d::ReduceOp::AVG) return;
  if (at::isFloatingType(t.scalar_type())) {
    t.div_(size);
  } else {
    t.div_(size, "trunc");
  }
}

// ---- The process group ----------------------------------------------------------------------

// Payloads from this size on use Open MPI's blocking algorithms; see Note [Large collectives block].
constexpr int64_t kBlockingBytes = 256 * 1024;

class ProcessGroupMPI final : public compat::BackendBase {
 public:
  // With `color` < 0 the group of every process; else the group of the processes that pass the
  // same color, numbered by `rank` (a split, which waits for every process of the job).
  ProcessGroupMPI(std::shared_ptr<MpiRuntime> runtime, int rank, int size, std::chrono::milliseconds timeout,
                  int color = -1)
      : compat::BackendBase(rank, size), runtime_(std::move(runtime)), timeout_(timeout) {
    // The group's own communicator, so that its collectives never mix with another group's.
    auto comm = std::make_shared<MPI_Comm>(MPI_COMM_NULL);
    comm_ = comm;
    c10::intrusive_ptr<c10d::Work> work;
    if (color < 0) {
      work = submit(c10d::OpType::UNKNOWN, "process-group creation", {}, [comm](MPI_Comm, std::vector<MPI_Request>& r) {
        r.emplace_back();
        check_mpi(MPI_Comm_idup(MPI_COMM_WORLD, comm.get(), &r.back()), "process-group creation", "MPI_Comm_idup");
      }, nullptr, /*world=*/true);
      work->wait(kNoTimeout);
    } else {
      // MPI has no non-blocking split: it runs once every process has arrived (Note [Large
      // collectives block]), so that a missing process fails at the timeout instead of hanging.
      const int key = rank;
      work = submit(c10d::OpType::UNKNOWN, "process-group split", {}, [](MPI_Comm, std::vector<MPI_Request>&) {},
                    nullptr, /*world=*/true, {}, [comm, color, key](MPI_Comm world) {
                      check_mpi(MPI_Comm_split(world, color, key, comm.get()), "process-group split", "MPI_Comm_split");
                    }, kBlockingBytes);
      work->wait(kNoTimeout);
    }
    MPI_Comm_set_errhandler(*comm_, MPI_ERRORS_RETURN);
  }

  ~ProcessGroupMPI() override {
    // Freeing is local in practice; done on the MPI thread, which skips it if MPI already ended.
    auto comm = comm_;
    auto ring = ring_comm_;
    auto op = std::make_unique<Op>();
    op->name = "process-group destruction";
    op->work = c10::make_intrusive<MpiWork>(rank_, c10d::OpType::UNKNOWN, op->name, std::vector<at::Tensor>{});
    op->comm = comm_.get();
    op->start = [comm, ring](MPI_Comm, std::vector<MPI_Request>&) {
      if (*ring != MPI_COMM_NULL) MPI_Comm_free(ring.get());
      if (*comm != MPI_COMM_NULL) MPI_Comm_free(comm.get());
    };
    runtime_->enqueue(std::move(op));
  }

  const std::string getBackendName() const override { return "mpi"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    const char* name = "broadcast";
    const at::Tensor& t = single(tensors, name);
    check_root(opts.rootRank, size_, name);
    auto s = std::make_shared<Staged>(stage(t, false));
    const int root = static_cast<int>(opts.rootRank);
    return submit(c10d::OpType::BROADCAST, name, tensors, [s, root, name](MPI_Comm comm, std::vector<MPI_Request>& r) {
      auto [type, per] = raw_type(s->buffer);
      r.emplace_back();
      check_mpi(MPI_Ibcast(s->buffer.data_ptr(), count_of(s->buffer.numel() * per, name), type, root, comm, &r.back()),
                name, "MPI_Ibcast");
    }, [s] { s->write_back(); }, false, {s->buffer}, [s, root, name](MPI_Comm comm) {
      auto [type, per] = raw_type(s->buffer);
      check_mpi(MPI_Bcast(s->buffer.data_ptr(), count_of(s->buffer.numel() * per, name), type, root, comm), name,
                "MPI_Bcast");
    }, s->buffer.nbytes());
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    const char* name = "allreduce";
    const at::Tensor& t = single(tensors, name);
    return reduce_into(c10d::OpType::ALLREDUCE, name, t, opts.reduceOp.op_, -1, tensors);
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override {
    const char* name = "allreduce_coalesced";
    TORCH_CHECK_VALUE(!tensors.empty(), "[mpi] ", name, ": expected at least one tensor");
    for (const auto& t : tensors) {
      check_cpu(t, name);
      TORCH_CHECK_VALUE(t.scalar_type() == tensors[0].scalar_type(), "[mpi] ", name,
                        ": every tensor must have the same type, got ", tensors[0].scalar_type(), " and ",
                        t.scalar_type());
    }
    std::vector<at::Tensor> flat_parts;
    for (const auto& t : tensors) flat_parts.push_back(t.reshape({-1}));
    at::Tensor flat = at::cat(flat_parts);
    auto work = reduce_into(c10d::OpType::ALLREDUCE_COALESCED, name, flat, opts.reduceOp.op_, -1, tensors,
                            [flat, tensors]() {
                              int64_t offset = 0;
                              for (const auto& t : tensors) {
                                t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
                                offset += t.numel();
                              }
                            });
    return work;
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    const char* name = "reduce";
    const at::Tensor& t = single(tensors, name);
    check_root(opts.rootRank, size_, name);
    return reduce_into(c10d::OpType::REDUCE, name, t, opts.reduceOp.op_, static_cast<int>(opts.rootRank), tensors);
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions&) override {
    const char* name = "allgather";
    const at::Tensor& in = single(inputs, name);
    TORCH_CHECK_VALUE(outputs.size() == 1 && outputs[0].size() == static_cast<size_t>(size_), "[mpi] ", name,
                      ": expected one list of ", size_, " output tensors (one per process)");
    for (const auto& o : outputs[0]) check_like(o, in, name, "every output tensor");
    auto flat = at::empty({size_ * in.numel()}, in.options());
    auto input = in.contiguous();
    auto outs = outputs[0];
    return submit(c10d::OpType::ALLGATHER, name, outs, [flat, input, name](MPI_Comm comm, std::vector<MPI_Request>& r) {
      auto [type, per] = raw_type(input);
      const int count = count_of(input.numel() * per, name);
      r.emplace_back();
      check_mpi(MPI_Iallgather(input.data_ptr(), count, type, flat.data_ptr(), count, type, comm, &r.back()), name,
                "MPI_Iallgather");
    }, [flat, outs, n = in.numel()] {
      for (size_t i = 0; i < outs.size(); ++i) outs[i].copy_(flat.narrow(0, static_cast<int64_t>(i) * n, n).view(outs[i].sizes()));
    }, false, {flat, input}, [flat, input, name](MPI_Comm comm) {
      auto [type, per] = raw_type(input);
      const int count = count_of(input.numel() * per, name);
      check_mpi(MPI_Allgather(input.data_ptr(), count, type, flat.data_ptr(), count, type, comm), name, "MPI_Allgather");
    }, flat.nbytes());
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions&) override {
    const char* name = "allgather";
    check_cpu(input, name);
    check_cpu(output, name);
    TORCH_CHECK_VALUE(output.scalar_type() == input.scalar_type() && output.numel() == size_ * input.numel(), "[mpi] ",
                      name, ": the output must hold ", size_, " times the input's elements of type ",
                      input.scalar_type());
    auto in = input.contiguous();
    auto s = std::make_shared<Staged>(stage(output, false));
    return submit(c10d::OpType::_ALLGATHER_BASE, name, {output}, [in, s, name](MPI_Comm comm, std::vector<MPI_Request>& r) {
      auto [type, per] = raw_type(in);
      const int count = count_of(in.numel() * per, name);
      r.emplace_back();
      check_mpi(MPI_Iallgather(in.data_ptr(), count, type, s->buffer.data_ptr(), count, type, comm, &r.back()), name,
                "MPI_Iallgather");
    }, [s] { s->write_back(); }, false, {in, s->buffer}, [in, s, name](MPI_Comm comm) {
      auto [type, per] = raw_type(in);
      const int count = count_of(in.numel() * per, name);
      check_mpi(MPI_Allgather(in.data_ptr(), count, type, s->buffer.data_ptr(), count, type, comm), name,
                "MPI_Allgather");
    }, s->buffer.nbytes());
  }

  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) override {
    const char* name = "gather";
    const at::Tensor& in = single(inputs, name);
    check_root(opts.rootRank, size_, name);
    const int root = static_cast<int>(opts.rootRank);
    const bool is_root = rank_ == root;
    if (is_root) {
      TORCH_CHECK_VALUE(outputs.size() == 1 && outputs[0].size() == static_cast<size_t>(size_), "[mpi] ", name,
                        ": the root expects one list of ", size_, " output tensors");
      for (const auto& o : outputs[0]) check_like(o, in, name, "every output tensor");
    } else {
      TORCH_CHECK_VALUE(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()), "[mpi] ", name,
                        ": only the root rank ", root, " takes output tensors");
    }
    auto input = in.contiguous();
    auto flat = is_root ? at::empty({size_ * in.numel()}, in.options()) : at::Tensor();
    std::vector<at::Tensor> outs = is_root ? outputs[0] : std::vector<at::Tensor>{};
    return submit(c10d::OpType::GATHER, name, outs, [flat, input, root, name](MPI_Comm comm, std::vector<MPI_Request>& r) {
      auto [type, per] = raw_type(input);
      const int count = count_of(input.numel() * per, name);
      r.emplace_back();
      check_mpi(MPI_Igather(input.data_ptr(), count, type, flat.defined() ? flat.data_ptr() : nullptr, count, type, root,
                            comm, &r.back()),
                name, "MPI_Igather");
    }, [flat, outs, n = in.numel()] {
      for (size_t i = 0; i < outs.size(); ++i) outs[i].copy_(flat.narrow(0, static_cast<int64_t>(i) * n, n).view(outs[i].sizes()));
    }, false, {flat, input});
  }

  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    const char* name = "scatter";
    const at::Tensor& out = single(outputs, name);
    check_root(opts.rootRank, size_, name);
    const int root = static_cast<int>(opts.rootRank);
    const bool is_root = rank_ == root;
    at::Tensor flat;
    if (is_root) {
      TORCH_CHECK_VALUE(inputs.size() == 1 && inputs[0].size() == static_cast<size_t>(size_), "[mpi] ", name,
                        ": the root expects one list of ", size_, " input tensors");
      for (const auto& i : inputs[0]) check_like(i, out, name, "every input tensor");
      std::vector<at::Tensor> parts;
      for (const auto& i : inputs[0]) parts.push_back(i.reshape({-1}));
      flat = at::cat(parts);
    } else {
      TORCH_CHECK_VALUE(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()), "[mpi] ", name,
                        ": only the root rank ", root, " takes input tensors");
    }
    auto s = std::make_shared<Staged>(stage(out, false));
    return submit(c10d::OpType::SCATTER, name, outputs, [flat, s, root, name](MPI_Comm comm, std::vector<MPI_Request>& r) {
      auto [type, per] = raw_type(s->buffer);
      const int count = count_of(s->buffer.numel() * per, name);
      r.emplace_back();
      check_mpi(MPI_Iscatter(flat.defined() ? flat.data_ptr() : nullptr, count, type, s->buffer.data_ptr(), count, type,
                             root, comm, &r.back()),
                name, "MPI_Iscatter");
    }, [s] { s->write_back(); }, false, {flat, s->buffer});
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    const char* name = "reduce_scatter";
    const at::Tensor& out = single(outputs, name);
    TORCH_CHECK_VALUE(inputs.size() == 1 && inputs[0].size() == static_cast<size_t>(size_), "[mpi] ", name,
                      ": expected one list of ", size_, " input tensors (one per process)");
    for (const auto& i : inputs[0]) check_like(i, out, name, "every input tensor");
    std::vector<at::Tensor> parts;
    for (const auto& i : inputs[0]) parts.push_back(i.reshape({-1}));
    at::Tensor flat = at::cat(parts);
    return reduce_scatter_flat(c10d::OpType::REDUCE_SCATTER, name, out, flat, opts.reduceOp.op_, outputs);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    const char* name = "reduce_scatter";
    check_cpu(input, name);
    check_cpu(output, name);
    TORCH_CHECK_VALUE(input.scalar_type() == output.scalar_type() && input.numel() == size_ * output.numel(), "[mpi] ",
                      name, ": the input must hold ", size_, " times the output's elements of type ",
                      output.scalar_type());
    return reduce_scatter_flat(c10d::OpType::_REDUCE_SCATTER_BASE, name, output, input.reshape({-1}), opts.reduceOp.op_,
                               {output});
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions&) override {
    const char* name = "alltoall";
    check_cpu(input, name);
    check_cpu(output, name);
    TORCH_CHECK_VALUE(input.scalar_type() == output.scalar_type(), "[mpi] ", name,
                      ": input and output types differ (", input.scalar_type(), ", ", output.scalar_type(), ")");
    const int64_t in_row = input.dim() == 0 ? 1 : input.numel() / std::max<int64_t>(input.size(0), 1);
    const int64_t out_row = output.dim() == 0 ? 1 : output.numel() / std::max<int64_t>(output.size(0), 1);
    auto split_counts = [&](const std::vector<int64_t>& splits, const at::Tensor& t, int64_t row, const char* what) {
      std::vector<int64_t> counts(static_cast<size_t>(size_));
      if (splits.empty()) {
        TORCH_CHECK_VALUE(t.dim() > 0 && t.size(0) % size_ == 0, "[mpi] ", name, ": the ", what,
                          "'s first dimension must divide evenly among ", size_, " processes");
        for (auto& c : counts) c = t.numel() / size_;
      } else {
        TORCH_CHECK_VALUE(splits.size() == static_cast<size_t>(size_), "[mpi] ", name, ": expected ", size_, " ", what,
                          " split sizes, got ", splits.size());
        int64_t total = 0;
        for (size_t i = 0; i < splits.size(); ++i) {
          counts[i] = splits[i] * row;
          total += splits[i];
        }
        TORCH_CHECK_VALUE(total == (t.dim() == 0 ? 1 : t.size(0)), "[mpi] ", name, ": the ", what,
                          " split sizes add up to ", total, ", but its first dimension is ",
                          t.dim() == 0 ? 1 : t.size(0));
      }
      return counts;
    };
    auto send = split_counts(input_splits, input, in_row, "input");
    auto recv = split_counts(output_splits, output, out_row, "output");
    auto in = input.contiguous();
    auto s = std::make_shared<Staged>(stage(output, false));
    return alltoallv(c10d::OpType::ALLTOALL_BASE, name, in, s, send, recv, {output});
  }

  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions&) override {
    const char* name = "alltoall";
    TORCH_CHECK_VALUE(outputs.size() == static_cast<size_t>(size_) && inputs.size() == static_cast<size_t>(size_),
                      "[mpi] ", name, ": expected ", size_, " input and ", size_, " output tensors, got ",
                      inputs.size(), " and ", outputs.size());
    std::vector<int64_t> send, recv;
    std::vector<at::Tensor> in_parts, out_parts;
    for (int i = 0; i < size_; ++i) {
      check_cpu(inputs[i], name);
      check_cpu(outputs[i], name);
      TORCH_CHECK_VALUE(inputs[i].scalar_type() == inputs[0].scalar_type() &&
                            outputs[i].scalar_type() == inputs[0].scalar_type(),
                        "[mpi] ", name, ": every tensor must have the same type");
      send.push_back(inputs[i].numel());
      recv.push_back(outputs[i].numel());
      in_parts.push_back(inputs[i].reshape({-1}));
    }
    auto in = at::cat(in_parts);
    int64_t total = 0;
    for (auto c : recv) total += c;
    auto flat_out = at::empty({total}, inputs[0].options());
    auto s = std::make_shared<Staged>(Staged{flat_out, flat_out});
    auto work = alltoallv(c10d::OpType::ALLTOALL, name, in, s, send, recv, outputs, [flat_out, outputs]() {
      int64_t offset = 0;
      for (const auto& o : outputs) {
        o.copy_(flat_out.narrow(0, offset, o.numel()).view(o.sizes()));
        offset += o.numel();
      }
    });
    return work;
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    const char* name = "send";
    const at::Tensor& t = single(tensors, name);
    check_root(dst, size_, name);
    auto buffer = t.contiguous();
    return submit(c10d::OpType::SEND, name, tensors, [buffer, dst, tag, name](MPI_Comm comm, std::vector<MPI_Request>& r) {
      auto [type, per] = raw_type(buffer);
      r.emplace_back();
      check_mpi(MPI_Isend(buffer.data_ptr(), count_of(buffer.numel() * per, name), type, dst, tag, comm, &r.back()),
                name, "MPI_Isend");
    }, nullptr, false, {buffer});
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    const char* name = "recv";
    const at::Tensor& t = single(tensors, name);
    check_root(src, size_, name);
    auto s = std::make_shared<Staged>(stage(t, false));
    return submit(c10d::OpType::RECV, name, tensors, [s, src, tag, name](MPI_Comm comm, std::vector<MPI_Request>& r) {
      auto [type, per] = raw_type(s->buffer);
      r.emplace_back();
      check_mpi(MPI_Irecv(s->buffer.data_ptr(), count_of(s->buffer.numel() * per, name), type, src, tag, comm, &r.back()),
                name, "MPI_Irecv");
    }, [s] { s->write_back(); }, false, {s->buffer});
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override {
    const char* name = "barrier";
    return submit(c10d::OpType::BARRIER, name, {}, [name](MPI_Comm comm, std::vector<MPI_Request>& r) {
      r.emplace_back();
      check_mpi(MPI_Ibarrier(comm, &r.back()), name, "MPI_Ibarrier");
    }, nullptr);
  }

 private:
  c10::intrusive_ptr<MpiWork> submit(c10d::OpType type, const char* name, std::vector<at::Tensor> outputs,
                                     std::function<void(MPI_Comm, std::vector<MPI_Request>&)> start,
                                     std::function<void()> done, bool world = false,
                                     std::vector<at::Tensor> keep_alive = {},
                                     std::function<void(MPI_Comm)> blocking = nullptr, int64_t bytes = 0) {
    auto op = std::make_unique<Op>();
    op->name = name;
    op->start = std::move(start);
    if (bytes >= kBlockingBytes) op->blocking = std::move(blocking);  // Note [Large collectives block]
    op->done = std::move(done);
    op->timeout = timeout_;
    op->keep_alive = std::move(keep_alive);
    static MPI_Comm world_comm = MPI_COMM_WORLD;
    op->comm = world ? &world_comm : comm_.get();
    op->work = c10::make_intrusive<MpiWork>(rank_, type, name, std::move(outputs));
    auto work = op->work;
    runtime_->enqueue(std::move(op));
    return work;
  }

  // Reduces `t` across processes into every rank (root < 0) or into `root`.
  c10::intrusive_ptr<c10d::Work> reduce_into(c10d::OpType type, const char* name, const at::Tensor& t,
                                             c10d::ReduceOp::RedOpType reduce_op, int root, std::vector<at::Tensor> outputs,
                                             std::function<void()> after = nullptr) {
    check_cpu(t, name);
    const MPI_Datatype datatype = reduce_type(reduced_as_float(t.scalar_type()) ? at::kFloat : t.scalar_type(), name);
    const MPI_Op op = mpi_op(reduce_op, t.scalar_type(), name);
    auto s = std::make_shared<Staged>(stage(t, true));
    const int size = size_;
    const bool receives = root < 0 || root == rank_;
    auto blocking = [s, datatype, op, root, name, ring = ring_comm_](MPI_Comm comm) {
      if (root >= 0) return;  // reductions to one root stay non-blocking
      // MPI_SUM: never bool (MPI_LOR) nor complex (refused by reduce_type).
      if (op == MPI_SUM) return ring_allreduce_sum(comm, *ring, s->buffer, datatype, name);
      check_mpi(MPI_Allreduce(MPI_IN_PLACE, s->buffer.data_ptr(), count_of(s->buffer.numel(), name), datatype, op,
                              comm),
                name, "MPI_Allreduce");
    };
    return submit(type, name, std::move(outputs), [s, datatype, op, root, name](MPI_Comm comm, std::vector<MPI_Request>& r) {
      const int count = count_of(s->buffer.numel(), name);
      r.emplace_back();
      if (root < 0) {
        check_mpi(MPI_Iallreduce(MPI_IN_PLACE, s->buffer.data_ptr(), count, datatype, op, comm, &r.back()), name,
                  "MPI_Iallreduce");
      } else {
        int rank = 0;
        MPI_Comm_rank(comm, &rank);
        void* send = rank == root ? MPI_IN_PLACE : s->buffer.data_ptr();
        check_mpi(MPI_Ireduce(send, s->buffer.data_ptr(), count, datatype, op, root, comm, &r.back()), name,
                  "MPI_Ireduce");
      }
    }, [s, reduce_op, size, receives, after] {
      if (!receives) return;
      finish_average(s->buffer, reduce_op, size);
      s->write_back();
      if (after) after();
    }, false, {s->buffer}, blocking, root < 0 ? s->buffer.nbytes() : 0);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_flat(c10d::OpType type, const char* name, const at::Tensor& out,
                                                     const at::Tensor& flat_input, c10d::ReduceOp::RedOpType reduce_op,
                                                     std::vector<at::Tensor> outputs) {
    const bool as_float = reduced_as_float(out.scalar_type());
    const MPI_Datatype datatype = reduce_type(as_float ? at::kFloat : out.scalar_type(), name);
    const MPI_Op op = mpi_op(reduce_op, out.scalar_type(), name);
    auto in = as_float ? flat_input.to(at::kFloat).contiguous() : flat_input.contiguous();
    auto s = std::make_shared<Staged>(stage(out, true));
    const int size = size_;
    return submit(type, name, std::move(outputs), [in, s, datatype, op, name](MPI_Comm comm, std::vector<MPI_Request>& r) {
      r.emplace_back();
      check_mpi(MPI_Ireduce_scatter_block(in.data_ptr(), s->buffer.data_ptr(), count_of(s->buffer.numel(), name),
                                          datatype, op, comm, &r.back()),
                name, "MPI_Ireduce_scatter_block");
    }, [s, reduce_op, size] {
      finish_average(s->buffer, reduce_op, size);
      s->write_back();
    }, false, {in, s->buffer}, [in, s, datatype, op, name, ring = ring_comm_](MPI_Comm comm) {
      if (op == MPI_SUM) return ring_reduce_scatter_sum(comm, *ring, in, s->buffer, datatype, name);
      check_mpi(MPI_Reduce_scatter_block(in.data_ptr(), s->buffer.data_ptr(), count_of(s->buffer.numel(), name),
                                         datatype, op, comm),
                name, "MPI_Reduce_scatter_block");
    }, in.nbytes());
  }

  // Element counts per peer for input and output; both flattened.
  c10::intrusive_ptr<c10d::Work> alltoallv(c10d::OpType type, const char* name, const at::Tensor& in,
                                           std::shared_ptr<Staged> s, const std::vector<int64_t>& send_counts,
                                           const std::vector<int64_t>& recv_counts, std::vector<at::Tensor> outputs,
                                           std::function<void()> after = nullptr) {
    auto [datatype, per] = raw_type(in);
    auto to_int = [&, per = per](const std::vector<int64_t>& counts, std::vector<int>& c, std::vector<int>& d) {
      int64_t offset = 0;
      for (auto n : counts) {
        c.push_back(count_of(n * per, name));
        d.push_back(count_of(offset * per, name));
        offset += n;
      }
    };
    auto sc = std::make_shared<std::vector<int>>(), sd = std::make_shared<std::vector<int>>();
    auto rc = std::make_shared<std::vector<int>>(), rd = std::make_shared<std::vector<int>>();
    to_int(send_counts, *sc, *sd);
    to_int(recv_counts, *rc, *rd);
    return submit(type, name, std::move(outputs), [in, s, sc, sd, rc, rd, datatype = datatype, name](
                                                      MPI_Comm comm, std::vector<MPI_Request>& r) {
      r.emplace_back();
      check_mpi(MPI_Ialltoallv(in.data_ptr(), sc->data(), sd->data(), datatype, s->buffer.data_ptr(), rc->data(),
                               rd->data(), datatype, comm, &r.back()),
                name, "MPI_Ialltoallv");
    }, [s, after] {
      s->write_back();
      if (after) after();
    }, false, {in, s->buffer});
  }

  std::shared_ptr<MpiRuntime> runtime_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<MPI_Comm> comm_;
  // The ring's own communicator (Note [A ring reduce-scatter]), made by its first use.
  std::shared_ptr<MPI_Comm> ring_comm_ = std::make_shared<MPI_Comm>(MPI_COMM_NULL);
};

}  // namespace

c10::intrusive_ptr<c10d::ProcessGroup> make_mpi_subgroup(const Topology& topology, int color, int rank, int size,
                                                         std::chrono::milliseconds timeout) {
  auto runtime = MpiRuntime::get();
  TORCH_CHECK(runtime->world_size() == topology.world_size, "[process group] MPI's world has ", runtime->world_size(),
              " processes, the job ", topology.world_size);
  return compat::as_process_group(
      c10::make_intrusive<ProcessGroupMPI>(std::move(runtime), rank, size, timeout, color),
      c10::intrusive_ptr<c10d::Store>(c10::make_intrusive<c10d::HashStore>()), "mpi", {c10::kCPU});
}

c10::intrusive_ptr<c10d::ProcessGroup> make_mpi_process_group(const Topology& topology,
                                                              std::chrono::milliseconds timeout,
                                                              const c10::intrusive_ptr<c10d::Store>& store) {
  require_started_by_mpirun();
  auto runtime = MpiRuntime::get();
  TORCH_CHECK_VALUE(runtime->world_size() == topology.world_size && runtime->world_rank() == topology.rank,
                    "[PartialState] MPI started this process as rank ", runtime->world_rank(), " of ",
                    runtime->world_size(), ", but accelerate expects rank ", topology.rank, " of ",
                    topology.world_size, "; leave RANK/WORLD_SIZE unset under mpirun");
  return compat::as_process_group(
      c10::make_intrusive<ProcessGroupMPI>(std::move(runtime), topology.rank, topology.world_size, timeout),
      store ? store : c10::intrusive_ptr<c10d::Store>(c10::make_intrusive<c10d::HashStore>()), "mpi", {c10::kCPU});
}

}  // namespace accelerate::detail
