// Training in real processes started by `accelerate launch -n 2`: distributed training
// reproduces single-process training on the combined batch (upstream's test-script check), and a
// model that differs between processes fails the launch with a clear error instead of hanging.
#include "accelerate/utils/environment.h"
#include "support/process.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace accelerate::testing {
namespace {

using ::testing::HasSubstr;

TEST(TrainingLaunch, TwoProcessesEndWithTheSingleProcessModelInEveryMode) {
  const std::vector<std::string> modes = {"plain", "split_batches", "bf16", "seedable"};
  std::vector<std::string> argv = {accelerate_bin(), "launch", "-n", "2", "--main_process_port", "0",
                                   built("tests/mp_training")};
  argv.insert(argv.end(), modes.begin(), modes.end());
  auto r = run(argv, 180);
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  for (const auto& mode : modes) EXPECT_THAT(r->out, HasSubstr("[rank0]: " + mode + ": OK")) << r->out;
}

TEST(TrainingLaunch, AModelThatDiffersBetweenProcessesFailsTheLaunchNamingTheDifference) {
  auto r = run({accelerate_bin(), "launch", "-n", "2", "--main_process_port", "0", built("tests/mp_training"),
                "mismatch"},
               120);
  EXPECT_NE(r->exit_code(), 0);
  EXPECT_THAT(r->err, HasSubstr("the model differs between processes: process 0 has parameter weight [1, 2]"));
}

// Note [One pool for the process's large CPU buffers]: after the first steps, a DDP loop with
// AdamW that also reduces and gathers a 4 MiB metric takes every large buffer from the pool, on
// both back-ends (the Reducer's buckets, the gradients made again after zero_grad, the
// optimizer's temporaries, the collectives' results).
TEST(TrainingLaunch, StepsInTheSteadyStateTakeNoFreshLargeBufferOnEitherBackEnd) {
  for (const std::string backend : {"gloo", "mpi"}) {
    if (backend == "mpi" && !is_mpi_available()) continue;
    auto r = run({accelerate_bin(), "launch", "-n", "2", "--backend", backend, "--main_process_port", "0",
                  "--num_cpu_threads_per_process", "1", worker_bin(), "pool_steps"},
                 120);
    ASSERT_EQ(r->exit_code(), 0) << backend << "\n" << r->out << r->err;
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_THAT(r->out, HasSubstr("process " + std::to_string(rank) + ": fresh large buffers in steady steps: 0,"))
          << backend << "\n" << r->out;
    }
  }
}

}  // namespace
}  // namespace accelerate::testing
