// Seeding and synchronising generators, with ranks as threads (upstream: the set_seed and
// synchronize_rng_states parts of test_utils.py and test_sync.py). Ranks running as threads
// share LibTorch's default generators, so per-rank streams come from generators of their own.
#include "accelerate/utils/random.h"
#include "accelerate/utils/environment.h"
#include "support/test_support.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <mutex>
#include <vector>

namespace accelerate::testing {
namespace random_test {  // not anonymous: its names must not meet another file's in a unity batch

std::vector<float> values(const at::Tensor& t) {
  auto c = t.contiguous();
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

std::vector<float> draw(c10::optional<at::Generator> generator = c10::nullopt) {
  return values(at::rand({6}, generator));
}

// The process-wide state, initialised from an empty environment (one process) and forgotten after.
class ProcessWideState : public ::testing::Test {
 protected:
  void SetUp() override { PartialState::reset(); }
  void TearDown() override { PartialState::reset(); }
  EnvironmentClear cleared_;
};

TEST(SetSeed, TheSameSeedReproducesTheSameDraws) {
  set_seed(42);
  const auto first = draw();
  const int first_c = std::rand();
  set_seed(42);
  EXPECT_EQ(draw(), first);
  EXPECT_EQ(std::rand(), first_c);
  set_seed(43);
  EXPECT_NE(draw(), first);
}

TEST(SetSeed, DeviceSpecificSeedsAreOffsetByEachRanksProcessIndex) {
  std::mutex default_generator;  // shared by the threads: one rank seeds and draws at a time
  std::vector<std::vector<float>> draws(2);
  run_ranks(2, [&](const PartialState& state) {
    std::lock_guard<std::mutex> lock(default_generator);
    set_seed(state, 42, /*device_specific=*/true);
    draws[state.process_index()] = draw();
  });
  EXPECT_NE(draws[0], draws[1]);
  set_seed(42);
  EXPECT_EQ(draw(), draws[0]);
  set_seed(43);
  EXPECT_EQ(draw(), draws[1]);
}

TEST(SetSeed, WithoutDeviceSpecificEveryRankUsesTheSameSeed) {
  std::mutex default_generator;
  std::vector<std::vector<float>> draws(2);
  run_ranks(2, [&](const PartialState& state) {
    std::lock_guard<std::mutex> lock(default_generator);
    set_seed(state, 42);
    draws[state.process_index()] = draw();
  });
  EXPECT_EQ(draws[0], draws[1]);
}

TEST_F(ProcessWideState, DeviceSpecificSeedOfASingleProcessIsTheSeedItself) {
  set_seed(7, /*device_specific=*/true);
  const auto specific = draw();
  EXPECT_TRUE(PartialState::initialized());
  set_seed(7);
  EXPECT_EQ(draw(), specific);
}

TEST(SetSeed, DeterministicTurnsOnDeterministicAlgorithms) {
  auto& context = at::globalContext();
  const bool before = context.deterministicAlgorithms();
  const bool before_warn_only = context.deterministicAlgorithmsWarnOnly();
  context.setDeterministicAlgorithms(false, false);
  set_seed(1);
  EXPECT_FALSE(context.deterministicAlgorithms());
  set_seed(1, /*device_specific=*/false, /*deterministic=*/true);
  EXPECT_TRUE(context.deterministicAlgorithms());
  EXPECT_FALSE(context.deterministicAlgorithmsWarnOnly());
  context.setDeterministicAlgorithms(before, before_warn_only);
}

TEST(SynchronizeRngStates, EveryRankContinuesTheMainProcesssGeneratorStream) {
  std::vector<std::vector<float>> before(2), after(2);
  run_ranks(2, [&](const PartialState& state) {
    const int rank = state.process_index();
    auto generator = at::make_generator<at::CPUGeneratorImpl>(100 + rank);
    before[rank] = draw(generator);
    synchronize_rng_states(state, {"generator"}, generator);
    after[rank] = draw(generator);
  });
  EXPECT_NE(before[0], before[1]);
  EXPECT_EQ(after[0], after[1]);
  // Rank 0's stream went on undisturbed.
  auto reference = at::make_generator<at::CPUGeneratorImpl>(100);
  (void)draw(reference);
  EXPECT_EQ(draw(reference), after[0]);
}

TEST(SynchronizeRngStates, TheDefaultGeneratorsStateCrossesIntact) {
  // The threads share the default generator, so rank 1 writes back what rank 0 sent: a state
  // damaged on the way would change the stream.
  set_seed(5);
  const auto expected = draw();
  set_seed(5);
  run_ranks(2, [&](const PartialState& state) { synchronize_rng_states(state, {"torch", "torch"}); });
  EXPECT_EQ(draw(), expected);
}

TEST(SynchronizeRngStates, SeveralNamesAreSynchronisedInOrder) {
  std::vector<std::vector<float>> after(2);
  run_ranks(2, [&](const PartialState& state) {
    auto generator = at::make_generator<at::CPUGeneratorImpl>(7 * state.process_index());
    synchronize_rng_states(state, {"torch", "generator"}, generator);
    after[state.process_index()] = draw(generator);
  });
  EXPECT_EQ(after[0], after[1]);
}

TEST(SynchronizeRngStates, UnknownNamesAreRefusedOnEveryRankBeforeAnyExchange) {
  run_ranks(2, [](const PartialState& state) {
    auto generator = at::make_generator<at::CPUGeneratorImpl>(1);
    EXPECT_THROWS_WITH(synchronize_rng_states(state, {"torch", "TORCH"}, generator),
                       "[synchronize_rng_states] 'TORCH' is not a valid RNGType");
    // Upstream's names of Python-only devices are known, and refused as such.
    EXPECT_THROWS_WITH(synchronize_rng_states(state, {"torch", "xla"}, generator),
                       "[synchronize_rng_states] cannot synchronise \"xla\" generators");
    // The ranks are still in step: a later exchange works.
    synchronize_rng_states(state, {"generator"}, generator);
  });
}

TEST(SynchronizeRngState, OneGeneratorTakesTheMainProcesssState) {
  std::vector<std::vector<float>> after(2);
  run_ranks(2, [&](const PartialState& state) {
    auto generator = at::make_generator<at::CPUGeneratorImpl>(40 + state.process_index());
    synchronize_rng_state(state, RNGType::kGenerator, generator);
    after[state.process_index()] = draw(generator);
  });
  EXPECT_EQ(after[0], after[1]);
  EXPECT_EQ(after[0], draw(at::make_generator<at::CPUGeneratorImpl>(40)));
}

TEST(SynchronizeRngState, TypesWithoutLibTorchSupportAreRefusedBeforeAnyExchange) {
  run_ranks(2, [](const PartialState& state) {
    for (RNGType type : {RNGType::kXla, RNGType::kNpu, RNGType::kMlu, RNGType::kXpu, RNGType::kHpu}) {
      EXPECT_THROWS_WITH(synchronize_rng_state(state, type),
                         "[synchronize_rng_state] cannot synchronise \"" + to_string(type) + "\" generators");
    }
    EXPECT_THROWS_WITH(synchronize_rng_state(state, RNGType::kGenerator), "needs a generator to synchronise");
    synchronize_rng_state(state, RNGType::kTorch);  // still in step
  });
}

TEST(RngTypeEnum, SpellsUpstreamsValues) {
  const std::vector<std::pair<RNGType, std::string>> expected = {
      {RNGType::kTorch, "torch"}, {RNGType::kCuda, "cuda"}, {RNGType::kMlu, "mlu"},       {RNGType::kSdaa, "sdaa"},
      {RNGType::kMusa, "musa"},   {RNGType::kNpu, "npu"},   {RNGType::kXla, "xla"},       {RNGType::kXpu, "xpu"},
      {RNGType::kHpu, "hpu"},     {RNGType::kNeuron, "neuron"}, {RNGType::kGenerator, "generator"}};
  for (const auto& [type, text] : expected) {
    EXPECT_EQ(to_string(type), text);
    EXPECT_EQ(parse_rng_type(text), type);
  }
  EXPECT_THROWS_WITH(parse_rng_type("Torch"), "'Torch' is not a valid RNGType");
}

TEST(SynchronizeRngStates, GeneratorNeedsAGenerator) {
  run_ranks(1, [](const PartialState& state) {
    EXPECT_THROWS_WITH(synchronize_rng_states(state, {"generator"}),
                       "\"generator\" needs a generator to synchronise, but none was given");
  });
}

TEST(SynchronizeRngStates, CudaNeedsCuda) {
  if (is_cuda_available()) GTEST_SKIP() << "CUDA is available here, so \"cuda\" is valid";
  run_ranks(1, [](const PartialState& state) {
    EXPECT_THROWS_WITH(synchronize_rng_states(state, {"cuda"}), "\"cuda\" needs CUDA, which this process does not have");
  });
}

TEST_F(ProcessWideState, WithOneProcessSynchronisingLeavesEveryStreamAsItWas) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(3);
  set_seed(3);
  synchronize_rng_states({"torch", "generator"}, generator);
  const auto from_default = draw();
  const auto from_generator = draw(generator);
  set_seed(3);
  EXPECT_EQ(draw(), from_default);
  EXPECT_EQ(draw(at::make_generator<at::CPUGeneratorImpl>(3)), from_generator);
}

}  // namespace random_test
}  // namespace accelerate::testing
