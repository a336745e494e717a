// Learning-rate schedulers (lr_scheduler.h): per-step rates of LambdaLR, transformers' schedules
// and OneCycleLR against closed forms written out here and against sequences printed by PyTorch,
// momentum cycling, the step limit of OneCycleLR, state_dict round trips and hostile states, and
// the message of every argument error.
#include "accelerate/lr_scheduler.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <numbers>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/test_support.h"

namespace accelerate::testing {
namespace {

using ::testing::DoubleEq;
using ::testing::DoubleNear;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Pointwise;
using Table = std::vector<std::vector<double>>;

constexpr double kPi = std::numbers::pi;

// Two param groups, lr 0.1 (the default) and 0.02, as in the PyTorch reference script.
std::vector<torch::optim::OptimizerParamGroup> two_groups(std::unique_ptr<torch::optim::OptimizerOptions> second) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{torch::zeros({1}, torch::requires_grad())});
  groups.emplace_back(std::vector<at::Tensor>{torch::zeros({1}, torch::requires_grad())}, std::move(second));
  return groups;
}

std::shared_ptr<torch::optim::SGD> sgd(double momentum = 0.0) {
  using torch::optim::SGDOptions;
  return std::make_shared<torch::optim::SGD>(
      two_groups(std::make_unique<SGDOptions>(SGDOptions(0.02).momentum(momentum))),
      SGDOptions(0.1).momentum(momentum));
}

template <typename Optimizer, typename Options>
std::shared_ptr<Optimizer> two_group_optimizer() {
  return std::make_shared<Optimizer>(two_groups(std::make_unique<Options>(Options(0.02))), Options(0.1));
}

std::vector<double> group_lrs(const torch::optim::Optimizer& optimizer) {
  std::vector<double> out;
  for (const auto& group : optimizer.param_groups()) out.push_back(group.options().get_lr());
  return out;
}

double sgd_momentum(const torch::optim::Optimizer& optimizer, size_t group) {
  return static_cast<const torch::optim::SGDOptions&>(optimizer.param_groups()[group].options()).momentum();
}

// The rates after construction and after each of `count - 1` steps; checks on the way that the
// groups hold exactly the rates get_last_lr() reports.
Table rates(LRScheduler& scheduler, int count) {
  Table out;
  for (int i = 0; i < count; ++i) {
    if (i > 0) scheduler.step();
    EXPECT_EQ(group_lrs(*scheduler.optimizer()), scheduler.get_last_lr()) << "after " << i << " steps";
    out.push_back(scheduler.get_last_lr());
  }
  return out;
}

// Rows of `factor(epoch) * base` for the bases 0.1 and 0.02 of the two groups.
Table expected_rates(int count, const std::function<double(int64_t)>& factor) {
  Table out;
  for (int64_t e = 0; e < count; ++e) out.push_back({0.1 * factor(e), 0.02 * factor(e)});
  return out;
}

void expect_table_eq(const Table& actual, const Table& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_THAT(actual[i], Pointwise(DoubleEq(), expected[i])) << "row " << i;
  }
}

// Tables printed by PyTorch are compared bit for bit: the same operations in the same order on
// the same libm give the same doubles.
void expect_table_identical(const Table& actual, const Table& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) EXPECT_EQ(actual[i], expected[i]) << "row " << i;
}

void expect_table_near(const Table& actual, const Table& expected, double tolerance) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_THAT(actual[i], Pointwise(DoubleNear(tolerance), expected[i])) << "row " << i;
  }
}

// ---- LambdaLR -------------------------------------------------------------------------------

TEST(LambdaLR, ConstructionPerformsTheFirstStepAtEpochZero) {
  auto optimizer = sgd();
  std::vector<int64_t> epochs_seen;
  LambdaLR scheduler(optimizer, [&](int64_t epoch) {
    epochs_seen.push_back(epoch);
    return 0.5;
  });
  EXPECT_EQ(scheduler.last_epoch(), 0);
  EXPECT_EQ(scheduler.step_count(), 1);
  EXPECT_THAT(epochs_seen, ElementsAre(0, 0));  // once per group
  EXPECT_THAT(scheduler.base_lrs(), ElementsAre(0.1, 0.02));
  EXPECT_THAT(scheduler.get_last_lr(), ElementsAre(0.1 * 0.5, 0.02 * 0.5));
  EXPECT_THAT(group_lrs(*optimizer), ElementsAre(0.1 * 0.5, 0.02 * 0.5));
  EXPECT_EQ(scheduler.optimizer(), optimizer);
}

TEST(LambdaLR, EachStepSetsTheBaseRateTimesTheLambdaOfTheNewEpoch) {
  auto optimizer = sgd();
  LambdaLR scheduler(optimizer, [](int64_t epoch) { return std::pow(0.95, static_cast<double>(epoch)); });
  expect_table_eq(rates(scheduler, 12), expected_rates(12, [](int64_t e) { return std::pow(0.95, e); }));
  EXPECT_EQ(scheduler.last_epoch(), 11);
  EXPECT_EQ(scheduler.step_count(), 12);
}

TEST(LambdaLR, PerGroupLambdasEachScaleTheirOwnGroup) {
  auto optimizer = sgd();
  LambdaLR scheduler(optimizer, {[](int64_t e) { return static_cast<double>(e / 3); },
                                 [](int64_t e) { return 1.0 / static_cast<double>(e + 1); }});
  const Table actual = rates(scheduler, 12);
  for (int64_t e = 0; e < 12; ++e) {
    EXPECT_DOUBLE_EQ(actual[e][0], 0.1 * static_cast<double>(e / 3)) << e;
    EXPECT_DOUBLE_EQ(actual[e][1], 0.02 / static_cast<double>(e + 1)) << e;
  }
}

TEST(LambdaLR, BaseRatesAreTheGroupsRatesWhenItIsBuilt) {
  auto optimizer = sgd();
  optimizer->param_groups()[0].options().set_lr(0.3);
  LambdaLR scheduler(optimizer, [](int64_t e) { return 1.0 + static_cast<double>(e); });
  EXPECT_THAT(scheduler.base_lrs(), ElementsAre(0.3, 0.02));
  scheduler.step();
  EXPECT_THAT(group_lrs(*optimizer), ElementsAre(DoubleEq(0.6), DoubleEq(0.04)));
}

TEST(LambdaLR, RefusesAWrongNumberOfLambdasEmptyLambdasAndANullOptimizer) {
  auto one = [](int64_t) { return 1.0; };
  EXPECT_THROWS_WITH(LambdaLR(sgd(), std::vector<LRLambda>{one, one, one}),
                     "[LambdaLR] Expected 2 lr_lambdas (one per param group), but got 3");
  EXPECT_THROWS_WITH(LambdaLR(sgd(), LRLambda{}), "[LambdaLR] expected a function of the epoch, got an empty one");
  EXPECT_THROWS_WITH(LambdaLR(sgd(), std::vector<LRLambda>{one, LRLambda{}}),
                     "[LambdaLR] expected a function of the epoch for group 1, got an empty one");
  EXPECT_THROWS_WITH(LambdaLR(nullptr, one), "[LambdaLR] expected an optimizer, got a null pointer");
}

TEST(LambdaLR, ArgumentErrorsAreValueErrors) {
  EXPECT_THROW(LambdaLR(nullptr, [](int64_t) { return 1.0; }), c10::ValueError);
  EXPECT_THROW(get_linear_schedule_with_warmup(sgd(), -1, 10), c10::ValueError);
  EXPECT_THROW(OneCycleLR(sgd(0.9), {.max_lr = 1.0}), c10::ValueError);
}

TEST(LambdaLR, AThrowingLambdaLeavesSchedulerAndOptimizerUnchanged) {
  auto optimizer = sgd();
  LambdaLR scheduler(optimizer, [](int64_t e) {
    if (e == 2) throw std::runtime_error("no rate for epoch 2");
    return 1.0 / static_cast<double>(e + 1);
  });
  scheduler.step();
  const auto before = scheduler.get_last_lr();
  EXPECT_THROWS_WITH(scheduler.step(), "no rate for epoch 2");
  EXPECT_EQ(scheduler.last_epoch(), 1);
  EXPECT_EQ(scheduler.step_count(), 2);
  EXPECT_EQ(scheduler.get_last_lr(), before);
  EXPECT_EQ(group_lrs(*optimizer), before);
}

TEST(LambdaLR, RefusesToStepWhenTheOptimizerGainedAParamGroup) {
  auto optimizer = sgd();
  LambdaLR scheduler(optimizer, [](int64_t) { return 1.0; });
  optimizer->add_param_group(torch::optim::OptimizerParamGroup({torch::zeros({1}, torch::requires_grad())}));
  EXPECT_THROWS_WITH(scheduler.step(),
                     "[LambdaLR::step] the optimizer has 3 param groups, the scheduler was built for 2");
}

// ---- the base class -------------------------------------------------------------------------

// A subclass written against the public base alone: the rate halves every `period` epochs.
class HalvingLR : public LRScheduler {
 public:
  HalvingLR(std::shared_ptr<torch::optim::Optimizer> optimizer, int64_t period)
      : LRScheduler(std::move(optimizer)), period_(period) {
    initial_step();
  }

 protected:
  std::vector<double> compute_lr() override {
    std::vector<double> out;
    for (double base : base_lrs()) out.push_back(base * std::pow(0.5, static_cast<double>(last_epoch() / period_)));
    return out;
  }

 private:
  int64_t period_;
};

TEST(LRScheduler, ASubclassOnlyComputesTheRatesOfTheCurrentEpoch) {
  auto optimizer = sgd();
  HalvingLR scheduler(optimizer, 4);
  expect_table_eq(rates(scheduler, 12), expected_rates(12, [](int64_t e) { return std::pow(0.5, e / 4); }));
  EXPECT_FALSE(scheduler.total_steps().has_value());
  EXPECT_THROWS_WITH(HalvingLR(nullptr, 4), "[LRScheduler] expected an optimizer, got a null pointer");
  const auto state = scheduler.state_dict();
  EXPECT_EQ(state.at("last_epoch"), 11);
  EXPECT_FALSE(state.contains("lr_lambdas"));
}

TEST(LRScheduler, SetStepCountOverwritesTheCountAndRefusesNegativeCounts) {
  auto scheduler = get_constant_schedule(sgd());
  scheduler->set_step_count(scheduler->step_count() + 1);  // upstream: `_step_count += 1` while accumulating
  EXPECT_EQ(scheduler->step_count(), 2);
  EXPECT_EQ(scheduler->last_epoch(), 0);
  scheduler->step();
  EXPECT_EQ(scheduler->step_count(), 3);
  EXPECT_EQ(scheduler->last_epoch(), 1);
  EXPECT_THROWS_WITH(scheduler->set_step_count(-1), "[LambdaLR::set_step_count] expected a count >= 0, got -1");
  EXPECT_EQ(scheduler->step_count(), 3);
}

TEST(LRScheduler, StateDictIsPlainJsonWithNullsForTheLambdas) {
  auto scheduler = get_linear_schedule_with_warmup(sgd(), 2, 10);
  scheduler->step();
  scheduler->step();
  scheduler->step();
  const auto state = scheduler->state_dict();
  const auto expected = nlohmann::json::parse(R"({
      "base_lrs": [0.1, 0.02], "last_epoch": 3, "step_count": 4, "lr_lambdas": [null, null]})");
  for (const auto& [key, value] : expected.items()) EXPECT_EQ(state.at(key), value) << key;
  EXPECT_THAT(state.at("last_lr").get<std::vector<double>>(), Pointwise(DoubleEq(), scheduler->get_last_lr()));
  EXPECT_EQ(state.size(), 5u);
  // It survives text.
  EXPECT_EQ(nlohmann::json::parse(state.dump()), state);
}

// Saves after `k` steps, loads into a scheduler built afresh by `make` (whose optimizer has been
// stepped elsewhere meanwhile), and checks that both continue identically.
void expect_resumes_identically(const std::function<std::shared_ptr<LRScheduler>()>& make, int k, int more) {
  auto original = make();
  for (int i = 0; i < k; ++i) original->step();
  const auto saved = nlohmann::json::parse(original->state_dict().dump());

  auto resumed = make();
  resumed->step();  // a different position, overwritten by the load
  resumed->load_state_dict(saved);
  EXPECT_EQ(resumed->last_epoch(), original->last_epoch());
  EXPECT_EQ(resumed->step_count(), original->step_count());
  EXPECT_EQ(resumed->get_last_lr(), original->get_last_lr());
  EXPECT_EQ(resumed->base_lrs(), original->base_lrs());
  EXPECT_EQ(resumed->state_dict(), original->state_dict());
  for (int i = 0; i < more; ++i) {
    original->step();
    resumed->step();
    EXPECT_EQ(resumed->get_last_lr(), original->get_last_lr()) << "step " << k + i + 1;
    EXPECT_EQ(group_lrs(*resumed->optimizer()), group_lrs(*original->optimizer())) << "step " << k + i + 1;
  }
}

TEST(LRScheduler, StateDictRoundTripResumesTheIdenticalSequence) {
  expect_resumes_identically([] { return get_cosine_schedule_with_warmup(sgd(), 3, 20); }, 5, 15);
  expect_resumes_identically([] { return get_polynomial_decay_schedule_with_warmup(sgd(), 2, 12, 1e-4, 2.0); }, 7, 8);
  expect_resumes_identically(
      [] {
        auto optimizer = sgd();
        optimizer->param_groups()[1].options().set_lr(0.5);  // base rates are part of the state
        return std::make_shared<LambdaLR>(optimizer, [](int64_t e) { return 1.0 / static_cast<double>(e + 1); });
      },
      4, 6);
}

TEST(LRScheduler, LoadStateDictRefusesMissingOrMistypedKeysAndChangesNothing) {
  auto scheduler = get_linear_schedule_with_warmup(sgd(), 2, 10);
  scheduler->step();
  const auto good = scheduler->state_dict();
  auto with = [&](const std::string& key, nlohmann::json value) {
    auto state = good;
    state[key] = std::move(value);
    return state;
  };
  auto without = [&](const std::string& key) {
    auto state = good;
    state.erase(key);
    return state;
  };
  const std::string where = "[LambdaLR::load_state_dict] ";
  struct Case {
    nlohmann::json state;
    std::string message;
  };
  const std::vector<Case> cases = {
      {nlohmann::json::array({1, 2}), where + "expected a JSON object, got array"},
      {nullptr, where + "expected a JSON object, got null"},
      {without("base_lrs"), where + "expected the key \"base_lrs\", it is missing"},
      {with("base_lrs", {0.1}),
       where + "expected \"base_lrs\" to be a list of 2 finite numbers (one per param group), got [0.1]"},
      {with("base_lrs", {0.1, "x"}), "expected \"base_lrs\" to be a list of 2 finite numbers"},
      {with("base_lrs", "0.1"), "expected \"base_lrs\" to be a list of 2 finite numbers"},
      {without("last_epoch"), where + "expected the key \"last_epoch\", it is missing"},
      {with("last_epoch", -1), where + "expected \"last_epoch\" to be an integer >= 0, got -1"},
      {with("last_epoch", 1.5), "expected \"last_epoch\" to be an integer >= 0, got 1.5"},
      {with("last_epoch", "3"), "expected \"last_epoch\" to be an integer >= 0, got \"3\""},
      {with("last_epoch", std::numeric_limits<uint64_t>::max()), "expected \"last_epoch\" to be an integer >= 0"},
      {without("step_count"), where + "expected the key \"step_count\", it is missing"},
      {with("step_count", true), "expected \"step_count\" to be an integer >= 0, got true"},
      {without("last_lr"), where + "expected the key \"last_lr\", it is missing"},
      {with("last_lr", nullptr),
       "expected \"last_lr\" to be a list of 2 finite numbers (one per param group), got null"},
      {without("lr_lambdas"), where + "expected the key \"lr_lambdas\", it is missing"},
      {with("lr_lambdas", {nullptr}),
       where + "expected \"lr_lambdas\" to be a list of 2 nulls (functions are not saved), got [null]"},
      {with("lr_lambdas", {nullptr, 1}), "expected \"lr_lambdas\" to be a list of 2 nulls"},
      {with("base_lrs", std::string(500, 'x')), std::string(10, 'x') + "..."},  // long values are cut short
  };
  for (const auto& c : cases) {
    EXPECT_THROWS_WITH(scheduler->load_state_dict(c.state), c.message) << c.state.dump().substr(0, 100);
    EXPECT_THROW(scheduler->load_state_dict(c.state), c10::ValueError);
    EXPECT_EQ(scheduler->state_dict(), good) << c.state.dump().substr(0, 100);
  }
  const auto long_message = error_of([&] { scheduler->load_state_dict(with("base_lrs", std::string(500, 'x'))); });
  EXPECT_LT(long_message.size(), 300u);
}

// ---- transformers' schedules ----------------------------------------------------------------

// transformers' warmup factor: float(step) / float(max(1, num_warmup_steps)).
double warmup(int64_t step, int64_t num_warmup_steps) {
  return static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, num_warmup_steps));
}

TEST(ConstantSchedule, KeepsTheRatesTheGroupsHad) {
  auto optimizer = sgd();
  auto scheduler = get_constant_schedule(optimizer);
  expect_table_eq(rates(*scheduler, 12), expected_rates(12, [](int64_t) { return 1.0; }));
  EXPECT_THROWS_WITH(get_constant_schedule(nullptr),
                     "[get_constant_schedule] expected an optimizer, got a null pointer");
}

TEST(ConstantScheduleWithWarmup, RisesLinearlyFromZeroThenStaysAtTheBaseRate) {
  auto scheduler = get_constant_schedule_with_warmup(sgd(), 4);
  expect_table_eq(rates(*scheduler, 12), expected_rates(12, [](int64_t e) { return e < 4 ? e / 4.0 : 1.0; }));
  // No warmup at all: the base rate from epoch 0.
  auto flat = get_constant_schedule_with_warmup(sgd(), 0);
  expect_table_eq(rates(*flat, 3), expected_rates(3, [](int64_t) { return 1.0; }));
}

TEST(LinearScheduleWithWarmup, RisesThenFallsLinearlyToZeroAndStaysThere) {
  auto scheduler = get_linear_schedule_with_warmup(sgd(), 3, 9);
  // Up over 3 steps, then (9 - e) / 6 down to 0 at step 9, clamped at 0 after.
  expect_table_eq(rates(*scheduler, 12), expected_rates(12, [](int64_t e) {
                    return e < 3 ? e / 3.0 : std::max(0.0, static_cast<double>(9 - e) / 6.0);
                  }));
  EXPECT_DOUBLE_EQ(scheduler->get_last_lr()[0], 0.0);
}

TEST(CosineScheduleWithWarmup, FollowsHalfACosineDownToZeroAfterTheWarmup) {
  auto scheduler = get_cosine_schedule_with_warmup(sgd(), 3, 10);
  auto factor = [](int64_t e) {
    if (e < 3) return e / 3.0;
    const double progress = static_cast<double>(e - 3) / 7.0;  // 0 → 1 over 7 steps
    return (1.0 + std::cos(kPi * progress)) / 2.0;
  };
  expect_table_near(rates(*scheduler, 12), expected_rates(12, factor), 1e-15);
}

TEST(CosineScheduleWithWarmup, MatchesTransformersOnPyTorch) {
  // Printed by PyTorch 1.13's LambdaLR (Debian python3-torch) with transformers'
  // `_get_cosine_schedule_with_warmup_lr_lambda` (optimization.py, transcribed verbatim; the package
  // itself was not installable), num_warmup_steps=3, num_training_steps=10, num_cycles=0.5, over an
  // SGD with groups of lr 0.1 and 0.02; rows are get_last_lr() after 0..11 steps.
  const Table pytorch = {
      {0.0, 0.0},
      {0.03333333333333333, 0.006666666666666666},
      {0.06666666666666667, 0.013333333333333332},
      {0.1, 0.02},
      {0.09504844339512096, 0.01900968867902419},
      {0.08117449009293669, 0.016234898018587338},
      {0.06112604669781572, 0.012225209339563144},
      {0.03887395330218429, 0.007774790660436856},
      {0.018825509907063328, 0.0037651019814126654},
      {0.004951556604879049, 0.0009903113209758097},
      {0.0, 0.0},
      {0.004951556604879043, 0.0009903113209758087},  // past the end the cosine rises again
  };
  expect_table_identical(rates(*get_cosine_schedule_with_warmup(sgd(), 3, 10, 0.5), 12), pytorch);
}

TEST(CosineScheduleWithWarmup, NumCyclesSetsTheNumberOfWaves) {
  auto scheduler = get_cosine_schedule_with_warmup(sgd(), 0, 8, 2.0);
  // Two full waves over 8 steps: 1 at steps 0, 4 and 8, 0 at steps 2 and 6.
  const Table actual = rates(*scheduler, 9);
  for (int e : {0, 4, 8}) EXPECT_NEAR(actual[e][0], 0.1, 1e-15) << e;
  for (int e : {2, 6}) EXPECT_NEAR(actual[e][0], 0.0, 1e-15) << e;
  EXPECT_NEAR(actual[1][1], 0.02 * 0.5, 1e-15);
}

TEST(CosineWithHardRestartsScheduleWithWarmup, RestartsAtTheBaseRateEachCycleAndEndsAtZero) {
  auto scheduler = get_cosine_with_hard_restarts_schedule_with_warmup(sgd(), 2, 11, 3);
  // After 2 warmup steps, 3 cycles of 3 steps each: (1 + cos(pi * (position in cycle) / 3)) / 2.
  auto factor = [](int64_t e) {
    if (e < 2) return e / 2.0;
    if (e >= 11) return 0.0;
    const double in_cycle = static_cast<double>((e - 2) % 3) / 3.0;
    return (1.0 + std::cos(kPi * in_cycle)) / 2.0;
  };
  expect_table_near(rates(*scheduler, 13), expected_rates(13, factor), 1e-15);
}

TEST(CosineWithHardRestartsScheduleWithWarmup, MatchesTransformersOnPyTorch) {
  // Printed by PyTorch 1.13's LambdaLR with transformers'
  // `_get_cosine_with_hard_restarts_schedule_with_warmup_lr_lambda` (transcribed verbatim),
  // num_warmup_steps=2, num_training_steps=10, num_cycles=3, groups of lr 0.1 and 0.02.
  const Table pytorch = {
      {0.0, 0.0},
      {0.05, 0.01},
      {0.1, 0.02},
      {0.0691341716182545, 0.0138268343236509},
      {0.014644660940672627, 0.0029289321881345253},
      {0.09619397662556434, 0.019238795325112867},
      {0.05, 0.01},
      {0.0038060233744356634, 0.0007612046748871326},
      {0.08535533905932738, 0.017071067811865476},
      {0.030865828381745515, 0.006173165676349103},
      {0.0, 0.0},
      {0.0, 0.0},
  };
  expect_table_identical(rates(*get_cosine_with_hard_restarts_schedule_with_warmup(sgd(), 2, 10, 3), 12), pytorch);
}

TEST(PolynomialDecayScheduleWithWarmup, DecaysFromTheDefaultRateToLrEndScaledPerGroup) {
  // lr_init is the optimizer's default rate (0.1); group 1 (0.02) follows the same curve scaled.
  auto scheduler = get_polynomial_decay_schedule_with_warmup(sgd(), 2, 8, 0.004, 3.0);
  auto factor = [](int64_t e) {
    if (e < 2) return e / 2.0;
    if (e > 8) return 0.004 / 0.1;
    const double remaining = 1.0 - static_cast<double>(e - 2) / 6.0;
    return ((0.1 - 0.004) * remaining * remaining * remaining + 0.004) / 0.1;
  };
  expect_table_near(rates(*scheduler, 12), expected_rates(12, factor), 1e-15);
  EXPECT_NEAR(scheduler->get_last_lr()[0], 0.004, 1e-17);
}

TEST(PolynomialDecayScheduleWithWarmup, MatchesTransformersOnPyTorch) {
  // Printed by PyTorch 1.13's LambdaLR with transformers'
  // `_get_polynomial_decay_schedule_with_warmup_lr_lambda` (transcribed verbatim),
  // num_warmup_steps=2, num_training_steps=9, lr_end=1e-3, power=2, lr_init=defaults["lr"]=0.1,
  // groups of lr 0.1 and 0.02.
  const Table pytorch = {
      {0.0, 0.0},
      {0.05, 0.01},
      {0.1, 0.02},
      {0.07373469387755104, 0.014746938775510206},
      {0.05151020408163265, 0.01030204081632653},
      {0.0333265306122449, 0.00666530612244898},
      {0.01918367346938776, 0.0038367346938775514},
      {0.009081632653061226, 0.0018163265306122452},
      {0.0030204081632653076, 0.0006040816326530615},
      {0.001, 0.0002},
      {0.001, 0.0002},
      {0.001, 0.0002},
  };
  expect_table_identical(rates(*get_polynomial_decay_schedule_with_warmup(sgd(), 2, 9, 1e-3, 2.0), 12), pytorch);
}

TEST(PolynomialDecayScheduleWithWarmup, RefusesAnLrEndNotBelowTheInitialRate) {
  EXPECT_THROWS_WITH(get_polynomial_decay_schedule_with_warmup(sgd(), 2, 9, 0.1),
                     "[get_polynomial_decay_schedule_with_warmup] lr_end (0.1) must be smaller than initial lr (0.1)");
  EXPECT_THROWS_WITH(get_polynomial_decay_schedule_with_warmup(sgd(), 2, 9, 0.5),
                     "lr_end (0.5) must be smaller than initial lr (0.1)");
  EXPECT_THROW(get_polynomial_decay_schedule_with_warmup(sgd(), 2, 9, 0.5), c10::ValueError);
}

TEST(TransformersSchedules, RefuseNegativeStepCountsAndNullOptimizers) {
  EXPECT_THROWS_WITH(get_constant_schedule_with_warmup(sgd(), -1),
                     "[get_constant_schedule_with_warmup] num_warmup_steps must be >= 0, got -1");
  EXPECT_THROWS_WITH(get_linear_schedule_with_warmup(sgd(), -2, 10),
                     "[get_linear_schedule_with_warmup] num_warmup_steps must be >= 0, got -2");
  EXPECT_THROWS_WITH(get_linear_schedule_with_warmup(sgd(), 2, -10),
                     "[get_linear_schedule_with_warmup] num_training_steps must be >= 0, got -10");
  EXPECT_THROWS_WITH(get_cosine_schedule_with_warmup(sgd(), -1, 10),
                     "[get_cosine_schedule_with_warmup] num_warmup_steps must be >= 0, got -1");
  EXPECT_THROWS_WITH(get_cosine_schedule_with_warmup(sgd(), 1, -3),
                     "[get_cosine_schedule_with_warmup] num_training_steps must be >= 0, got -3");
  EXPECT_THROWS_WITH(get_cosine_with_hard_restarts_schedule_with_warmup(sgd(), -5, 10),
                     "[get_cosine_with_hard_restarts_schedule_with_warmup] num_warmup_steps must be >= 0, got -5");
  EXPECT_THROWS_WITH(get_cosine_with_hard_restarts_schedule_with_warmup(sgd(), 0, -1),
                     "[get_cosine_with_hard_restarts_schedule_with_warmup] num_training_steps must be >= 0, got -1");
  EXPECT_THROWS_WITH(get_polynomial_decay_schedule_with_warmup(sgd(), -1, 10),
                     "[get_polynomial_decay_schedule_with_warmup] num_warmup_steps must be >= 0, got -1");
  EXPECT_THROWS_WITH(get_polynomial_decay_schedule_with_warmup(sgd(), 0, -10),
                     "[get_polynomial_decay_schedule_with_warmup] num_training_steps must be >= 0, got -10");

  const std::string null = "expected an optimizer, got a null pointer";
  EXPECT_THROWS_WITH(get_constant_schedule_with_warmup(nullptr, 1), "[get_constant_schedule_with_warmup] " + null);
  EXPECT_THROWS_WITH(get_linear_schedule_with_warmup(nullptr, 1, 2), "[get_linear_schedule_with_warmup] " + null);
  EXPECT_THROWS_WITH(get_cosine_schedule_with_warmup(nullptr, 1, 2), "[get_cosine_schedule_with_warmup] " + null);
  EXPECT_THROWS_WITH(get_cosine_with_hard_restarts_schedule_with_warmup(nullptr, 1, 2),
                     "[get_cosine_with_hard_restarts_schedule_with_warmup] " + null);
  EXPECT_THROWS_WITH(get_polynomial_decay_schedule_with_warmup(nullptr, 1, 2),
                     "[get_polynomial_decay_schedule_with_warmup] " + null);
}

TEST(TransformersSchedules, RefuseCyclesPowersAndEndsThatMakeNoSchedule) {
  EXPECT_THROWS_WITH(get_cosine_schedule_with_warmup(sgd(), 1, 10, -0.5),
                     "[get_cosine_schedule_with_warmup] num_cycles must be a finite number >= 0, got -0.5");
  EXPECT_THROWS_WITH(get_cosine_schedule_with_warmup(sgd(), 1, 10, std::nan("")),
                     "[get_cosine_schedule_with_warmup] num_cycles must be a finite number >= 0, got nan");
  EXPECT_THROWS_WITH(get_cosine_with_hard_restarts_schedule_with_warmup(sgd(), 1, 10, -1),
                     "[get_cosine_with_hard_restarts_schedule_with_warmup] num_cycles must be >= 0, got -1");
  EXPECT_THROWS_WITH(get_polynomial_decay_schedule_with_warmup(sgd(), 5, 5),
                     "[get_polynomial_decay_schedule_with_warmup] num_training_steps (5) must be greater than "
                     "num_warmup_steps (5): the decay would divide by zero steps");
  EXPECT_THROWS_WITH(get_polynomial_decay_schedule_with_warmup(sgd(), 1, 5, -1e-3),
                     "[get_polynomial_decay_schedule_with_warmup] lr_end must be a finite number >= 0, got -0.001");
  EXPECT_THROWS_WITH(get_polynomial_decay_schedule_with_warmup(sgd(), 1, 5, 1e-7, -1.0),
                     "[get_polynomial_decay_schedule_with_warmup] power must be a finite number >= 0, got -1");
}

TEST(TransformersSchedules, WarmupOnlyFunctionsShareTheWarmupRamp) {
  // Every *_with_warmup schedule starts at 0 and reaches the base rate at num_warmup_steps.
  std::vector<std::shared_ptr<LRScheduler>> schedulers = {
      get_constant_schedule_with_warmup(sgd(), 5), get_linear_schedule_with_warmup(sgd(), 5, 20),
      get_cosine_schedule_with_warmup(sgd(), 5, 20), get_cosine_with_hard_restarts_schedule_with_warmup(sgd(), 5, 20),
      get_polynomial_decay_schedule_with_warmup(sgd(), 5, 20)};
  for (auto& scheduler : schedulers) {
    const Table actual = rates(*scheduler, 6);
    for (int64_t e = 0; e <= 5; ++e) {
      EXPECT_DOUBLE_EQ(actual[e][0], 0.1 * warmup(e, 5)) << e;
      EXPECT_DOUBLE_EQ(actual[e][1], 0.02 * warmup(e, 5)) << e;
    }
  }
}

// ---- OneCycleLR -----------------------------------------------------------------------------

// Rates of both groups followed by their momenta, as in the PyTorch tables.
template <typename MomentumOf>
Table rates_and_momenta(LRScheduler& scheduler, int count, MomentumOf momentum_of) {
  Table out;
  for (int i = 0; i < count; ++i) {
    if (i > 0) scheduler.step();
    EXPECT_EQ(group_lrs(*scheduler.optimizer()), scheduler.get_last_lr()) << "after " << i << " steps";
    auto row = scheduler.get_last_lr();
    for (size_t g = 0; g < 2; ++g) row.push_back(momentum_of(*scheduler.optimizer(), g));
    out.push_back(row);
  }
  return out;
}

double adam_beta1(const torch::optim::Optimizer& optimizer, size_t group) {
  return std::get<0>(static_cast<const torch::optim::AdamOptions&>(optimizer.param_groups()[group].options()).betas());
}

TEST(OneCycleLR, CosineTwoPhaseMatchesPyTorchWithSgdMomentum) {
  // Printed by PyTorch 1.13 (Debian python3-torch): OneCycleLR(SGD(groups lr 0.1 / 0.02,
  // momentum=0.9), max_lr=[1.0, 0.5], total_steps=10); rows are get_last_lr() and each group's
  // momentum after 0..10 steps (the 10th step is past the cycle and PyTorch allows it).
  const Table pytorch = {
      {0.040000000000000036, 0.020000000000000018, 0.95, 0.95},
      {0.52, 0.26, 0.8999999999999999, 0.8999999999999999},
      {1.0, 0.5, 0.85, 0.85},
      {0.9504846320134737, 0.47524231600673683, 0.854951556604879, 0.854951556604879},
      {0.8117456539497631, 0.40587282697488153, 0.8688255099070633, 0.8688255099070633},
      {0.6112620219362893, 0.30563101096814466, 0.8888739533021842, 0.8888739533021842},
      {0.38874197806371075, 0.19437098903185537, 0.9111260466978157, 0.9111260466978157},
      {0.18825834605023697, 0.09412917302511849, 0.9311744900929366, 0.9311744900929366},
      {0.049519367986526286, 0.024759683993263143, 0.945048443395121, 0.945048443395121},
      {4e-06, 2e-06, 0.95, 0.95},
      {0.04951936798652623, 0.024759683993263115, 0.945048443395121, 0.945048443395121},
  };
  OneCycleLR scheduler(sgd(0.9), {.max_lr = {1.0, 0.5}, .total_steps = 10});
  expect_table_identical(rates_and_momenta(scheduler, 11, sgd_momentum), pytorch);
}

TEST(OneCycleLR, LinearThreePhaseMatchesPyTorchWithAdamBeta1) {
  // Printed by PyTorch 1.13: OneCycleLR(Adam(groups lr 0.1 / 0.02), max_lr=0.4, total_steps=12,
  // anneal_strategy='linear', three_phase=True, base_momentum=0.8, max_momentum=0.9); rows are
  // get_last_lr() and each group's betas[0] after 0..12 steps.
  const Table pytorch = {
      {0.016, 0.016, 0.9, 0.9},
      {0.16369230769230775, 0.16369230769230775, 0.8615384615384616, 0.8615384615384616},
      {0.3113846153846155, 0.3113846153846155, 0.823076923076923, 0.823076923076923},
      {0.3409230769230769, 0.3409230769230769, 0.8153846153846155, 0.8153846153846155},
      {0.19323076923076918, 0.19323076923076918, 0.8538461538461539, 0.8538461538461539},
      {0.04553846153846147, 0.04553846153846147, 0.8923076923076924, 0.8923076923076924},
      {0.013793324137931034, 0.013793324137931034, 0.9, 0.9},
      {0.011034979310344827, 0.011034979310344827, 0.9, 0.9},
      {0.00827663448275862, 0.00827663448275862, 0.9, 0.9},
      {0.005518289655172414, 0.005518289655172414, 0.9, 0.9},
      {0.002759944827586208, 0.002759944827586208, 0.9, 0.9},
      {1.6000000000009063e-06, 1.6000000000009063e-06, 0.9, 0.9},
      {-0.002756744827586203, -0.002756744827586203, 0.9, 0.9},  // PyTorch's extra step overshoots
  };
  auto optimizer = two_group_optimizer<torch::optim::Adam, torch::optim::AdamOptions>();
  OneCycleLR scheduler(optimizer, {.max_lr = 0.4,
                                   .total_steps = 12,
                                   .anneal_strategy = "linear",
                                   .base_momentum = 0.8,
                                   .max_momentum = 0.9,
                                   .three_phase = true});
  expect_table_identical(rates_and_momenta(scheduler, 13, adam_beta1), pytorch);
  // The second beta is left alone.
  EXPECT_EQ(std::get<1>(static_cast<const torch::optim::AdamOptions&>(optimizer->param_groups()[1].options()).betas()),
            0.999);
}

TEST(OneCycleLR, CosineThreePhaseFromEpochsMatchesPyTorch) {
  // Printed by PyTorch 1.13: OneCycleLR(SGD(groups lr 0.1 / 0.02, momentum=0.9), max_lr=0.3,
  // epochs=3, steps_per_epoch=4, pct_start=0.25, div_factor=10, final_div_factor=100,
  // three_phase=True); rows are get_last_lr() and each group's momentum after 0..12 steps.
  const Table pytorch = {
      {0.02999999999999997, 0.02999999999999997, 0.95, 0.95},
      {0.16499999999999998, 0.16499999999999998, 0.8999999999999999, 0.8999999999999999},
      {0.3, 0.3, 0.85, 0.85},
      {0.165, 0.165, 0.8999999999999999, 0.8999999999999999},
      {0.03, 0.03, 0.95, 0.95},
      {0.02852938768835092, 0.02852938768835092, 0.95, 0.95},
      {0.024408823557602193, 0.024408823557602193, 0.95, 0.95},
      {0.018454435869251266, 0.018454435869251266, 0.95, 0.95},
      {0.01184556413074873, 0.01184556413074873, 0.95, 0.95},
      {0.005891176442397807, 0.005891176442397807, 0.95, 0.95},
      {0.0017706123116490772, 0.0017706123116490772, 0.95, 0.95},
      {0.0003, 0.0003, 0.95, 0.95},
      {0.0017706123116490754, 0.0017706123116490754, 0.95, 0.95},
  };
  OneCycleLR scheduler(sgd(0.9), {.max_lr = 0.3,
                                  .epochs = 3,
                                  .steps_per_epoch = 4,
                                  .pct_start = 0.25,
                                  .div_factor = 10.0,
                                  .final_div_factor = 100.0,
                                  .three_phase = true});
  EXPECT_EQ(scheduler.total_steps(), 12);
  expect_table_identical(rates_and_momenta(scheduler, 13, sgd_momentum), pytorch);
}

TEST(OneCycleLR, FollowsTheClosedFormOfEachPhase) {
  // Two phases over 20 steps with pct_start 0.3: up over steps 0..5, down over steps 5..19.
  const double max_lr = 0.8, first = max_lr / 25.0, last = first / 1e4;
  auto cosine_between = [](double from, double to, double t) {
    return from + (to - from) * (1.0 - std::cos(kPi * t)) / 2.0;
  };
  auto linear_between = [](double from, double to, double t) { return from + (to - from) * t; };
  for (const std::string strategy : {"cos", "linear"}) {
    auto between = strategy == "cos" ? std::function<double(double, double, double)>(cosine_between)
                                     : std::function<double(double, double, double)>(linear_between);
    OneCycleLR scheduler(sgd(0.9), {.max_lr = max_lr, .total_steps = 20, .anneal_strategy = strategy});
    const Table actual = rates_and_momenta(scheduler, 20, sgd_momentum);
    for (int t = 0; t < 20; ++t) {
      const bool up = t <= 5;
      const double x = up ? t / 5.0 : (t - 5) / 14.0;
      const double lr = up ? between(first, max_lr, x) : between(max_lr, last, x);
      const double momentum = up ? between(0.95, 0.85, x) : between(0.85, 0.95, x);
      EXPECT_NEAR(actual[t][0], lr, 1e-14) << strategy << " step " << t;
      EXPECT_NEAR(actual[t][1], lr, 1e-14) << strategy << " step " << t;
      EXPECT_NEAR(actual[t][2], momentum, 1e-14) << strategy << " step " << t;
    }
  }
}

TEST(OneCycleLR, ConstructionSetsTheFirstRateAndTheMaxMomentum) {
  auto optimizer = sgd(0.5);
  OneCycleLR scheduler(optimizer, {.max_lr = {0.5, 0.25}, .total_steps = 100, .max_momentum = {0.9, 0.8}});
  EXPECT_EQ(scheduler.last_epoch(), 0);
  EXPECT_EQ(scheduler.step_count(), 1);
  EXPECT_EQ(scheduler.total_steps(), 100);
  EXPECT_THAT(scheduler.base_lrs(), ElementsAre(DoubleEq(0.5 / 25), DoubleEq(0.25 / 25)));
  // PyTorch computes it as max_lr + (first - max_lr), a few ulps away from max_lr / 25.
  EXPECT_THAT(group_lrs(*optimizer), ElementsAre(DoubleNear(0.5 / 25, 1e-16), DoubleNear(0.25 / 25, 1e-16)));
  EXPECT_DOUBLE_EQ(sgd_momentum(*optimizer, 0), 0.9);
  EXPECT_DOUBLE_EQ(sgd_momentum(*optimizer, 1), 0.8);
}

TEST(OneCycleLR, SteppingPastTotalStepsThrowsPyTorchsErrorAndChangesNothing) {
  auto optimizer = sgd(0.9);
  OneCycleLR scheduler(optimizer, {.max_lr = 1.0, .total_steps = 4});
  for (int i = 0; i < 4; ++i) scheduler.step();  // PyTorch allows last_epoch == total_steps
  const auto lrs = group_lrs(*optimizer);
  const double momentum = sgd_momentum(*optimizer, 0);
  // PyTorch 1.13 words it "Tried to step 6 times" for the 5th step after construction.
  EXPECT_THROWS_WITH(scheduler.step(),
                     "[OneCycleLR::step] Tried to step 6 times. The specified number of total steps is 4");
  EXPECT_THROW(scheduler.step(), c10::ValueError);
  EXPECT_EQ(scheduler.last_epoch(), 4);
  EXPECT_EQ(scheduler.step_count(), 5);
  EXPECT_EQ(group_lrs(*optimizer), lrs);
  EXPECT_EQ(sgd_momentum(*optimizer, 0), momentum);
}

TEST(OneCycleLR, CyclesRmspropMomentumAndAdamWFirstBeta) {
  auto rmsprop = two_group_optimizer<torch::optim::RMSprop, torch::optim::RMSpropOptions>();
  OneCycleLR on_rmsprop(rmsprop, {.max_lr = 1.0, .total_steps = 10});
  auto rmsprop_momentum = [&](size_t g) {
    return static_cast<const torch::optim::RMSpropOptions&>(rmsprop->param_groups()[g].options()).momentum();
  };
  EXPECT_DOUBLE_EQ(rmsprop_momentum(0), 0.95);
  on_rmsprop.step();
  on_rmsprop.step();
  EXPECT_DOUBLE_EQ(rmsprop_momentum(1), 0.85);  // the peak, at step pct_start * total - 1 = 2

  auto adamw = two_group_optimizer<torch::optim::AdamW, torch::optim::AdamWOptions>();
  OneCycleLR on_adamw(adamw, {.max_lr = 1.0, .total_steps = 10, .base_momentum = 0.7});
  auto adamw_betas = [&](size_t g) {
    return static_cast<const torch::optim::AdamWOptions&>(adamw->param_groups()[g].options()).betas();
  };
  EXPECT_DOUBLE_EQ(std::get<0>(adamw_betas(0)), 0.95);
  on_adamw.step();
  on_adamw.step();
  EXPECT_DOUBLE_EQ(std::get<0>(adamw_betas(1)), 0.7);
  EXPECT_DOUBLE_EQ(std::get<1>(adamw_betas(1)), 0.999);
}

TEST(OneCycleLR, RefusesAnOptimizerWithoutMomentumUnlessMomentumIsNotCycled) {
  auto adagrad = two_group_optimizer<torch::optim::Adagrad, torch::optim::AdagradOptions>();
  EXPECT_THROWS_WITH(OneCycleLR(adagrad, {.max_lr = 1.0, .total_steps = 10}),
                     "[OneCycleLR] optimizer must support momentum with `cycle_momentum` option enabled");
  OneCycleLR scheduler(adagrad, {.max_lr = 1.0, .total_steps = 10, .cycle_momentum = false});
  EXPECT_THAT(group_lrs(*adagrad), ElementsAre(DoubleNear(0.04, 1e-16), DoubleNear(0.04, 1e-16)));

  // Without cycling, SGD's momentum is left as it was, and per-group momenta are not checked.
  auto optimizer = sgd(0.3);
  OneCycleLR plain(optimizer,
                   {.max_lr = 1.0, .total_steps = 10, .cycle_momentum = false, .max_momentum = {1.0, 2.0, 3.0}});
  plain.step();
  EXPECT_EQ(sgd_momentum(*optimizer, 0), 0.3);
  EXPECT_FALSE(plain.state_dict().contains("max_momentum"));
}

TEST(OneCycleLR, RefusesEveryInvalidOption) {
  auto opt = [] { return sgd(0.9); };
  EXPECT_THROWS_WITH(OneCycleLR(nullptr, {.max_lr = 1.0, .total_steps = 10}),
                     "[OneCycleLR] expected an optimizer, got a null pointer");
  EXPECT_THROWS_WITH(OneCycleLR(opt(), {.max_lr = 1.0}),
                     "[OneCycleLR] You must define either total_steps OR (epochs AND steps_per_epoch)");
  EXPECT_THROWS_WITH(OneCycleLR(opt(), {.max_lr = 1.0, .epochs = 3}),
                     "[OneCycleLR] You must define either total_steps OR (epochs AND steps_per_epoch)");
  EXPECT_THROWS_WITH(OneCycleLR(opt(), {.max_lr = 1.0, .total_steps = 0}),
                     "[OneCycleLR] Expected positive integer total_steps, but got 0");
  EXPECT_THROWS_WITH(OneCycleLR(opt(), {.max_lr = 1.0, .total_steps = -5}),
                     "[OneCycleLR] Expected positive integer total_steps, but got -5");
  EXPECT_THROWS_WITH(OneCycleLR(opt(), {.max_lr = 1.0, .epochs = 0, .steps_per_epoch = 4}),
                     "[OneCycleLR] Expected positive integer epochs, but got 0");
  EXPECT_THROWS_WITH(OneCycleLR(opt(), {.max_lr = 1.0, .epochs = 2, .steps_per_epoch = -4}),
                     "[OneCycleLR] Expected positive integer steps_per_epoch, but got -4");
  EXPECT_THROWS_WITH(
      OneCycleLR(opt(), {.max_lr = 1.0, .epochs = int64_t{1} << 40, .steps_per_epoch = int64_t{1} << 40}),
      "[OneCycleLR] epochs (1099511627776) * steps_per_epoch (1099511627776) does not fit in 64 bits");
  EXPECT_THROWS_WITH(OneCycleLR(opt(), {.max_lr = 1.0, .total_steps = 10, .pct_start = 1.5}),
                     "[OneCycleLR] Expected float between 0 and 1 pct_start, but got 1.5");
  EXPECT_THROWS_WITH(OneCycleLR(opt(), {.max_lr = 1.0, .total_steps = 10, .pct_start = -0.1}),
                     "[OneCycleLR] Expected float between 0 and 1 pct_start, but got -0.1");
  EXPECT_THROWS_WITH(OneCycleLR(opt(), {.max_lr = 1.0, .total_steps = 10, .pct_start = std::nan("")}),
                     "[OneCycleLR] Expected float between 0 and 1 pct_start, but got nan");
  EXPECT_THROWS_WITH(OneCycleLR(opt(), {.max_lr = 1.0, .total_steps = 10, .anneal_strategy = "exp"}),
                     "[OneCycleLR] anneal_strategy must be one of 'cos' or 'linear', instead got 'exp'");
  EXPECT_THROWS_WITH(OneCycleLR(opt(), {.total_steps = 10}), "[OneCycleLR] max_lr is required, got no value");
  EXPECT_THROWS_WITH(OneCycleLR(opt(), {.max_lr = {1.0, 2.0, 3.0}, .total_steps = 10}),
                     "[OneCycleLR] expected 2 values for max_lr (one per param group), got 3");
  // A braced list is per group even with one value, as a Python list is.
  EXPECT_THROWS_WITH(OneCycleLR(opt(), {.max_lr = {1.0}, .total_steps = 10}),
                     "[OneCycleLR] expected 2 values for max_lr (one per param group), got 1");
  EXPECT_THROWS_WITH(OneCycleLR(opt(), {.max_lr = 1.0, .total_steps = 10, .base_momentum = {0.8}}),
                     "[OneCycleLR] expected 2 values for base_momentum (one per param group), got 1");
  EXPECT_THROWS_WITH(OneCycleLR(opt(), {.max_lr = 1.0, .total_steps = 10, .max_momentum = std::vector<double>{}}),
                     "[OneCycleLR] expected 2 values for max_momentum (one per param group), got 0");
  EXPECT_THROWS_WITH(OneCycleLR(opt(), {.max_lr = {1.0, -1.0}, .total_steps = 10}),
                     "[OneCycleLR] max_lr must be finite and >= 0, got -1");
  EXPECT_THROWS_WITH(OneCycleLR(opt(), {.max_lr = 1.0, .total_steps = 10, .div_factor = 0.0}),
                     "[OneCycleLR] div_factor must be a finite number > 0, got 0");
  EXPECT_THROWS_WITH(OneCycleLR(opt(), {.max_lr = 1.0, .total_steps = 10, .final_div_factor = -1.0}),
                     "[OneCycleLR] final_div_factor must be a finite number > 0, got -1");
}

TEST(OneCycleLR, AnEmptyPhaseIsReportedWherePyTorchDividesByZero) {
  // pct_start * total_steps == 1 makes the first phase end at step 0 (PyTorch: ZeroDivisionError).
  EXPECT_THROWS_WITH(OneCycleLR(sgd(0.9), {.max_lr = 1.0, .total_steps = 10, .pct_start = 0.1}),
                     "[OneCycleLR] phase 1 of the schedule has no steps at step 0");
  // With pct_start 1 the second phase is empty; only the extra step PyTorch allows reaches it.
  OneCycleLR scheduler(sgd(0.9), {.max_lr = 1.0, .total_steps = 10, .pct_start = 1.0});
  for (int i = 0; i < 9; ++i) scheduler.step();
  EXPECT_DOUBLE_EQ(scheduler.get_last_lr()[0], 1.0);
  EXPECT_THROWS_WITH(scheduler.step(), "[OneCycleLR] phase 2 of the schedule has no steps at step 10");
  EXPECT_EQ(scheduler.last_epoch(), 9);
}

TEST(OneCycleLR, StateDictRoundTripResumesRatesAndMomenta) {
  auto make = [] {
    return std::make_shared<OneCycleLR>(sgd(0.9), OneCycleLROptions{.max_lr = {1.0, 0.5},
                                                                    .total_steps = 30,
                                                                    .anneal_strategy = "linear",
                                                                    .base_momentum = {0.8, 0.7},
                                                                    .div_factor = 5.0,
                                                                    .three_phase = true});
  };
  expect_resumes_identically(make, 11, 19);

  // The options come from the state, not from the scheduler that loads it.
  auto original = make();
  for (int i = 0; i < 7; ++i) original->step();
  auto other = std::make_shared<OneCycleLR>(
      sgd(0.9), OneCycleLROptions{.max_lr = 3.0, .total_steps = 50, .pct_start = 0.5, .base_momentum = 0.6});
  other->load_state_dict(original->state_dict());
  EXPECT_EQ(other->total_steps(), 30);
  EXPECT_EQ(other->state_dict(), original->state_dict());
  for (int i = 0; i < 23; ++i) {
    original->step();
    other->step();
    EXPECT_EQ(other->get_last_lr(), original->get_last_lr());
    EXPECT_EQ(sgd_momentum(*other->optimizer(), 1), sgd_momentum(*original->optimizer(), 1));
  }
  EXPECT_THROWS_WITH(other->step(), "The specified number of total steps is 30");
}

TEST(OneCycleLR, LoadStateDictRefusesMissingOrMistypedKeysAndChangesNothing) {
  OneCycleLR scheduler(sgd(0.9), {.max_lr = 1.0, .total_steps = 10});
  scheduler.step();
  const auto good = scheduler.state_dict();
  const std::string where = "[OneCycleLR::load_state_dict] ";
  auto with = [&](const std::string& key, nlohmann::json value) {
    auto state = good;
    state[key] = std::move(value);
    return state;
  };
  auto without = [&](const std::string& key) {
    auto state = good;
    state.erase(key);
    return state;
  };
  const std::vector<std::pair<nlohmann::json, std::string>> cases = {
      {without("total_steps"), where + "expected the key \"total_steps\", it is missing"},
      {with("total_steps", 0), where + "expected \"total_steps\" to be an integer >= 1, got 0"},
      {with("pct_start", "0.3"), where + "expected \"pct_start\" to be a finite number, got \"0.3\""},
      {with("pct_start", 2), where + "Expected float between 0 and 1 pct_start, but got 2"},
      {without("three_phase"), where + "expected the key \"three_phase\", it is missing"},
      {with("three_phase", 1), where + "expected \"three_phase\" to be true or false, got 1"},
      {with("anneal_strategy", 3), where + "expected \"anneal_strategy\" to be \"cos\" or \"linear\", got 3"},
      {with("anneal_strategy", "exp"), where + "anneal_strategy must be one of 'cos' or 'linear', instead got 'exp'"},
      {without("cycle_momentum"), where + "expected the key \"cycle_momentum\", it is missing"},
      {with("initial_lr", {0.1}), where + "expected \"initial_lr\" to be a list of 2 finite numbers"},
      {without("max_lr"), where + "expected the key \"max_lr\", it is missing"},
      {with("min_lr", {0.1, nullptr}), where + "expected \"min_lr\" to be a list of 2 finite numbers"},
      {without("max_momentum"), where + "expected the key \"max_momentum\", it is missing"},
      {with("base_momentum", nlohmann::json::object()), where + "expected \"base_momentum\" to be a list of 2 finite"},
      {without("last_lr"), where + "expected the key \"last_lr\", it is missing"},
      {get_constant_schedule(sgd())->state_dict(), where + "expected the key \"total_steps\", it is missing"},
  };
  for (const auto& [state, message] : cases) {
    EXPECT_THROWS_WITH(scheduler.load_state_dict(state), message) << state.dump();
    EXPECT_EQ(scheduler.state_dict(), good) << state.dump();
  }
  // A state that cycles momentum cannot be loaded by a scheduler that does not.
  OneCycleLR plain(sgd(0.9), {.max_lr = 1.0, .total_steps = 10, .cycle_momentum = false});
  EXPECT_THROWS_WITH(plain.load_state_dict(good), "[OneCycleLR::load_state_dict] the state cycles the momentum");
  // A LambdaLR refuses a OneCycleLR state.
  auto lambda = get_constant_schedule(sgd());
  EXPECT_THROWS_WITH(lambda->load_state_dict(good), "expected the key \"lr_lambdas\", it is missing");
}

}  // namespace
}  // namespace accelerate::testing
