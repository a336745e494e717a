// A program for the process-group tests: every collective of the group the launcher set up,
// checked against values each rank can compute by itself, then the library's own operations on
// top of it. Prints "ok <name>" per check and exits 1 at the first wrong value.
//
//   collectives all              every check below
//   collectives skip RANK [large] RANK skips an allreduce (of 400 KB with "large"; group timeout
//                                2 s); the others print the error they get and exit 3
//   collectives die RANK         RANK kills itself with SIGKILL while the others wait in an
//                                allreduce
#include "accelerate/state.h"
#include "accelerate/utils/operations.h"
#include "detail/process_group_mpi.h"
#include "detail/state_impl.h"
#include "detail/torch_compat.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <csignal>
#include <iostream>
#include <string>
#include <thread>
#include <unistd.h>

namespace {

int failures = 0;

void check(bool ok, const std::string& name, const std::string& detail = "") {
  if (ok) {
    std::cout << "ok " << name << std::endl;
    return;
  }
  std::cout << "WRONG " << name << " " << detail << std::endl;
  ++failures;
}

bool same(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() && at::equal(a, b);
}

std::string str(const at::Tensor& t) {
  std::ostringstream out;
  out << t;
  return out.str();
}

// A tensor every rank can compute for any rank r: [r*10 + 0, r*10 + 1, ...].
at::Tensor of_rank(int r, int64_t n, at::ScalarType type = at::kFloat) {
  return (at::arange(n, at::kDouble) + r * 10).to(type);
}

void run_all(const accelerate::PartialState& state) {
  auto pg = state.impl()->process_group;
  if (!pg) {
    // One process has no group of its own; the MPI group still works at size 1.
    accelerate::detail::Topology one;
    pg = accelerate::detail::make_mpi_process_group(one, std::chrono::seconds(60));
  }
  const int rank = state.process_index();
  const int n = state.num_processes();
  const int64_t len = 5;

  // allreduce: every op, several types, non-contiguous input, bf16/fp16 through float.
  at::Tensor expected_sum = at::zeros({len}, at::kDouble);
  at::Tensor expected_prod = at::ones({len}, at::kDouble);
  for (int r = 0; r < n; ++r) {
    expected_sum += of_rank(r, len, at::kDouble);
    expected_prod *= of_rank(r, len, at::kDouble) + 1;
  }
  for (auto type : {at::kFloat, at::kDouble, at::kInt, at::kLong, at::kBFloat16, at::kHalf, at::kByte}) {
    auto t = of_rank(rank, len, type);
    std::vector<at::Tensor> v{t};
    pg->allreduce(v)->wait();
    check(same(t, expected_sum.to(type)), std::string("allreduce sum ") + c10::toString(type), str(t));
  }
  {
    auto t = of_rank(rank, len, at::kDouble) + 1;
    std::vector<at::Tensor> v{t};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::PRODUCT;
    pg->allreduce(v, o)->wait();
    check(same(t, expected_prod), "allreduce product", str(t));
    for (auto [op, name, value] : {std::tuple{c10d::ReduceOp::MIN, "min", 0.0},
                                   std::tuple{c10d::ReduceOp::MAX, "max", (n - 1) * 10.0}}) {
      auto m = of_rank(rank, len);
      std::vector<at::Tensor> mv{m};
      c10d::AllreduceOptions mo;
      mo.reduceOp = op;
      pg->allreduce(mv, mo)->wait();
      check(same(m, at::arange(len, at::kFloat) + value), std::string("allreduce ") + name, str(m));
    }
    auto a = of_rank(rank, len);
    std::vector<at::Tensor> av{a};
    c10d::AllreduceOptions ao;
    ao.reduceOp = c10d::ReduceOp::AVG;
    pg->allreduce(av, ao)->wait();
    check(at::allclose(a, (expected_sum / n).to(at::kFloat)), "allreduce avg", str(a));
    auto b = at::full({1}, rank == 0, at::kBool);
    std::vector<at::Tensor> bv{b};
    pg->allreduce(bv)->wait();
    check(b.item<bool>(), "allreduce bool (any)");
  }
  {
    // A strided view: the result lands in the view, the rest of the base is untouched.
    auto base = at::full({len, 2}, -1.0f);
    auto view = base.select(1, 0);
    view.copy_(of_rank(rank, len));
    std::vector<at::Tensor> v{view};
    pg->allreduce(v)->wait();
    check(same(base.select(1, 0), expected_sum.to(at::kFloat)) && same(base.select(1, 1), at::full({len}, -1.0f)),
          "allreduce non-contiguous", str(base));
  }
  {
    std::vector<at::Tensor> parts{of_rank(rank, 3), of_rank(rank, 4) * 2};
    pg->allreduce_coalesced(parts)->wait();
    at::Tensor s3 = at::zeros({3}), s4 = at::zeros({4});
    for (int r = 0; r < n; ++r) {
      s3 += of_rank(r, 3);
      s4 += of_rank(r, 4) * 2;
    }
    check(same(parts[0], s3) && same(parts[1], s4), "allreduce_coalesced");
  }
  // broadcast from the last rank, of an int64 tensor and a bf16 one.
  for (auto type : {at::kLong, at::kBFloat16}) {
    auto t = of_rank(rank, len, type);
    std::vector<at::Tensor> v{t};
    c10d::BroadcastOptions o;
    o.rootRank = n - 1;
    pg->broadcast(v, o)->wait();
    check(same(t, of_rank(n - 1, len, type)), std::string("broadcast ") + c10::toString(type), str(t));
  }
  // reduce to rank 0.
  {
    auto t = of_rank(rank, len);
    std::vector<at::Tensor> v{t};
    c10d::ReduceOptions o;
    o.rootRank = 0;
    pg->reduce(v, o)->wait();
    check(rank != 0 || same(t, expected_sum.to(at::kFloat)), "reduce", str(t));
  }
  // allgather, gather, scatter.
  {
    auto in = of_rank(rank, len, at::kInt);
    std::vector<at::Tensor> outs;
    for (int r = 0; r < n; ++r) outs.push_back(at::zeros({len}, at::kInt));
    std::vector<std::vector<at::Tensor>> out_lists{outs};
    std::vector<at::Tensor> ins{in};
    pg->allgather(out_lists, ins)->wait();
    bool ok = true;
    for (int r = 0; r < n; ++r) ok = ok && same(out_lists[0][r], of_rank(r, len, at::kInt));
    check(ok, "allgather");

    auto flat = at::zeros({n * len}, at::kInt);
    accelerate::detail::compat::all_gather_single(*pg, flat, in)->wait();
    ok = true;
    for (int r = 0; r < n; ++r) ok = ok && same(flat.narrow(0, r * len, len), of_rank(r, len, at::kInt));
    check(ok, "allgather into one tensor");

    std::vector<std::vector<at::Tensor>> gathered;
    if (rank == 0) {
      gathered.emplace_back();
      for (int r = 0; r < n; ++r) gathered[0].push_back(at::zeros({len}, at::kInt));
    }
    c10d::GatherOptions go;
    go.rootRank = 0;
    pg->gather(gathered, ins, go)->wait();
    ok = true;
    if (rank == 0) {
      for (int r = 0; r < n; ++r) ok = ok && same(gathered[0][r], of_rank(r, len, at::kInt));
    }
    check(ok, "gather");

    std::vector<std::vector<at::Tensor>> to_scatter;
    if (rank == n - 1) {
      to_scatter.emplace_back();
      for (int r = 0; r < n; ++r) to_scatter[0].push_back(of_rank(r, len, at::kInt) * 3);
    }
    std::vector<at::Tensor> mine{at::zeros({len}, at::kInt)};
    c10d::ScatterOptions so;
    so.rootRank = n - 1;
    pg->scatter(mine, to_scatter, so)->wait();
    check(same(mine[0], of_rank(rank, len, at::kInt) * 3), "scatter", str(mine[0]));
  }
  // reduce_scatter: rank r gets the sum over ranks of their r-th input.
  {
    std::vector<std::vector<at::Tensor>> inputs(1);
    for (int r = 0; r < n; ++r) inputs[0].push_back(of_rank(rank, len) + r * 100);
    std::vector<at::Tensor> out{at::zeros({len})};
    pg->reduce_scatter(out, inputs)->wait();
    check(same(out[0], expected_sum.to(at::kFloat) + n * rank * 100.0f), "reduce_scatter", str(out[0]));
    auto flat_in = at::cat(inputs[0]);
    auto flat_out = at::zeros({len});
    accelerate::detail::compat::reduce_scatter_single(*pg, flat_out, flat_in)->wait();
    check(same(flat_out, out[0]), "reduce_scatter from one tensor", str(flat_out));
  }
  // alltoall: rank r sends [r*10 + d] to rank d, in equal and in uneven splits.
  {
    auto in = at::arange(n, at::kLong) + rank * 10;
    auto out = at::zeros({n}, at::kLong);
    std::vector<int64_t> none;
    accelerate::detail::compat::all_to_all_single(*pg, out, in, none, none)->wait();
    check(same(out, at::arange(n, at::kLong) * 10 + rank), "alltoall", str(out));
    // Uneven: rank r sends d+1 copies of (r*10 + d) to rank d, so rank d receives r... each d+1 times.
    std::vector<int64_t> send_splits, recv_splits;
    std::vector<at::Tensor> parts, expected;
    for (int d = 0; d < n; ++d) {
      send_splits.push_back(d + 1);
      parts.push_back(at::full({d + 1}, rank * 10 + d, at::kLong));
      recv_splits.push_back(rank + 1);
      expected.push_back(at::full({rank + 1}, d * 10 + rank, at::kLong));
    }
    auto uneven_in = at::cat(parts);
    auto uneven_out = at::zeros({n * (rank + 1)}, at::kLong);
    accelerate::detail::compat::all_to_all_single(*pg, uneven_out, uneven_in, recv_splits, send_splits)->wait();
    check(same(uneven_out, at::cat(expected)), "alltoall uneven", str(uneven_out));
    std::vector<at::Tensor> outs, ins;
    for (int d = 0; d < n; ++d) {
      ins.push_back(at::full({2}, rank * 10 + d, at::kLong));
      outs.push_back(at::zeros({2}, at::kLong));
    }
    pg->alltoall(outs, ins)->wait();
    bool ok = true;
    for (int d = 0; d < n; ++d) ok = ok && same(outs[d], at::full({2}, d * 10 + rank, at::kLong));
    check(ok, "alltoall of tensor lists");
  }
  // Payloads from 256 KiB on take the blocking path (after an arrival barrier).
  {
    const int64_t big = 100000;  // 400 KB of floats
    auto t = at::full({big}, static_cast<float>(rank + 1));
    std::vector<at::Tensor> v{t};
    pg->allreduce(v)->wait();
    check(same(t, at::full({big}, n * (n + 1) / 2.0f)), "allreduce large");
    // The ring allreduce (Note [A ring allreduce]): every element its own value, a length no
    // process count divides, blocks of several 1 MiB segments; sums of floats, integers and bf16
    // (reduced in fp32), the average, and a maximum (Open MPI's own algorithm).
    {
      const int64_t wide = 3 * 300001 + 1;
      const auto position = at::arange(wide, at::kDouble);
      const double ranks = n * (n + 1) / 2.0, rank_sum = n * (n - 1) / 2.0;
      bool ok = true;
      std::string detail;
      for (auto type : {at::kFloat, at::kLong}) {
        auto x = (position * (rank + 1) + rank).to(type);
        std::vector<at::Tensor> xv{x};
        pg->allreduce(xv)->wait();
        const auto expected = (position * ranks + rank_sum).to(type);
        if (!same(x, expected)) {
          ok = false;
          detail += std::string(c10::toString(type)) + " " + str((x - expected).abs().argmax());
        }
      }
      check(ok, "allreduce large varied", detail);
      auto avg = (position * (rank + 1) + rank).to(at::kFloat);
      std::vector<at::Tensor> av{avg};
      c10d::AllreduceOptions ao;
      ao.reduceOp = c10d::ReduceOp::AVG;
      pg->allreduce(av, ao)->wait();
      check(at::allclose(avg, ((position * ranks + rank_sum) / n).to(at::kFloat)), "allreduce large avg");
      auto top = (position * (rank + 1)).to(at::kFloat);
      std::vector<at::Tensor> tv{top};
      c10d::AllreduceOptions mo;
      mo.reduceOp = c10d::ReduceOp::MAX;
      pg->allreduce(tv, mo)->wait();
      check(same(top, (position * n).to(at::kFloat)), "allreduce large max");
      auto small_ints = (position.remainder(7) + rank).to(at::kBFloat16);
      std::vector<at::Tensor> bv{small_ints};
      pg->allreduce(bv)->wait();
      check(same(small_ints, (position.remainder(7) * n + rank_sum).to(at::kBFloat16)), "allreduce large BFloat16");
    }
    auto b = at::full({big}, static_cast<float>(rank));
    std::vector<at::Tensor> bv{b};
    c10d::BroadcastOptions o;
    o.rootRank = n - 1;
    pg->broadcast(bv, o)->wait();
    check(same(b, at::full({big}, static_cast<float>(n - 1))), "broadcast large");
    auto in = at::full({big}, static_cast<float>(rank));
    auto flat = at::zeros({n * big});
    accelerate::detail::compat::all_gather_single(*pg, flat, in)->wait();
    bool ok = true;
    for (int r = 0; r < n; ++r) ok = ok && same(flat.narrow(0, r * big, big), at::full({big}, static_cast<float>(r)));
    check(ok, "allgather large");
    // Rank r gets the sum of every rank's r-th piece: sum over q of (q + 1) * (r + 1).
    auto pieces = at::full({n * big}, static_cast<float>(rank + 1)) * (at::arange(n * big) / big + 1).floor();
    auto mine = at::zeros({big});
    accelerate::detail::compat::reduce_scatter_single(*pg, mine, pieces)->wait();
    check(same(mine, at::full({big}, (n * (n + 1) / 2.0f) * (rank + 1))), "reduce_scatter large", str(mine));
    // Every element its own value (a block or an element out of place shows), the input left as
    // it was, in every reduction and in bf16 (reduced in fp32); blocks of more than one 1 MiB
    // segment of the ring's, the last one partial.
    {
      const int64_t wide = 300001;
      auto varied = at::arange(n * wide, at::kFloat) * (rank + 1) + rank;
      const auto sent = varied.clone();
      const auto own = at::arange(rank * wide, (rank + 1) * wide, at::kFloat);
      auto result = at::zeros({wide});
      accelerate::detail::compat::reduce_scatter_single(*pg, result, varied)->wait();
      check(same(result, own * (n * (n + 1) / 2.0f) + n * (n - 1) / 2.0f) && same(varied, sent),
            "reduce_scatter large segments", str(result.narrow(0, 0, 8)));
    }
    const auto position = at::arange(n * big, at::kFloat);
    auto varied = position * (rank + 1) + rank;
    const auto sent = varied.clone();
    const auto own = at::arange(rank * big, (rank + 1) * big, at::kFloat);
    const float ranks = n * (n + 1) / 2.0f, rank_sum = n * (n - 1) / 2.0f;
    mine.zero_();
    accelerate::detail::compat::reduce_scatter_single(*pg, mine, varied)->wait();
    check(same(mine, own * ranks + rank_sum) && same(varied, sent), "reduce_scatter large varied", str(mine.narrow(0, 0, 8)));
    const std::vector<std::pair<c10d::ReduceOp::RedOpType, at::Tensor>> reductions{
        {c10d::ReduceOp::AVG, own * (ranks / n) + rank_sum / n}, {c10d::ReduceOp::MAX, own * n + (n - 1)}};
    for (const auto& [op, expected] : reductions) {
      std::vector<std::vector<at::Tensor>> inputs(1);
      for (int r = 0; r < n; ++r) inputs[0].push_back(varied.narrow(0, r * big, big));
      std::vector<at::Tensor> out{at::zeros({big})};
      c10d::ReduceScatterOptions o;
      o.reduceOp = op;
      pg->reduce_scatter(out, inputs, o)->wait();
      check(at::allclose(out[0], expected), std::string("reduce_scatter large ") + (op == c10d::ReduceOp::AVG ? "avg" : "max"),
            str(out[0].narrow(0, 0, 8)));
    }
    auto halves = at::full({n * big}, static_cast<float>(rank + 1), at::kBFloat16);
    auto half = at::zeros({big}, at::kBFloat16);
    accelerate::detail::compat::reduce_scatter_single(*pg, half, halves)->wait();
    check(same(half, at::full({big}, ranks, at::kBFloat16)), "reduce_scatter large BFloat16", str(half.narrow(0, 0, 8)));
  }
  // The future a Reducer chains on carries the result.
  {
    auto t = of_rank(rank, len);
    std::vector<at::Tensor> v{t};
    auto future = pg->allreduce(v)->getFuture();
    future->wait();
    check(same(future->value().toTensorVector()[0], expected_sum.to(at::kFloat)), "allreduce future");
  }
  pg->barrier()->wait();
  check(true, "barrier");

  // The library on top: operations, object collectives, triggers.
  auto gathered = accelerate::gather(state, at::full({2}, rank, at::kLong));
  check(same(gathered, at::arange(n, at::kLong).repeat_interleave(2)), "operations gather", str(gathered));
  auto reduced = accelerate::reduce(state, at::full({2}, static_cast<float>(rank)), "sum");
  check(same(reduced, at::full({2}, n * (n - 1) / 2.0f)), "operations reduce", str(reduced));
  auto objects = accelerate::gather_object(state, std::vector<std::string>{"r" + std::to_string(rank)});
  check(static_cast<int>(objects.size()) == n && objects.back() == "r" + std::to_string(n - 1), "gather_object");
  auto padded = accelerate::pad_across_processes(state, at::ones({rank + 1}));
  check(padded.size(0) == n, "pad_across_processes");
  if (rank == n - 1) state.set_trigger();
  check(state.check_trigger(), "trigger");
  state.wait_for_everyone();
  check(true, "wait_for_everyone");
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "all";
  const int target = argc > 2 ? std::stoi(argv[2]) : -1;
  try {
    accelerate::PartialStateOptions options;
    // Only where a rank skips the collective does the timeout end it; where one dies, the others
    // are stopped by the launcher, and a short timeout would race that (a slow machine's rank 0
    // timing out first would become the root cause).
    if (mode == "skip") options.init_kwargs.timeout = std::chrono::seconds(2);
    accelerate::PartialState state(options);
    std::cout << "backend " << (state.backend().empty() ? "none" : state.backend()) << " processes " << state.num_processes() << std::endl;
    const int rank = state.process_index();
    if (mode == "all") {
      run_all(state);
      return failures == 0 ? 0 : 1;
    }
    auto pg = state.impl()->process_group;
    // "large" uses a payload past the blocking threshold, whose wait is an arrival barrier.
    const bool large = argc > 3 && std::string(argv[3]) == "large";
    std::vector<at::Tensor> v{at::ones({large ? 100000 : 4})};
    if (mode == "skip") {
      if (rank == target) {
        std::this_thread::sleep_for(std::chrono::seconds(20));  // outlives the others' timeout
        return 0;
      }
      try {
        pg->allreduce(v)->wait();
        std::cout << "allreduce completed without rank " << target << std::endl;
        return 1;
      } catch (const std::exception& e) {
        std::cout << "error: " << e.what() << std::endl;
        return 3;
      }
    }
    if (mode == "die") {
      pg->allreduce(v)->wait();  // everyone is in the group
      if (rank == target) {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        ::kill(::getpid(), SIGKILL);
      }
      pg->allreduce(v)->wait();
      std::cout << "allreduce completed without rank " << target << std::endl;
      return 0;
    }
    std::cerr << "unknown mode " << mode << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 4;
  }
}
