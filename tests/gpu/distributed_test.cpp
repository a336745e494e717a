// NCCL, the back-end of GPU processes: a one-process NCCL group on one GPU runs a collective, and
// two GPU ranks (threads of this process, one GPU each, c10d's own pattern) pick NCCL by
// themselves and exchange tensors, Python-style objects and trigger flags. Tests of two GPUs skip
// on machines with fewer; tests/gpu/launch_test.cpp runs real processes.
#include "accelerate/state.h"
#include "accelerate/utils/operations.h"
#include "detail/process_group.h"
#include "detail/torch_compat.h"
#include "support/gpu.h"
#include "support/test_support.h"

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/cuda.h>
#include <torch/torch.h>

namespace accelerate::testing {
namespace gpu_distributed_test {  // not anonymous: its names must not meet another file's in a unity batch

torch::Device gpu(int index) { return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index)); }

// The rendezvous of a one-process NCCL group over an in-memory store.
detail::RendezvousConfig one_process_nccl() {
  detail::RendezvousConfig config;
  config.topology.rank = 0;
  config.topology.world_size = 1;
  config.backend = "nccl";
  config.store = c10::make_intrusive<c10d::HashStore>();
  config.rdzv_timeout = std::chrono::seconds(30);
  config.collective_timeout = std::chrono::seconds(60);
  return config;
}

TEST(Nccl, AOneProcessGroupOnOneGpuGathersACudaTensor) {
  SKIP_WITHOUT_GPUS(1);
  auto rendezvous = detail::rendezvous(one_process_nccl());
  ASSERT_TRUE(rendezvous.process_group);

  auto input = torch::arange(1, 7, torch::TensorOptions().dtype(torch::kFloat).device(gpu(0)));
  std::vector<at::Tensor> inputs{input};
  // The output starts as zeros: only a collective that really ran fills it.
  std::vector<std::vector<at::Tensor>> outputs{{torch::zeros_like(input)}};
  rendezvous.process_group->allgather(outputs, inputs)->wait(std::chrono::seconds(60));
  torch::cuda::synchronize();
  EXPECT_TRUE(torch::equal(outputs[0][0].cpu(), input.cpu())) << outputs[0][0];

  std::vector<at::Tensor> sums{input.clone()};
  rendezvous.process_group->allreduce(sums)->wait(std::chrono::seconds(60));
  torch::cuda::synchronize();
  EXPECT_TRUE(torch::equal(sums[0].cpu(), input.cpu()));
}

// Every collective the library issues (collectives.cpp, distributed.cpp, the FSDP engine's flat
// ones through the adapter), on a one-process NCCL group: each output starts as zeros, so only a
// collective that ran fills it, and with one process each must equal its input.
TEST(Nccl, AOneProcessGroupOnOneGpuRunsEveryCollectiveTheLibraryIssues) {
  SKIP_WITHOUT_GPUS(1);
  auto group = detail::rendezvous(one_process_nccl()).process_group;
  ASSERT_TRUE(group);
  const auto timeout = std::chrono::milliseconds(60000);
  const auto input = torch::arange(1, 9, torch::TensorOptions().dtype(torch::kFloat).device(gpu(0)));
  auto expect_input = [&](const at::Tensor& out, const char* what) {
    torch::cuda::synchronize();
    EXPECT_TRUE(torch::equal(out.cpu(), input.cpu())) << what << ": " << out;
  };

  std::vector<at::Tensor> max{input.clone()};
  c10d::AllreduceOptions max_options;
  max_options.reduceOp = c10d::ReduceOp::MAX;
  group->allreduce(max, max_options)->wait(timeout);
  expect_input(max[0], "allreduce MAX");

  std::vector<at::Tensor> from_root{torch::zeros_like(input)};
  from_root[0].copy_(input);
  c10d::BroadcastOptions broadcast_options;
  broadcast_options.rootRank = 0;
  group->broadcast(from_root, broadcast_options)->wait(timeout);
  expect_input(from_root[0], "broadcast");

  at::Tensor flat_in = input.clone();
  at::Tensor flat_out = torch::zeros_like(input);
  ASSERT_TRUE(detail::compat::has_flat_collectives(*group)) << "NCCL has the flat collectives on every release";
  detail::compat::all_gather_single(*group, flat_out, flat_in)->wait(timeout);
  expect_input(flat_out, "all_gather_single");

  at::Tensor scattered = torch::zeros_like(input);
  detail::compat::reduce_scatter_single(*group, scattered, flat_in)->wait(timeout);
  expect_input(scattered, "reduce_scatter_single");

  at::Tensor exchanged = torch::zeros_like(input);
  std::vector<int64_t> out_splits, in_splits;
  detail::compat::all_to_all_single(*group, exchanged, flat_in, out_splits, in_splits)->wait(timeout);
  expect_input(exchanged, "all_to_all_single");

  group->barrier()->wait(timeout);
}

TEST(Nccl, TwoGpuRanksPickNcclAndGatherReduceAndBroadcastCudaTensors) {
  SKIP_WITHOUT_GPUS(2);
  std::vector<at::Tensor> gathered(2), reduced(2), broadcast_from_1(2);
  run_ranks(2, [&](const PartialState& state) {
    const int rank = state.process_index();
    EXPECT_EQ(state.distributed_type(), DistributedType::kMultiGpu);
    EXPECT_EQ(state.backend(), "nccl");
    ASSERT_EQ(state.device(), gpu(rank));
    const auto mine = torch::full({3}, static_cast<float>(rank + 1), state.device());
    const auto all = gather(state, mine);
    EXPECT_EQ(all.device(), state.device());
    gathered[rank] = all.cpu();
    reduced[rank] = reduce(state, mine, "sum").cpu();
    broadcast_from_1[rank] = broadcast(state, mine, /*from_process=*/1).cpu();
    state.wait_for_everyone();
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_TRUE(torch::equal(gathered[rank], torch::tensor({1.f, 1.f, 1.f, 2.f, 2.f, 2.f}))) << gathered[rank];
    EXPECT_TRUE(torch::equal(reduced[rank], torch::full({3}, 3.f))) << reduced[rank];
    EXPECT_TRUE(torch::equal(broadcast_from_1[rank], torch::full({3}, 2.f))) << broadcast_from_1[rank];
  }
}

TEST(Nccl, TwoGpuRanksExchangeObjectsAndTriggerFlags) {
  SKIP_WITHOUT_GPUS(2);
  // Objects travel as bytes and flags as integers: the NCCL group must carry them too (PyTorch
  // stages them through the GPU for NCCL), as every job of several GPUs needs them to prepare a
  // model, shuffle its data loader in step and commit a checkpoint.
  std::vector<std::vector<int64_t>> objects(2);
  std::vector<std::vector<std::string>> broadcasts(2);
  std::vector<int> triggers(2, -1);
  run_ranks(2, [&](const PartialState& state) {
    const int rank = state.process_index();
    objects[rank] = gather_object(state, std::vector<int64_t>{10 * (rank + 1)});
    std::vector<std::string> words = {rank == 0 ? "from process 0" : "unchanged"};
    broadcasts[rank] = broadcast_object_list(state, words, /*from_process=*/0);
    if (rank == 1) state.set_trigger();
    triggers[rank] = state.check_trigger() ? 1 : 0;
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(objects[rank], (std::vector<int64_t>{10, 20})) << "process " << rank;
    EXPECT_EQ(broadcasts[rank], (std::vector<std::string>{"from process 0"})) << "process " << rank;
    EXPECT_EQ(triggers[rank], 1) << "process " << rank << " missed process 1's trigger";
  }
}

}  // namespace gpu_distributed_test
}  // namespace accelerate::testing
