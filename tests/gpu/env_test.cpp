// `accelerate env` on a CUDA machine (src/commands/env.cpp): the built command names CUDA as the
// accelerator, counts the GPUs and reports NCCL, the lines a GPU bug report needs. Skips without
// a GPU.
#include "support/gpu.h"
#include "support/process.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace accelerate::testing {
namespace {

using ::testing::HasSubstr;

TEST(CudaEnvCommand, ListsCudaAsTheAcceleratorTheNumberOfGpusAndNccl) {
  SKIP_WITHOUT_GPUS(1);
  TempDir home;  // no configuration file of the user's in the output
  auto r = run({accelerate_bin(), "env"}, 60, {{"HF_HOME", home.str()}});
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  EXPECT_THAT(r->out, HasSubstr("- PyTorch accelerator: CUDA\n"));
  EXPECT_THAT(r->out, HasSubstr("- CUDA devices: " + std::to_string(cuda_device_count()) + "\n"));
  EXPECT_THAT(r->out, HasSubstr("- NCCL available: yes\n")) << "a CUDA build of LibTorch without NCCL cannot run "
                                                               "--multi_gpu jobs";
}

}  // namespace
}  // namespace accelerate::testing
