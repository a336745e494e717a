// Operations over nested data across ranks running as threads (upstream: test_ops.py and the
// operations part of test_utils.py).
#include "accelerate/utils/operations.h"
#include "support/test_support.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

struct Batch {
  at::Tensor input;
  std::vector<at::Tensor> extras;
  int64_t step = 0;
};

template <>
struct accelerate::TensorTree<Batch> {
  template <typename F>
  static Batch map(const Batch& b, F&& f) {
    return {f(b.input), f(b.extras), f(b.step)};
  }
};

namespace accelerate::testing {
namespace {

using ::testing::HasSubstr;

at::Tensor floats(std::vector<float> v) { return at::tensor(v, at::kFloat); }

std::vector<float> values(const at::Tensor& t) {
  auto c = t.to(at::kFloat).contiguous();
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

std::vector<float> one_to(int n) {
  std::vector<float> v;
  for (int i = 1; i <= n; ++i) v.push_back(static_cast<float>(i));
  return v;
}

class Operations : public ::testing::TestWithParam<int> {};

TEST_P(Operations, GatherConcatenatesEveryRanksTensorInRankOrder) {
  const int n = GetParam();
  run_ranks(n, [n](const PartialState& state) {
    auto t = at::arange(n, at::kFloat) + 1 + n * state.process_index();
    EXPECT_EQ(values(gather(state, t)), one_to(n * n));
  });
}

TEST_P(Operations, GatherTurnsZeroDimTensorsIntoOneDim) {
  const int n = GetParam();
  run_ranks(n, [n](const PartialState& state) {
    auto gathered = gather(state, at::scalar_tensor(state.process_index(), at::kLong));
    EXPECT_EQ(gathered.dim(), 1);
    EXPECT_EQ(gathered.size(0), n);
    EXPECT_EQ(gathered.sum().item<int64_t>(), n * (n - 1) / 2);
  });
}

TEST_P(Operations, GatherObjectConcatenatesEveryRanksList) {
  const int n = GetParam();
  run_ranks(n, [n](const PartialState& state) {
    std::vector<int64_t> expected;
    for (int i = 0; i < n; ++i) expected.push_back(i);
    EXPECT_EQ(gather_object(state, std::vector<int64_t>{state.process_index()}), expected);
    auto names = gather_object(state, std::vector<std::string>{"rank" + std::to_string(state.process_index())});
    EXPECT_EQ(names.back(), "rank" + std::to_string(n - 1));
  });
}

TEST_P(Operations, BroadcastGivesEveryRankTheSendersTensor) {
  const int n = GetParam();
  run_ranks(n, [n](const PartialState& state) {
    auto mine = state.is_main_process() ? at::arange(n, at::kFloat) + 1 : at::zeros({n}, at::kFloat);
    EXPECT_EQ(values(broadcast(state, mine)), one_to(n));
    auto last = at::full({2}, static_cast<float>(state.process_index()));
    EXPECT_EQ(values(broadcast(state, last, n - 1)), std::vector<float>(2, static_cast<float>(n - 1)));
  });
}

TEST_P(Operations, PadAcrossProcessesPadsToTheLongestAtTheEndOrFront) {
  const int n = GetParam();
  run_ranks(n, [n](const PartialState& state) {
    auto t = state.is_main_process() ? at::arange(n + 1, at::kFloat) : at::arange(n, at::kFloat);
    auto padded = pad_across_processes(state, t, /*dim=*/0, /*pad_index=*/-1);
    ASSERT_EQ(padded.size(0), n + 1);
    if (!state.is_main_process() || n == 1) {
      EXPECT_EQ(padded[n].item<float>(), n == 1 ? 1.0f : -1.0f);
      auto front = pad_across_processes(state, t, 0, -1, /*pad_first=*/true);
      EXPECT_EQ(front[0].item<float>(), n == 1 ? 0.0f : -1.0f);
      EXPECT_EQ(front[n].item<float>(), n == 1 ? 1.0f : static_cast<float>(n - 1));
    } else {
      EXPECT_TRUE(padded.equal(t));
      (void)pad_across_processes(state, t, 0, -1, /*pad_first=*/true);  // every rank takes part
    }
  });
}

TEST_P(Operations, NestedDataKeepsItsTypesThroughGather) {
  const int n = GetParam();
  using Nested = std::map<std::string, std::tuple<at::Tensor, std::vector<at::Tensor>, std::optional<at::Tensor>>>;
  run_ranks(n, [n](const PartialState& state) {
    const float r = static_cast<float>(state.process_index());
    Nested data = {{"a", {at::full({1}, r), {at::full({2}, r), at::full({1, 2}, r)}, std::nullopt}},
                   {"b", {at::full({1}, 10 + r), {}, at::full({1}, 20 + r)}}};
    Nested out = gather(state, data);
    EXPECT_EQ(std::get<0>(out.at("a")).size(0), n);
    EXPECT_EQ(std::get<1>(out.at("a"))[0].size(0), 2 * n);
    EXPECT_EQ(std::get<1>(out.at("a"))[1].sizes(), (std::vector<int64_t>{n, 2}));
    EXPECT_FALSE(std::get<2>(out.at("a")).has_value());
    EXPECT_EQ(values(*std::get<2>(out.at("b"))).back(), 20.0f + static_cast<float>(n - 1));
  });
}

TEST_P(Operations, EverySupportedContainerRoundTripsThroughGather) {
  const int n = GetParam();
  run_ranks(n, [n](const PartialState& state) {
    const float r = static_cast<float>(state.process_index());
    // A user struct through its TensorTree specialisation: local operations keep the step,
    // collectives refuse it by type, as they refuse any non-tensor value.
    Batch batch{at::full({1}, r).to(at::kBFloat16), {at::full({2}, r)}, 7};
    Batch fp32 = convert_to_fp32(batch);
    EXPECT_EQ(fp32.input.scalar_type(), at::kFloat);
    EXPECT_EQ(fp32.step, 7);
    EXPECT_THROWS_WITH(gather(state, batch), "[gather] unsupported type (long)");
    auto pair = gather(state, std::make_pair(fp32.input, fp32.extras));
    EXPECT_EQ(pair.first.size(0), n);
    EXPECT_EQ(pair.second[0].size(0), 2 * n);
    // torch::data::Example with and without a target.
    auto ex = gather(state, torch::data::Example<>(at::full({1}, r), at::full({1}, 10 + r)));
    EXPECT_EQ(values(ex.target).back(), 10.0f + static_cast<float>(n - 1));
    auto only_data = gather(state, torch::data::TensorExample(at::full({1}, r)));
    EXPECT_EQ(only_data.data.size(0), n);
    // torch::OrderedDict keeps its key order; std::array its size.
    torch::OrderedDict<std::string, at::Tensor> dict;
    dict.insert("z", at::full({1}, r));
    dict.insert("a", at::full({1}, 2 * r));
    auto d = gather(state, dict);
    EXPECT_EQ(d.keys(), (std::vector<std::string>{"z", "a"}));
    EXPECT_EQ(values(d["a"]).back(), 2.0f * static_cast<float>(n - 1));
    auto arr = gather(state, std::array<at::Tensor, 2>{at::full({1}, r), at::full({3}, r)});
    EXPECT_EQ(arr[1].size(0), 3 * n);
    // c10::IValue: a tuple holding a list of tensors.
    c10::IValue iv = c10::ivalue::Tuple::create({c10::IValue(c10::List<at::Tensor>({at::full({2}, r)}))});
    auto gathered = gather(state, iv);
    EXPECT_EQ(gathered.toTupleRef().elements()[0].toList().get(0).toTensor().size(0), 2 * n);
  });
}

TEST_P(Operations, NonContiguousTensorsAreGathered) {
  const int n = GetParam();
  run_ranks(n, [n](const PartialState& state) {
    auto t = at::arange(6, at::kFloat).reshape({2, 3}).t();  // 3x2, not contiguous
    ASSERT_FALSE(t.is_contiguous());
    auto g = gather(state, t);
    EXPECT_EQ(g.sizes(), (std::vector<int64_t>{3 * n, 2}));
    EXPECT_TRUE(g.slice(0, 0, 3).equal(t));
  });
}

TEST(GatherForMetrics, DropsTheDuplicatesOfTheLastBatch) {
  // 22 samples, batch 4 per process on 2 processes, even batches: the loader's last round is
  // topped up with samples from the start, and gather_for_metrics must hand back exactly 22.
  run_ranks(2, [](const PartialState& state) {
    GradientState gs = GradientState::standalone();
    const std::vector<std::vector<std::vector<int64_t>>> batches = {
        {{0, 1, 2, 3}, {8, 9, 10, 11}, {16, 17, 18, 19}},   // rank 0
        {{4, 5, 6, 7}, {12, 13, 14, 15}, {20, 21, 0, 1}}};  // rank 1
    std::vector<int64_t> seen;
    for (size_t step = 0; step < 3; ++step) {
      gs.set_end_of_dataloader(step == 2);
      gs.set_remainder(22 % 8);
      auto out = gather_for_metrics(state, gs, at::tensor(batches[state.process_index()][step], at::kLong));
      for (int64_t i = 0; i < out.size(0); ++i) seen.push_back(out[i].item<int64_t>());
    }
    ASSERT_EQ(seen.size(), 22u);
    std::sort(seen.begin(), seen.end());
    for (int64_t i = 0; i < 22; ++i) EXPECT_EQ(seen[i], i);
    gs.set_end_of_dataloader(true);
    auto objects = gather_object_for_metrics(state, gs, std::vector<std::string>{"x", "y", "z", "w"});
    EXPECT_EQ(objects.size(), 6u);
  });
}

TEST_P(Operations, CopyTensorToDevicesSendsTheOnlyDefinedTensorEverywhere) {
  const int n = GetParam();
  run_ranks(n, [n](const PartialState& state) {
    const bool owner = state.process_index() == n - 1;
    auto t = owner ? at::arange(5, at::kInt).reshape({1, 5}) : at::Tensor();
    auto out = copy_tensor_to_devices(state, t);
    EXPECT_EQ(out.scalar_type(), at::kInt);
    EXPECT_TRUE(out.equal(at::arange(5, at::kInt).reshape({1, 5})));
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, Operations, ::testing::Values(1, 2, 4),
                         [](const auto& info) { return std::to_string(info.param) + "ranks"; });

TEST(Reduce, SumMeanAndMaxAtTwoRanks) {
  run_ranks(2, [](const PartialState& state) {
    auto t = state.is_main_process() ? floats({1, 2}) : floats({3, 4});
    EXPECT_EQ(values(reduce(state, t, "sum")), (std::vector<float>{4, 6}));
    EXPECT_EQ(values(reduce(state, t, "mean")), (std::vector<float>{2, 3}));
    EXPECT_EQ(values(reduce(state, t, "max")), (std::vector<float>{3, 4}));
    EXPECT_EQ(values(reduce(state, t)), (std::vector<float>{2, 3}));  // the utility's default is mean
    EXPECT_EQ(values(reduce(state, t, "sum", 0.5)), (std::vector<float>{2, 3}));
    EXPECT_EQ(values(reduce(state, t.to(at::kBFloat16), "sum")), (std::vector<float>{4, 6}));
    EXPECT_TRUE(t.equal(state.is_main_process() ? floats({1, 2}) : floats({3, 4}))) << "the input was modified";
  });
}

TEST(Reduce, AnUnknownReductionIsNamed) {
  run_ranks(1, [](const PartialState& state) {
    EXPECT_THROWS_WITH(reduce(state, floats({1}), "median"), "expected a reduction among sum, mean, max, min, prod, got 'median'");
  });
}

TEST(BroadcastObjectList, ReplacesTheListWithTheSendersInPlace) {
  run_ranks(2, [](const PartialState& state) {
    std::vector<std::string> objects = {state.is_main_process() ? "from zero" : "stale", "second"};
    auto& same = broadcast_object_list(state, objects);
    EXPECT_EQ(&same, &objects);
    EXPECT_EQ(objects, (std::vector<std::string>{"from zero", "second"}));
  });
}

TEST(Broadcast, ASenderOutsideTheProcessesIsRefusedOnEveryProcessBeforeAnyCollective) {
  // Every process refuses it alike (none waits in a collective the others never join), and the
  // processes go on to broadcast normally afterwards.
  std::vector<std::string> tensor_errors(2), object_errors(2);
  std::vector<float> after(2, -1);
  run_ranks(2, [&](const PartialState& state) {
    const int rank = state.process_index();
    tensor_errors[rank] = error_of([&] { broadcast(state, floats({1}), 2); });
    std::vector<std::string> objects = {"x"};
    object_errors[rank] = error_of([&] { broadcast_object_list(state, objects, -1); });
    after[rank] = broadcast(state, floats({static_cast<float>(rank + 7)}), 1).item<float>();
  });
  for (int rank : {0, 1}) {
    EXPECT_THAT(tensor_errors[rank], HasSubstr("from_process 2 is outside [0, 2)")) << "process " << rank;
    EXPECT_THAT(object_errors[rank], HasSubstr("[broadcast_object_list] from_process -1 is outside [0, 2)"))
        << "process " << rank;
    EXPECT_EQ(after[rank], 8.f) << "process " << rank;
  }
}

TEST(CopyTensorToDevices, TwoOwnersAreRefused) {
  EXPECT_THROWS_WITH(run_ranks(2, [](const PartialState& state) { copy_tensor_to_devices(state, floats({1})); }),
                     "exactly one process must hold the tensor");
}

// ---- local transformations ---------------------------------------------------------------------

TEST(Concatenate, JoinsMatchingStructuresTensorByTensor) {
  using Pair = std::pair<at::Tensor, std::vector<at::Tensor>>;
  std::vector<Pair> parts = {{floats({1}), {floats({10, 11})}}, {floats({2, 3}), {floats({12})}}};
  Pair out = concatenate(parts);
  EXPECT_EQ(values(out.first), (std::vector<float>{1, 2, 3}));
  EXPECT_EQ(values(out.second[0]), (std::vector<float>{10, 11, 12}));
  EXPECT_THROWS_WITH(concatenate(std::vector<Pair>{}), "expected at least one element");
  std::vector<std::vector<at::Tensor>> ragged = {{floats({1})}, {floats({1}), floats({2})}};
  EXPECT_THROWS_WITH(concatenate(ragged), "every element must hold the same number of tensors");
}

TEST(SendToDevice, MovesTensorsButNotSkippedKeys) {
  std::map<std::string, at::Tensor> batch = {{"input", floats({1})}, {"keep", floats({2})}};
  auto moved = send_to_device(batch, c10::Device(c10::kMeta), /*non_blocking=*/false, {"keep"});
  EXPECT_TRUE(moved.at("input").is_meta());
  EXPECT_TRUE(moved.at("keep").device().is_cpu());
}

TEST(RecursivelyApply, RefusesOtherTypesOnlyWhenAsked) {
  std::tuple<at::Tensor, int> data{floats({1, 2}), 7};
  auto doubled = recursively_apply([](const at::Tensor& t) { return t * 2; }, data);
  EXPECT_EQ(values(std::get<0>(doubled)), (std::vector<float>{2, 4}));
  EXPECT_EQ(std::get<1>(doubled), 7);
  EXPECT_THROWS_WITH(recursively_apply([](const at::Tensor& t) { return t; }, data, /*error_on_other_type=*/true),
                     "[recursively_apply] unsupported type");
}

TEST(RecursivelyApply, WalksIValueListsTuplesAndDicts) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  dict.insert("x", floats({1}));
  dict.insert("label", std::string("cat"));
  c10::IValue data = c10::ivalue::Tuple::create({c10::IValue(dict), c10::IValue(c10::List<at::Tensor>({floats({2})}))});
  auto out = recursively_apply([](const at::Tensor& t) { return t + 1; }, data);
  const auto& elements = out.toTupleRef().elements();
  EXPECT_EQ(values(elements[0].toGenericDict().at("x").toTensor()), (std::vector<float>{2}));
  EXPECT_EQ(elements[0].toGenericDict().at("label").toStringRef(), "cat");
  EXPECT_EQ(values(elements[1].toList().get(0).toTensor()), (std::vector<float>{3}));
}

TEST(ConvertToFp32, OnlyHalfPrecisionTensorsChange) {
  auto out = convert_to_fp32(std::vector<at::Tensor>{floats({1}).to(at::kBFloat16), floats({1}).to(at::kHalf),
                                                     at::ones({1}, at::kLong)});
  EXPECT_EQ(out[0].scalar_type(), at::kFloat);
  EXPECT_EQ(out[1].scalar_type(), at::kFloat);
  EXPECT_EQ(out[2].scalar_type(), at::kLong);
}

TEST(ConvertOutputsToFp32, TheWrappedFunctionsHalfPrecisionOutputsComeBackInFp32) {
  int calls = 0;
  auto forward = convert_outputs_to_fp32([&](const at::Tensor& x, int64_t shift) {
    ++calls;
    return std::make_pair((x + shift).to(at::kBFloat16), at::ones({2}, at::kLong));
  });
  const auto [out, ids] = forward(floats({1.5, 2}), 1);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(out.scalar_type(), at::kFloat);
  EXPECT_EQ(values(out), (std::vector<float>{2.5, 3}));
  EXPECT_EQ(ids.scalar_type(), at::kLong);
}

TEST(FindBatchSize, ReadsTheFirstTensorsFirstDimension) {
  EXPECT_EQ(find_batch_size(std::make_pair(at::zeros({5, 2}), at::zeros({3}))), 5);
  EXPECT_THROWS_WITH(find_batch_size(std::vector<at::Tensor>{}), "the data holds none");
  EXPECT_THROWS_WITH(find_batch_size(at::scalar_tensor(1)), "0-dim");
}

TEST(SliceTensors, CutsEveryTensorOnTheFirstDimension) {
  auto out = slice_tensors(std::vector<at::Tensor>{at::arange(6), at::arange(4)}, 1, 3);
  EXPECT_TRUE(out[0].equal(at::arange(1, 3)));
  EXPECT_TRUE(out[1].equal(at::arange(1, 3)));
}

TEST(Listify, TurnsTensorsIntoNestedNumberLists) {
  auto l = listify(at::arange(4, at::kFloat).reshape({2, 2}));
  ASSERT_TRUE(l.isList());
  EXPECT_EQ(l.toList().get(1).toDoubleList().get(0), 2.0);
  EXPECT_EQ(listify(at::scalar_tensor(3, at::kLong)).toInt(), 3);
}

// ---- debug mode and mismatches -----------------------------------------------------------------

PartialStateOptions debug_options() {
  PartialStateOptions options;
  options.debug = true;
  return options;
}

// Runs `op` on two ranks in debug mode and returns each rank's error message.
std::vector<std::string> errors_in_debug_mode(const std::function<void(const PartialState&)>& op) {
  std::vector<std::string> errors(2);
  run_ranks(2, [&](const PartialState& state) { errors[state.process_index()] = error_of([&] { op(state); }); },
            debug_options());
  return errors;
}

TEST(DebugMode, AShapeMismatchRaisesOnEveryRankWithEachRanksShape) {
  auto errors = errors_in_debug_mode([](const PartialState& state) {
    gather(state, at::zeros({state.is_main_process() ? 3 : 4}));
  });
  for (const auto& e : errors) {
    EXPECT_THAT(e, HasSubstr("[gather] debug mode found processes disagreeing"));
    EXPECT_THAT(e, HasSubstr("process 0: 1 tensor(s): dtype Float device cpu shape [3]"));
    EXPECT_THAT(e, HasSubstr("process 1: 1 tensor(s): dtype Float device cpu shape [4]"));
  }
}

TEST(DebugMode, ADtypeMismatchRaisesOnEveryRank) {
  auto errors = errors_in_debug_mode([](const PartialState& state) {
    reduce(state, at::zeros({2}, state.is_main_process() ? at::kFloat : at::kDouble), "sum");
  });
  for (const auto& e : errors) {
    EXPECT_THAT(e, HasSubstr("process 0: 1 tensor(s): dtype Float"));
    EXPECT_THAT(e, HasSubstr("process 1: 1 tensor(s): dtype Double"));
  }
}

TEST(DebugMode, ADeviceMismatchRaisesOnEveryRank) {
  auto errors = errors_in_debug_mode([](const PartialState& state) {
    broadcast(state, at::zeros({2}, at::TensorOptions().device(state.is_main_process() ? c10::kCPU : c10::kMeta)));
  });
  for (const auto& e : errors) {
    EXPECT_THAT(e, HasSubstr("process 0: 1 tensor(s): dtype Float device cpu"));
    EXPECT_THAT(e, HasSubstr("process 1: 1 tensor(s): dtype Float device meta"));
  }
}

TEST(DebugMode, PaddingAllowsDifferentSizesButNotDifferentDims) {
  run_ranks(2, [](const PartialState& state) {
    auto padded = pad_across_processes(state, at::zeros({state.is_main_process() ? 2 : 3}));
    EXPECT_EQ(padded.size(0), 3);
  }, debug_options());
  auto errors = errors_in_debug_mode([](const PartialState& state) {
    pad_across_processes(state, state.is_main_process() ? at::zeros({2}) : at::zeros({2, 2}));
  });
  for (const auto& e : errors) EXPECT_THAT(e, HasSubstr("process 1: 1 tensor(s): dtype Float device cpu dims 2"));
}

TEST(WithoutDebugMode, ARankThatSkipsACollectiveMakesTheOthersFailWithinTheTimeout) {
  PartialStateOptions options;
  options.init_kwargs.timeout = std::chrono::seconds(3);  // also bounds the group's making, slow under TSan
  std::atomic<bool> done{false};
  std::string error;
  run_ranks(2, [&](const PartialState& state) {
    if (state.is_main_process()) {
      error = error_of([&] { gather(state, floats({1})); });
      done = true;
    } else {
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (!done && std::chrono::steady_clock::now() < give_up) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }, options);
  EXPECT_THAT(error, HasSubstr("[gather] the collective failed on process 0 of 2"));
  EXPECT_THAT(error, ::testing::ContainsRegex("[Tt]imed out"));
}

}  // namespace
}  // namespace accelerate::testing
