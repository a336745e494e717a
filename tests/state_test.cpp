// PartialState, AcceleratorState and GradientState (state.h), with ranks running as threads of
// this process over Gloo and one in-memory store.
#include "accelerate/state.h"

#include "accelerate/utils/environment.h"
#include "support/test_support.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace accelerate::testing {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using std::chrono::milliseconds;

// Runs `fn` on `machines` × `per_machine` ranks as threads, each with its own local index, so
// that "local" behaviour can be told apart from "global" behaviour.
void run_machines(int machines, int per_machine, const std::function<void(const PartialState&)>& fn) {
  const int world_size = machines * per_machine;
  Store store = Store::in_memory();
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(world_size);
  for (int rank = 0; rank < world_size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        PartialStateOptions options;
        options.process_index = rank;
        options.num_processes = world_size;
        options.local_process_index = rank % per_machine;
        options.local_num_processes = per_machine;
        options.store = store;
        options.rdzv_timeout = std::chrono::seconds(30);
        options.init_kwargs.timeout = std::chrono::seconds(30);
        fn(PartialState::standalone(options));
      } catch (...) {
        errors[rank] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

// The message of the exception `fn` throws, or empty when it succeeds.
template <typename Fn>
std::string error_of_or_empty(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return detail::error_text(e);
  }
  return {};
}

// A per-rank record that threads fill at their own index.
template <typename T>
std::vector<T> per_rank(int n, T value = T{}) {
  return std::vector<T>(static_cast<size_t>(n), value);
}

// ---- topology -------------------------------------------------------------------------------

TEST(PartialState, OneRankIsNotDistributedAndHasNoBackend) {
  run_ranks(1, [](const PartialState& state) {
    EXPECT_EQ(state.process_index(), 0);
    EXPECT_EQ(state.num_processes(), 1);
    EXPECT_EQ(state.local_process_index(), 0);
    EXPECT_EQ(state.local_num_processes(), 1);
    EXPECT_TRUE(state.is_main_process());
    EXPECT_TRUE(state.is_last_process());
    EXPECT_TRUE(state.is_local_main_process());
    EXPECT_FALSE(state.use_distributed());
    EXPECT_EQ(state.distributed_type(), DistributedType::kNo);
    EXPECT_EQ(state.backend(), "");
    EXPECT_TRUE(state.device().is_cpu());
  });
}

TEST(PartialState, OneRankNeedsNoProcessGroupForBarriers) {
  run_ranks(1, [](const PartialState& state) {
    state.wait_for_everyone();
    EXPECT_FALSE(state.check_trigger());
  });
}

TEST(PartialState, TwoRanksKnowWhichIsMainAndWhichIsLast) {
  auto main = per_rank<int>(2, -1), last = per_rank<int>(2, -1), index = per_rank<int>(2, -1);
  run_ranks(2, [&](const PartialState& state) {
    const int rank = state.process_index();
    index[rank] = rank;
    main[rank] = state.is_main_process();
    last[rank] = state.is_last_process();
    EXPECT_EQ(state.num_processes(), 2);
    EXPECT_TRUE(state.use_distributed());
    EXPECT_EQ(state.distributed_type(), DistributedType::kMultiCpu);
    EXPECT_EQ(state.backend(), "gloo");
  });
  EXPECT_THAT(index, ElementsAre(0, 1));
  EXPECT_THAT(main, ElementsAre(1, 0));
  EXPECT_THAT(last, ElementsAre(0, 1));
}

TEST(PartialState, FourRanksOnOneMachineHaveLocalIndicesEqualToTheirRanks) {
  auto local = per_rank<int>(4, -1), local_main = per_rank<int>(4, -1), main = per_rank<int>(4, -1),
       last = per_rank<int>(4, -1);
  run_ranks(4, [&](const PartialState& state) {
    const int rank = state.process_index();
    local[rank] = state.local_process_index();
    local_main[rank] = state.is_local_main_process();
    main[rank] = state.is_main_process();
    last[rank] = state.is_last_process();
    EXPECT_EQ(state.local_num_processes(), 4);
    EXPECT_EQ(state.backend(), "gloo");
  });
  EXPECT_THAT(local, ElementsAre(0, 1, 2, 3));
  EXPECT_THAT(local_main, ElementsAre(1, 0, 0, 0));
  EXPECT_THAT(main, ElementsAre(1, 0, 0, 0));
  EXPECT_THAT(last, ElementsAre(0, 0, 0, 1));
}

TEST(PartialState, TwoMachinesOfTwoEachHaveTwoLocalMainProcesses) {
  auto local_main = per_rank<int>(4, -1);
  run_machines(2, 2, [&](const PartialState& state) {
    local_main[state.process_index()] = state.is_local_main_process();
    EXPECT_EQ(state.local_num_processes(), 2);
  });
  EXPECT_THAT(local_main, ElementsAre(1, 0, 1, 0));
}

// ---- wait_for_everyone / *_first ------------------------------------------------------------

TEST(WaitForEveryone, NoRankLeavesBeforeEveryRankArrived) {
  std::atomic<int> arrived{0};
  auto seen_after = per_rank<int>(4, -1);
  run_ranks(4, [&](const PartialState& state) {
    std::this_thread::sleep_for(milliseconds(60 * state.process_index()));
    ++arrived;
    state.wait_for_everyone();
    seen_after[state.process_index()] = arrived.load();
  });
  EXPECT_THAT(seen_after, ElementsAre(4, 4, 4, 4));
}

TEST(MainProcessFirst, TheMainProcessSideEffectIsVisibleToTheOthers) {
  std::atomic<bool> main_done{false};
  auto saw_main_done = per_rank<int>(4, -1);
  run_ranks(4, [&](const PartialState& state) {
    state.main_process_first([&] {
      if (state.is_main_process()) {
        std::this_thread::sleep_for(milliseconds(200));
        main_done = true;
      } else {
        saw_main_done[state.process_index()] = main_done.load();
      }
    });
  });
  EXPECT_THAT(saw_main_done, ElementsAre(-1, 1, 1, 1));
}

TEST(MainProcessFirst, TheFunctionsResultIsReturnedOnEveryRank) {
  auto results = per_rank<std::string>(2);
  run_ranks(2, [&](const PartialState& state) {
    results[state.process_index()] =
        state.main_process_first([&] { return "rank " + std::to_string(state.process_index()); });
  });
  EXPECT_THAT(results, ElementsAre("rank 0", "rank 1"));
}

TEST(MainProcessFirst, OneProcessJustRunsTheFunction) {
  run_ranks(1, [](const PartialState& state) { EXPECT_EQ(state.main_process_first([] { return 7; }), 7); });
}

TEST(LocalMainProcessFirst, EachMachinesLocalMainGoesBeforeItsOthers) {
  std::atomic<int> local_mains_done{0};
  auto seen = per_rank<int>(4, -1);
  run_machines(2, 2, [&](const PartialState& state) {
    const int result = state.local_main_process_first([&] {
      if (state.is_local_main_process()) {
        std::this_thread::sleep_for(milliseconds(200));
        ++local_mains_done;
      } else {
        seen[state.process_index()] = local_mains_done.load();
      }
      return state.process_index() * 10;
    });
    EXPECT_EQ(result, state.process_index() * 10);
  });
  // Both local mains (ranks 0 and 2) have finished before ranks 1 and 3 start.
  EXPECT_THAT(seen, ElementsAre(-1, 2, -1, 2));
}

// ---- on_* wrappers --------------------------------------------------------------------------

// Which ranks ran a void wrapper made by `wrap(state, fn)`.
template <typename Wrap>
std::vector<int> ranks_that_ran(int machines, int per_machine, Wrap wrap) {
  auto ran = per_rank<int>(machines * per_machine, 0);
  run_machines(machines, per_machine, [&](const PartialState& state) {
    auto wrapped = wrap(state, [&ran, rank = state.process_index()] { ++ran[rank]; });
    wrapped();
  });
  return ran;
}

TEST(OnProcess, OnMainProcessRunsOnlyOnRankZero) {
  EXPECT_THAT(ranks_that_ran(1, 4, [](const PartialState& s, auto fn) { return s.on_main_process(fn); }),
              ElementsAre(1, 0, 0, 0));
}

TEST(OnProcess, OnLastProcessRunsOnlyOnTheHighestRank) {
  EXPECT_THAT(ranks_that_ran(1, 4, [](const PartialState& s, auto fn) { return s.on_last_process(fn); }),
              ElementsAre(0, 0, 0, 1));
}

TEST(OnProcess, OnProcessRunsOnlyOnTheGivenRank) {
  EXPECT_THAT(ranks_that_ran(1, 4, [](const PartialState& s, auto fn) { return s.on_process(fn, 2); }),
              ElementsAre(0, 0, 1, 0));
}

TEST(OnProcess, OnProcessWithAnIndexOutsideTheJobRunsNowhere) {
  EXPECT_THAT(ranks_that_ran(1, 2, [](const PartialState& s, auto fn) { return s.on_process(fn, 5); }),
              ElementsAre(0, 0));
}

TEST(OnProcess, OnLocalMainProcessRunsOnceOnEachMachine) {
  EXPECT_THAT(ranks_that_ran(2, 2, [](const PartialState& s, auto fn) { return s.on_local_main_process(fn); }),
              ElementsAre(1, 0, 1, 0));
}

TEST(OnProcess, OnLocalProcessRunsOnTheGivenLocalIndexOfEachMachine) {
  EXPECT_THAT(ranks_that_ran(2, 2, [](const PartialState& s, auto fn) { return s.on_local_process(fn, 1); }),
              ElementsAre(0, 1, 0, 1));
}

TEST(OnProcess, WithOneProcessEveryWrapperRuns) {
  for (auto ran : {ranks_that_ran(1, 1, [](const PartialState& s, auto fn) { return s.on_main_process(fn); }),
                   ranks_that_ran(1, 1, [](const PartialState& s, auto fn) { return s.on_last_process(fn); }),
                   ranks_that_ran(1, 1, [](const PartialState& s, auto fn) { return s.on_local_main_process(fn); }),
                   ranks_that_ran(1, 1, [](const PartialState& s, auto fn) { return s.on_process(fn, 3); }),
                   ranks_that_ran(1, 1, [](const PartialState& s, auto fn) { return s.on_local_process(fn, 3); })}) {
    EXPECT_THAT(ran, ElementsAre(1));
  }
}

TEST(OnProcess, ANonVoidWrapperReturnsTheResultWhereItRanAndNothingElsewhere) {
  auto results = per_rank<std::optional<int>>(3);
  run_ranks(3, [&](const PartialState& state) {
    auto doubled = state.on_process([](int x) { return 2 * x; }, 1);
    results[state.process_index()] = doubled(21);
  });
  EXPECT_EQ(results[0], std::nullopt);
  EXPECT_EQ(results[1], std::optional<int>(42));
  EXPECT_EQ(results[2], std::nullopt);
}

TEST(OnProcess, ANonVoidWrapperOnOneProcessReturnsTheResult) {
  run_ranks(1, [](const PartialState& state) {
    auto last = state.on_last_process([](const std::string& s) { return s + "!"; });
    EXPECT_EQ(last("hi"), std::optional<std::string>("hi!"));
    auto main = state.on_main_process([] { return 5; });
    EXPECT_EQ(main(), std::optional<int>(5));
  });
}

// ---- split_between_processes ----------------------------------------------------------------

TEST(SplitBetweenProcesses, EarlierProcessesTakeTheExtraElement) {
  auto shares = per_rank<std::vector<std::string>>(2);
  run_ranks(2, [&](const PartialState& state) {
    shares[state.process_index()] = state.split_between_processes(std::vector<std::string>{"A", "B", "C"});
  });
  EXPECT_THAT(shares[0], ElementsAre("A", "B"));
  EXPECT_THAT(shares[1], ElementsAre("C"));
}

TEST(SplitBetweenProcesses, PaddingRepeatsTheLastElement) {
  auto shares = per_rank<std::vector<std::string>>(2);
  run_ranks(2, [&](const PartialState& state) {
    shares[state.process_index()] =
        state.split_between_processes(std::vector<std::string>{"A", "B", "C"}, /*apply_padding=*/true);
  });
  EXPECT_THAT(shares[0], ElementsAre("A", "B"));
  EXPECT_THAT(shares[1], ElementsAre("C", "C"));
}

TEST(SplitBetweenProcesses, TenElementsOverFourProcessesAreThreeThreeTwoTwo) {
  std::vector<int> inputs(10);
  for (int i = 0; i < 10; ++i) inputs[i] = i;
  auto shares = per_rank<std::vector<int>>(4);
  auto padded = per_rank<std::vector<int>>(4);
  run_ranks(4, [&](const PartialState& state) {
    shares[state.process_index()] = state.split_between_processes(inputs);
    padded[state.process_index()] = state.split_between_processes(inputs, /*apply_padding=*/true);
  });
  EXPECT_THAT(shares[0], ElementsAre(0, 1, 2));
  EXPECT_THAT(shares[1], ElementsAre(3, 4, 5));
  EXPECT_THAT(shares[2], ElementsAre(6, 7));
  EXPECT_THAT(shares[3], ElementsAre(8, 9));
  EXPECT_THAT(padded[0], ElementsAre(0, 1, 2));
  EXPECT_THAT(padded[1], ElementsAre(3, 4, 5));
  EXPECT_THAT(padded[2], ElementsAre(6, 7, 9));
  EXPECT_THAT(padded[3], ElementsAre(8, 9, 9));
}

TEST(SplitBetweenProcesses, MoreProcessesThanElementsLeavesTheLastOnesEmpty) {
  auto shares = per_rank<std::vector<int>>(4, {-1});
  auto padded = per_rank<std::vector<int>>(4, {-1});
  run_ranks(4, [&](const PartialState& state) {
    shares[state.process_index()] = state.split_between_processes(std::vector<int>{10, 20});
    padded[state.process_index()] = state.split_between_processes(std::vector<int>{10, 20}, /*apply_padding=*/true);
  });
  EXPECT_THAT(shares[0], ElementsAre(10));
  EXPECT_THAT(shares[1], ElementsAre(20));
  EXPECT_TRUE(shares[2].empty());
  EXPECT_TRUE(shares[3].empty());
  EXPECT_THAT(padded[0], ElementsAre(10));
  EXPECT_THAT(padded[1], ElementsAre(20));
  EXPECT_THAT(padded[2], ElementsAre(20));
  EXPECT_THAT(padded[3], ElementsAre(20));
}

TEST(SplitBetweenProcesses, AnEmptyVectorGivesEveryProcessNothing) {
  auto sizes = per_rank<int>(2, -1);
  run_ranks(2, [&](const PartialState& state) {
    sizes[state.process_index()] = static_cast<int>(state.split_between_processes(std::vector<int>{}).size());
  });
  EXPECT_THAT(sizes, ElementsAre(0, 0));
}

TEST(SplitBetweenProcesses, PaddingAnEmptyVectorIsRefused) {
  EXPECT_THROWS_WITH(run_ranks(2,
                               [](const PartialState& state) {
                                 (void)state.split_between_processes(std::vector<int>{}, /*apply_padding=*/true);
                               }),
                     "of length 0 has none");
}

TEST(SplitBetweenProcesses, OneProcessGetsTheInputUnchanged) {
  run_ranks(1, [](const PartialState& state) {
    const std::vector<std::string> inputs{"A", "B", "C"};
    EXPECT_EQ(state.split_between_processes(inputs), inputs);
    EXPECT_EQ(state.split_between_processes(inputs, /*apply_padding=*/true), inputs);
    const std::map<std::string, std::vector<int>> map{{"x", {1, 2}}, {"y", {3}}};
    EXPECT_EQ(state.split_between_processes(map), map);
    const at::Tensor tensor = at::arange(6).view({3, 2});
    EXPECT_TRUE(state.split_between_processes(tensor).is_same(tensor));
    const at::Tensor scalar = at::scalar_tensor(3.0);
    EXPECT_TRUE(state.split_between_processes(scalar).is_same(scalar));
  });
}

TEST(SplitBetweenProcesses, EveryValueOfAMapIsSplitTheSameWay) {
  using Map = std::map<std::string, std::vector<int>>;
  auto shares = per_rank<Map>(2);
  auto padded = per_rank<Map>(2);
  const Map inputs{{"ids", {1, 2, 3}}, {"labels", {10, 20, 30}}};
  run_ranks(2, [&](const PartialState& state) {
    shares[state.process_index()] = state.split_between_processes(inputs);
    padded[state.process_index()] = state.split_between_processes(inputs, /*apply_padding=*/true);
  });
  EXPECT_EQ(shares[0], (Map{{"ids", {1, 2}}, {"labels", {10, 20}}}));
  EXPECT_EQ(shares[1], (Map{{"ids", {3}}, {"labels", {30}}}));
  EXPECT_EQ(padded[1], (Map{{"ids", {3, 3}}, {"labels", {30, 30}}}));
}

TEST(SplitBetweenProcesses, MapValuesOfDifferentLengthsAreRefused) {
  using Map = std::map<std::string, std::vector<int>>;
  EXPECT_THROWS_WITH(run_ranks(2,
                               [](const PartialState& state) {
                                 (void)state.split_between_processes(Map{{"a", {1, 2, 3}}, {"b", {1, 2}}});
                               }),
                     "same length; found 3 and 2");
}

TEST(SplitBetweenProcesses, AnEmptyMapStaysEmpty) {
  auto sizes = per_rank<int>(2, -1);
  run_ranks(2, [&](const PartialState& state) {
    sizes[state.process_index()] =
        static_cast<int>(state.split_between_processes(std::map<int, std::vector<int>>{}).size());
  });
  EXPECT_THAT(sizes, ElementsAre(0, 0));
}

TEST(SplitBetweenProcesses, ATensorIsSplitAlongItsFirstDimension) {
  const at::Tensor inputs = at::arange(10).view({5, 2});
  auto shares = per_rank<at::Tensor>(2);
  run_ranks(2, [&](const PartialState& state) {
    shares[state.process_index()] = state.split_between_processes(inputs);
  });
  EXPECT_TRUE(at::equal(shares[0], at::arange(0, 6).view({3, 2}))) << shares[0];
  EXPECT_TRUE(at::equal(shares[1], at::arange(6, 10).view({2, 2}))) << shares[1];
}

TEST(SplitBetweenProcesses, PaddingATensorRepeatsItsLastRow) {
  const at::Tensor inputs = at::arange(10).view({5, 2});
  auto shares = per_rank<at::Tensor>(4);
  run_ranks(4, [&](const PartialState& state) {
    shares[state.process_index()] = state.split_between_processes(inputs, /*apply_padding=*/true);
  });
  // 5 rows over 4 processes: 2,1,1,1, padded to 2 each with row [8, 9].
  EXPECT_TRUE(at::equal(shares[0], at::tensor({0, 1, 2, 3}, at::kLong).view({2, 2}))) << shares[0];
  EXPECT_TRUE(at::equal(shares[1], at::tensor({4, 5, 8, 9}, at::kLong).view({2, 2}))) << shares[1];
  EXPECT_TRUE(at::equal(shares[2], at::tensor({6, 7, 8, 9}, at::kLong).view({2, 2}))) << shares[2];
  EXPECT_TRUE(at::equal(shares[3], at::tensor({8, 9, 8, 9}, at::kLong).view({2, 2}))) << shares[3];
}

TEST(SplitBetweenProcesses, AZeroDimTensorIsRefused) {
  EXPECT_THROWS_WITH(run_ranks(2,
                               [](const PartialState& state) {
                                 (void)state.split_between_processes(at::scalar_tensor(1.0));
                               }),
                     "got a 0-dim tensor");
}

// ---- triggers -------------------------------------------------------------------------------

TEST(Trigger, OneRanksTriggerIsSeenByEveryRankOnce) {
  auto first = per_rank<int>(3, -1), second = per_rank<int>(3, -1);
  run_ranks(3, [&](const PartialState& state) {
    if (state.process_index() == 1) state.set_trigger();
    first[state.process_index()] = state.check_trigger();
    second[state.process_index()] = state.check_trigger();
  });
  EXPECT_THAT(first, ElementsAre(1, 1, 1));
  EXPECT_THAT(second, ElementsAre(0, 0, 0));
}

TEST(Trigger, NoTriggerIsNotSeen) {
  auto seen = per_rank<int>(2, -1);
  run_ranks(2, [&](const PartialState& state) { seen[state.process_index()] = state.check_trigger(); });
  EXPECT_THAT(seen, ElementsAre(0, 0));
}

TEST(Trigger, OneProcessSeesItsOwnTriggerOnce) {
  run_ranks(1, [](const PartialState& state) {
    state.set_trigger();
    EXPECT_TRUE(state.check_trigger());
    EXPECT_FALSE(state.check_trigger());
  });
}

// ---- destroy_process_group ------------------------------------------------------------------

TEST(DestroyProcessGroup, LaterBarriersFailSayingItWasDestroyed) {
  auto errors = per_rank<std::string>(2);
  run_ranks(2, [&](const PartialState& state) {
    state.wait_for_everyone();
    state.destroy_process_group();
    errors[state.process_index()] = error_of([&] { state.wait_for_everyone(); });
  });
  EXPECT_THAT(errors[0], HasSubstr("[wait_for_everyone] the process group was destroyed"));
  EXPECT_THAT(errors[1], HasSubstr("[wait_for_everyone] the process group was destroyed"));
}

TEST(DestroyProcessGroup, LaterTriggerChecksFailToo) {
  EXPECT_THROWS_WITH(run_ranks(2,
                               [](const PartialState& state) {
                                 state.destroy_process_group();
                                 (void)state.check_trigger();
                               }),
                     "[check_trigger] the process group was destroyed");
}

// ---- explicit options -----------------------------------------------------------------------

TEST(PartialStateOptions, TheProcessWideStateRefusesOptionsThatContradictIt) {
  // The first PartialState of a process decides its topology; a later one with other counts or
  // another index is refused by name, and one that agrees shares the state.
  PartialState::reset();
  PartialStateOptions one;  // one process on the CPU, whatever devices this machine has
  one.cpu = true;
  PartialState first(one);
  PartialStateOptions more;
  more.num_processes = 2;
  EXPECT_THROWS_WITH(PartialState{more},
                     "[PartialState] the process-wide state already exists with num_processes 1, "
                     "got 2; call PartialState::reset() first");
  PartialStateOptions other;
  other.process_index = 1;
  EXPECT_THROWS_WITH(PartialState{other},
                     "[PartialState] the process-wide state already exists with process_index 0, "
                     "got 1; call PartialState::reset() first");
  PartialStateOptions same;
  same.process_index = 0;
  same.num_processes = 1;
  same.cpu = true;
  const PartialState agreeing(same);
  EXPECT_EQ(agreeing.num_processes(), 1);
  EXPECT_EQ(agreeing.device(), first.device());
  first.set_trigger();
  EXPECT_TRUE(agreeing.check_trigger()) << "the agreeing state is not the process-wide one";
  PartialState::reset();
}

TEST(PartialStateOptions, AProcessIndexNotBelowTheProcessCountIsRefused) {
  PartialStateOptions options;
  options.process_index = 2;
  options.num_processes = 2;
  options.store = Store::in_memory();
  EXPECT_THROWS_WITH(PartialState::standalone(options), "process_index 2 is outside [0, num_processes=2)");
}

TEST(PartialStateOptions, ANegativeProcessIndexIsRefused) {
  PartialStateOptions options;
  options.process_index = -1;
  options.num_processes = 2;
  options.store = Store::in_memory();
  EXPECT_THROWS_WITH(PartialState::standalone(options), "process_index -1 is outside [0, num_processes=2)");
}

TEST(PartialStateOptions, ZeroProcessesAreRefused) {
  PartialStateOptions options;
  options.num_processes = 0;
  options.process_index = 0;
  EXPECT_THROWS_WITH(PartialState::standalone(options), "num_processes must be at least 1, got 0");
}

TEST(PartialStateOptions, ALocalIndexNotBelowTheLocalCountIsRefused) {
  PartialStateOptions options;
  options.process_index = 1;
  options.num_processes = 4;
  options.local_process_index = 2;
  options.local_num_processes = 2;
  options.store = Store::in_memory();
  EXPECT_THROWS_WITH(PartialState::standalone(options), "local_process_index 2 is outside [0, local_num_processes=2)");
}

TEST(PartialStateOptions, MoreLocalProcessesThanProcessesAreRefused) {
  PartialStateOptions options;
  options.process_index = 0;
  options.num_processes = 2;
  options.local_num_processes = 3;
  options.store = Store::in_memory();
  EXPECT_THROWS_WITH(PartialState::standalone(options), "local_num_processes 3 must be between 1 and 2");
}

TEST(PartialStateOptions, ANonPositiveCollectiveTimeoutIsRefused) {
  PartialStateOptions options;
  options.init_kwargs.timeout = milliseconds(0);
  EXPECT_THROWS_WITH(PartialState::standalone(options), "InitProcessGroupKwargs.timeout must be positive");
}

TEST(PartialStateOptions, DebugComesFromTheOptionOrTheEnvironment) {
  PartialStateOptions options;
  options.debug = true;
  EXPECT_TRUE(PartialState::standalone(options).debug());
  auto env = patch_environment({{"ACCELERATE_DEBUG_MODE", "1"}});
  EXPECT_TRUE(PartialState::standalone({}).debug());
  options.debug = false;
  EXPECT_FALSE(PartialState::standalone(options).debug());
}

TEST(PartialStateOptions, TheCollectiveTimeoutIsKept) {
  PartialStateOptions options;
  options.init_kwargs.timeout = std::chrono::seconds(42);
  EXPECT_EQ(PartialState::standalone(options).timeout(), milliseconds(42000));
  EXPECT_EQ(PartialState::standalone({}).timeout(), std::chrono::minutes(30));
}

TEST(PartialStateOptions, APeerThatNeverArrivesFailsTheRendezvousWithinItsTimeout) {
  PartialStateOptions options;
  options.process_index = 0;
  options.num_processes = 2;
  options.store = Store::in_memory();
  options.rdzv_timeout = std::chrono::seconds(2);
  const auto start = std::chrono::steady_clock::now();
  const std::string error = error_of([&] { (void)PartialState::standalone(options); });
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_THAT(error, HasSubstr("rendezvous timed out after 2s"));
  EXPECT_THAT(error, HasSubstr("only 1 of 2 processes joined"));
  EXPECT_GE(elapsed, std::chrono::milliseconds(1900));
  EXPECT_LT(elapsed, std::chrono::seconds(20));
}

TEST(PartialStateOptions, TheRendezvousTimeoutComesFromTheEnvironmentWhenNotGiven) {
  auto env = patch_environment({{"ACCELERATE_RDZV_TIMEOUT", "1.5"}});
  PartialStateOptions options;
  options.process_index = 1;
  options.num_processes = 2;
  options.store = Store::in_memory();
  EXPECT_THROWS_WITH(PartialState::standalone(options), "rendezvous timed out after 1.5s");
}

TEST(PartialStateOptions, AMalformedRendezvousTimeoutInTheEnvironmentIsRefusedByName) {
  auto env = patch_environment({{"ACCELERATE_RDZV_TIMEOUT", "soon"}});
  PartialStateOptions options;
  options.process_index = 0;
  options.num_processes = 2;
  options.store = Store::in_memory();
  EXPECT_THROWS_WITH(PartialState::standalone(options),
                     "ACCELERATE_RDZV_TIMEOUT must be a positive number of seconds, got 'soon'");
}

// ---- AcceleratorState -----------------------------------------------------------------------

TEST(AcceleratorState, MixedPrecisionComesFromTheOptions) {
  AcceleratorStateOptions options;
  options.mixed_precision = "bf16";
  const AcceleratorState state = AcceleratorState::standalone(options);
  EXPECT_EQ(state.mixed_precision(), PrecisionType::kBf16);
  EXPECT_EQ(state.num_processes(), 1);
  EXPECT_EQ(state.distributed_type(), DistributedType::kNo);
}

TEST(AcceleratorState, MixedPrecisionComesFromTheEnvironmentWhenNotGiven) {
  auto env = patch_environment({{"ACCELERATE_MIXED_PRECISION", "bf16"}});
  EXPECT_EQ(AcceleratorState::standalone({}).mixed_precision(), PrecisionType::kBf16);
}

TEST(AcceleratorState, TheOptionWinsOverTheEnvironment) {
  auto env = patch_environment({{"ACCELERATE_MIXED_PRECISION", "bf16"}});
  AcceleratorStateOptions options;
  options.mixed_precision = "no";
  EXPECT_EQ(AcceleratorState::standalone(options).mixed_precision(), PrecisionType::kNo);
}

TEST(AcceleratorState, WithoutOptionOrEnvironmentThereIsNoMixedPrecision) {
  ASSERT_EQ(get_env("ACCELERATE_MIXED_PRECISION"), std::nullopt);
  EXPECT_EQ(AcceleratorState::standalone({}).mixed_precision(), PrecisionType::kNo);
}

TEST(AcceleratorState, AnUnknownPrecisionOptionIsRefused) {
  AcceleratorStateOptions options;
  options.mixed_precision = "fp9";
  EXPECT_THROWS_WITH(AcceleratorState::standalone(options), "got 'fp9'");
}

TEST(AcceleratorState, AnUnknownPrecisionInTheEnvironmentIsRefusedNamingTheVariable) {
  auto env = patch_environment({{"ACCELERATE_MIXED_PRECISION", "fp8"}});
  EXPECT_THROWS_WITH(AcceleratorState::standalone({}), "environment variable ACCELERATE_MIXED_PRECISION");
  EXPECT_THROWS_WITH(AcceleratorState::standalone({}), "fp8 mixed precision is not supported");
}

TEST(AcceleratorState, RanksAsThreadsShareOneTopology) {
  Store store = Store::in_memory();
  auto indices = per_rank<int>(2, -1);
  auto errors = per_rank<std::string>(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      errors[rank] = error_of_or_empty([&] {
      AcceleratorStateOptions options;
      options.mixed_precision = "bf16";
      options.partial.process_index = rank;
      options.partial.num_processes = 2;
      options.partial.store = store;
      options.partial.rdzv_timeout = std::chrono::seconds(30);
      const AcceleratorState state = AcceleratorState::standalone(options);
      state.wait_for_everyone();
      indices[rank] = state.process_index() + (state.mixed_precision() == PrecisionType::kBf16 ? 10 : 0) +
                      (state.distributed_type() == DistributedType::kMultiCpu ? 100 : 0);
      });
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_THAT(errors, ElementsAre("", ""));
  EXPECT_THAT(indices, ElementsAre(110, 111));
}

TEST(AcceleratorState, ForwardsSplittingOrderingAndTheEndOfTheGroupToItsPartialState) {
  Store store = Store::in_memory();
  auto shares = per_rank<std::vector<int>>(2);
  auto order = std::make_shared<std::vector<int>>();
  std::mutex order_mutex;
  auto errors = per_rank<std::string>(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      AcceleratorStateOptions options;
      options.partial.process_index = rank;
      options.partial.num_processes = 2;
      options.partial.store = store;
      options.partial.rdzv_timeout = std::chrono::seconds(30);
      const AcceleratorState state = AcceleratorState::standalone(options);
      shares[rank] = state.split_between_processes(std::vector<int>{1, 2, 3}, /*apply_padding=*/true);
      const int got = state.main_process_first([&] {
        std::lock_guard<std::mutex> lock(order_mutex);
        order->push_back(rank);
        return rank * 10;
      });
      EXPECT_EQ(got, rank * 10);
      state.local_main_process_first([&] {
        std::lock_guard<std::mutex> lock(order_mutex);
        order->push_back(rank + 2);
      });
      state.destroy_process_group();
      errors[rank] = error_of([&] { state.wait_for_everyone(); });
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_THAT(shares[0], ElementsAre(1, 2));
  EXPECT_THAT(shares[1], ElementsAre(3, 3));
  ASSERT_EQ(order->size(), 4u);
  const auto at = [&](int entry) { return std::find(order->begin(), order->end(), entry) - order->begin(); };
  EXPECT_LT(at(0), at(1)) << "process 0 goes first";
  EXPECT_LT(at(2), at(3)) << "the local main process goes first";
  EXPECT_THAT(errors[0], HasSubstr("the process group was destroyed"));
  EXPECT_THAT(errors[1], HasSubstr("the process group was destroyed"));
}

// ---- GradientState --------------------------------------------------------------------------

TEST(GradientState, AStandaloneStateStartsSynchronisingOnEveryStep) {
  const GradientState state = GradientState::standalone();
  EXPECT_TRUE(state.sync_gradients());
  EXPECT_FALSE(state.end_of_dataloader());
  EXPECT_EQ(state.remainder(), -1);
  EXPECT_EQ(state.num_steps(), 1);
  EXPECT_TRUE(state.adjust_scheduler());
  EXPECT_TRUE(state.sync_with_dataloader());
  EXPECT_FALSE(state.sync_each_batch());
  EXPECT_FALSE(state.in_dataloader());
  EXPECT_EQ(state.active_dataloader(), nullptr);
  EXPECT_TRUE(state.dataloader_references().empty());
}

TEST(GradientState, ThePluginSettingsAreKept) {
  GradientAccumulationPlugin plugin;
  plugin.num_steps = 4;
  plugin.adjust_scheduler = false;
  plugin.sync_each_batch = true;
  const GradientState state = GradientState::standalone(plugin);
  EXPECT_EQ(state.num_steps(), 4);
  EXPECT_FALSE(state.adjust_scheduler());
  EXPECT_TRUE(state.sync_each_batch());
  EXPECT_EQ(state.plugin().num_steps, 4);
}

TEST(GradientState, ZeroAccumulationStepsAreRefused) {
  GradientAccumulationPlugin plugin;
  plugin.num_steps = 0;
  EXPECT_THROWS_WITH(GradientState::standalone(plugin), "num_steps must be >= 1, got 0");
  const GradientState state = GradientState::standalone();
  EXPECT_THROWS_WITH(state.set_plugin(plugin), "num_steps must be >= 1, got 0");
  EXPECT_EQ(state.num_steps(), 1);
}

TEST(GradientState, NestedDataLoadersFormAStack) {
  const GradientState state = GradientState::standalone();
  const int outer = 0, inner = 0;
  state.add_dataloader(&outer);
  EXPECT_TRUE(state.in_dataloader());
  EXPECT_EQ(state.active_dataloader(), &outer);
  state.add_dataloader(&inner);
  EXPECT_EQ(state.active_dataloader(), &inner);
  EXPECT_THAT(state.dataloader_references(), ElementsAre(&outer, &inner));
  state.remove_dataloader(&inner);
  EXPECT_EQ(state.active_dataloader(), &outer);
  EXPECT_TRUE(state.in_dataloader());
  state.remove_dataloader(&outer);
  EXPECT_FALSE(state.in_dataloader());
  EXPECT_EQ(state.active_dataloader(), nullptr);
}

TEST(GradientState, StartingADataLoaderClearsTheEndFlag) {
  const GradientState state = GradientState::standalone();
  state.set_end_of_dataloader(true);
  const int loader = 0;
  state.add_dataloader(&loader);
  EXPECT_FALSE(state.end_of_dataloader());
  state.set_end_of_dataloader(true);
  state.remove_dataloader(&loader);
  EXPECT_FALSE(state.end_of_dataloader());
}

TEST(GradientState, RemovingALoaderThatIsNotIteratedIsRefused) {
  const GradientState state = GradientState::standalone();
  const int iterated = 0, stranger = 0;
  state.add_dataloader(&iterated);
  EXPECT_THROWS_WITH(state.remove_dataloader(&stranger), "not being iterated");
  EXPECT_EQ(state.active_dataloader(), &iterated);
  state.remove_dataloader(&iterated);
  EXPECT_THROWS_WITH(state.remove_dataloader(&iterated), "not being iterated");
}

TEST(GradientState, AddingANullLoaderIsRefused) {
  const GradientState state = GradientState::standalone();
  EXPECT_THROWS_WITH(state.add_dataloader(nullptr), "add_dataloader expects a data loader, got null");
}

TEST(GradientState, SettersChangeWhatGettersReport) {
  const GradientState state = GradientState::standalone();
  state.set_sync_gradients(false);
  state.set_remainder(3);
  EXPECT_FALSE(state.sync_gradients());
  EXPECT_EQ(state.remainder(), 3);
}

TEST(GradientState, StandaloneStatesAreIndependent) {
  const GradientState a = GradientState::standalone();
  const GradientState b = GradientState::standalone();
  a.set_sync_gradients(false);
  EXPECT_TRUE(b.sync_gradients());
}

TEST(GradientState, TheProcessWideStateIsSharedAndTakesTheLatestPlugin) {
  GradientState::reset();
  GradientAccumulationPlugin plugin;
  plugin.num_steps = 8;
  const GradientState first(plugin);
  const GradientState second;
  EXPECT_EQ(second.num_steps(), 8);
  first.set_sync_gradients(false);
  EXPECT_FALSE(second.sync_gradients());
  plugin.num_steps = 2;
  const GradientState third(plugin);
  EXPECT_EQ(first.num_steps(), 2);
  GradientState::reset();
  EXPECT_EQ(GradientState().num_steps(), 1);
  EXPECT_TRUE(GradientState().sync_gradients());
  GradientState::reset();
}

}  // namespace
}  // namespace accelerate::testing
