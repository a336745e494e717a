// Learning-rate schedulers; see include/accelerate/lr_scheduler.h. Every formula keeps the order of
// operations of its Python original so that the rates are the same doubles PyTorch computes.
#include "accelerate/lr_scheduler.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <numbers>
#include <tuple>
#include <utility>

namespace accelerate {

namespace {

// ---- reading a state_dict ---------------------------------------------------------------------

// A JSON value for an error message, cut short when it is long.
std::string brief(const nlohmann::json& value) {
  std::string text = value.dump();
  constexpr size_t kMax = 80;
  if (text.size() > kMax) text = text.substr(0, kMax) + "...";
  return text;
}

const nlohmann::json& entry(const nlohmann::json& state, const char* key, const std::string& where) {
  TORCH_CHECK_VALUE(state.contains(key), "[", where, "] expected the key \"", key, "\", it is missing");
  return state.at(key);
}

int64_t integer_entry(const nlohmann::json& state, const char* key, const std::string& where, int64_t min) {
  const auto& v = entry(state, key, where);
  const bool fits =
      v.is_number_integer() &&
      (!v.is_number_unsigned() || v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()));
  TORCH_CHECK_VALUE(fits && v.get<int64_t>() >= min, "[", where, "] expected \"", key, "\" to be an integer >= ", min,
                    ", got ", brief(v));
  return v.get<int64_t>();
}

double number_entry(const nlohmann::json& state, const char* key, const std::string& where) {
  const auto& v = entry(state, key, where);
  TORCH_CHECK_VALUE(v.is_number() && std::isfinite(v.get<double>()), "[", where, "] expected \"", key,
                    "\" to be a finite number, got ", brief(v));
  return v.get<double>();
}

bool bool_entry(const nlohmann::json& state, const char* key, const std::string& where) {
  const auto& v = entry(state, key, where);
  TORCH_CHECK_VALUE(v.is_boolean(), "[", where, "] expected \"", key, "\" to be true or false, got ", brief(v));
  return v.get<bool>();
}

// One finite number per param group.
std::vector<double> numbers_entry(const nlohmann::json& state, const char* key, const std::string& where,
                                  size_t count) {
  const auto& v = entry(state, key, where);
  bool ok = v.is_array() && v.size() == count;
  for (size_t i = 0; ok && i < count; ++i) ok = v[i].is_number() && std::isfinite(v[i].get<double>());
  TORCH_CHECK_VALUE(ok, "[", where, "] expected \"", key, "\" to be a list of ", count,
                    " finite numbers (one per param group), got ", brief(v));
  return v.get<std::vector<double>>();
}

torch::optim::Optimizer& checked(const std::shared_ptr<torch::optim::Optimizer>& optimizer, const std::string& api) {
  TORCH_CHECK_VALUE(optimizer != nullptr, "[", api, "] expected an optimizer, got a null pointer");
  return *optimizer;
}

}  // namespace

// ---- LRScheduler ----------------------------------------------------------------------------

LRScheduler::LRScheduler(std::shared_ptr<torch::optim::Optimizer> optimizer)
    : LRScheduler(std::move(optimizer), "LRScheduler") {}

LRScheduler::LRScheduler(std::shared_ptr<torch::optim::Optimizer> optimizer, std::string api_name)
    : optimizer_(std::move(optimizer)), api_name_(std::move(api_name)) {
  const auto& groups = checked(optimizer_, api_name_).param_groups();
  base_lrs_.reserve(groups.size());
  for (const auto& group : groups) base_lrs_.push_back(group.options().get_lr());
}

LRScheduler::~LRScheduler() = default;

void LRScheduler::initial_step() {
  step_count_ = 0;
  step();
}

void LRScheduler::step() {
  auto& groups = optimizer_->param_groups();
  TORCH_CHECK(groups.size() == base_lrs_.size(), "[", api_name_, "::step] the optimizer has ", groups.size(),
              " param groups, the scheduler was built for ", base_lrs_.size());
  ++last_epoch_;
  std::vector<double> lrs;
  try {
    lrs = compute_lr();
  } catch (...) {
    --last_epoch_;
    throw;
  }
  TORCH_INTERNAL_ASSERT(lrs.size() == groups.size(), "[", api_name_, "::step] compute_lr gave ", lrs.size(),
                        " rates for ", groups.size(), " param groups");
  ++step_count_;
  for (size_t i = 0; i < groups.size(); ++i) groups[i].options().set_lr(lrs[i]);
  last_lr_ = std::move(lrs);
}

std::vector<double> LRScheduler::get_last_lr() const { return last_lr_; }
const std::vector<double>& LRScheduler::base_lrs() const { return base_lrs_; }
int64_t LRScheduler::last_epoch() const { return last_epoch_; }
int64_t LRScheduler::step_count() const { return step_count_; }

void LRScheduler::set_step_count(int64_t count) {
  TORCH_CHECK_VALUE(count >= 0, "[", api_name_, "::set_step_count] expected a count >= 0, got ", count);
  step_count_ = count;
}

std::optional<int64_t> LRScheduler::total_steps() const { return std::nullopt; }
const std::shared_ptr<torch::optim::Optimizer>& LRScheduler::optimizer() const { return optimizer_; }
const std::string& LRScheduler::api_name() const { return api_name_; }
size_t LRScheduler::num_groups() const { return base_lrs_.size(); }

void LRScheduler::set_base_lrs(std::vector<double> base_lrs) {
  TORCH_INTERNAL_ASSERT(base_lrs.size() == base_lrs_.size(), "[", api_name_, "] expected ", base_lrs_.size(),
                        " base rates, got ", base_lrs.size());
  base_lrs_ = std::move(base_lrs);
}

nlohmann::json LRScheduler::state_dict() const {
  nlohmann::json state = {
      {"base_lrs", base_lrs_}, {"last_epoch", last_epoch_}, {"step_count", step_count_}, {"last_lr", last_lr_}};
  save_extra_state(state);
  return state;
}

void LRScheduler::load_state_dict(const nlohmann::json& state) {
  const std::string where = api_name_ + "::load_state_dict";
  TORCH_CHECK_VALUE(state.is_object(), "[", where, "] expected a JSON object, got ", state.type_name());
  auto base_lrs = numbers_entry(state, "base_lrs", where, base_lrs_.size());
  const int64_t last_epoch = integer_entry(state, "last_epoch", where, 0);
  const int64_t step_count = integer_entry(state, "step_count", where, 0);
  auto last_lr = numbers_entry(state, "last_lr", where, base_lrs_.size());
  load_extra_state(state, where);
  base_lrs_ = std::move(base_lrs);
  last_epoch_ = last_epoch;
  step_count_ = step_count;
  last_lr_ = std::move(last_lr);
}

void LRScheduler::save_extra_state(nlohmann::json& state) const {}
void LRScheduler::load_extra_state(const nlohmann::json& state, const std::string& where) {}

// ---- LambdaLR -------------------------------------------------------------------------------

LambdaLR::LambdaLR(std::shared_ptr<torch::optim::Optimizer> optimizer, LRLambda lr_lambda)
    : LRScheduler(std::move(optimizer), "LambdaLR") {
  TORCH_CHECK_VALUE(static_cast<bool>(lr_lambda), "[LambdaLR] expected a function of the epoch, got an empty one");
  lr_lambdas_.assign(num_groups(), lr_lambda);
  initial_step();
}

LambdaLR::LambdaLR(std::shared_ptr<torch::optim::Optimizer> optimizer, std::vector<LRLambda> lr_lambdas)
    : LRScheduler(std::move(optimizer), "LambdaLR"), lr_lambdas_(std::move(lr_lambdas)) {
  TORCH_CHECK_VALUE(lr_lambdas_.size() == num_groups(), "[LambdaLR] Expected ", num_groups(),
                    " lr_lambdas (one per param group), but got ", lr_lambdas_.size());
  for (size_t i = 0; i < lr_lambdas_.size(); ++i) {
    TORCH_CHECK_VALUE(static_cast<bool>(lr_lambdas_[i]), "[LambdaLR] expected a function of the epoch for group ", i,
                      ", got an empty one");
  }
  initial_step();
}

std::vector<double> LambdaLR::compute_lr() {
  std::vector<double> lrs(num_groups());
  for (size_t i = 0; i < lrs.size(); ++i) lrs[i] = base_lrs()[i] * lr_lambdas_[i](last_epoch());
  return lrs;
}

void LambdaLR::save_extra_state(nlohmann::json& state) const {
  // Functions cannot be saved; PyTorch stores None for plain functions too.
  state["lr_lambdas"] = nlohmann::json::array();
  for (size_t i = 0; i < lr_lambdas_.size(); ++i) state["lr_lambdas"].push_back(nullptr);
}

void LambdaLR::load_extra_state(const nlohmann::json& state, const std::string& where) {
  const auto& v = entry(state, "lr_lambdas", where);
  bool ok = v.is_array() && v.size() == lr_lambdas_.size();
  for (size_t i = 0; ok && i < v.size(); ++i) ok = v[i].is_null();
  TORCH_CHECK_VALUE(ok, "[", where, "] expected \"lr_lambdas\" to be a list of ", lr_lambdas_.size(),
                    " nulls (functions are not saved), got ", brief(v));
}

// ---- transformers' schedules ----------------------------------------------------------------

// Note [transformers' lambdas]: each lambda below is the matching `_get_*_lr_lambda` of
// transformers/optimization.py with Python's int and float arithmetic spelled out: `float(x)` is a
// cast to double, `/` on ints is a double division, and the order of operations is kept.

namespace {

double warmup_factor(int64_t step, int64_t num_warmup_steps) {
  return static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, num_warmup_steps));
}

double progress_after_warmup(int64_t step, int64_t num_warmup_steps, int64_t num_training_steps) {
  return static_cast<double>(step - num_warmup_steps) /
         static_cast<double>(std::max<int64_t>(1, num_training_steps - num_warmup_steps));
}

void check_steps(const char* api, int64_t num_warmup_steps, std::optional<int64_t> num_training_steps) {
  TORCH_CHECK_VALUE(num_warmup_steps >= 0, "[", api, "] num_warmup_steps must be >= 0, got ", num_warmup_steps);
  if (num_training_steps) {
    TORCH_CHECK_VALUE(*num_training_steps >= 0, "[", api, "] num_training_steps must be >= 0, got ",
                      *num_training_steps);
  }
}

}  // namespace

std::shared_ptr<LRScheduler> get_constant_schedule(std::shared_ptr<torch::optim::Optimizer> optimizer) {
  checked(optimizer, "get_constant_schedule");
  return std::make_shared<LambdaLR>(std::move(optimizer), [](int64_t) { return 1.0; });
}

std::shared_ptr<LRScheduler> get_constant_schedule_with_warmup(std::shared_ptr<torch::optim::Optimizer> optimizer,
                                                               int64_t num_warmup_steps) {
  checked(optimizer, "get_constant_schedule_with_warmup");
  check_steps("get_constant_schedule_with_warmup", num_warmup_steps, std::nullopt);
  return std::make_shared<LambdaLR>(std::move(optimizer), [num_warmup_steps](int64_t step) {
    if (step < num_warmup_steps) return warmup_factor(step, num_warmup_steps);
    return 1.0;
  });
}

std::shared_ptr<LRScheduler> get_linear_schedule_with_warmup(std::shared_ptr<torch::optim::Optimizer> optimizer,
                                                             int64_t num_warmup_steps, int64_t num_training_steps) {
  checked(optimizer, "get_linear_schedule_with_warmup");
  check_steps("get_linear_schedule_with_warmup", num_warmup_steps, num_training_steps);
  return std::make_shared<LambdaLR>(std::move(optimizer), [num_warmup_steps, num_training_steps](int64_t step) {
    if (step < num_warmup_steps) return warmup_factor(step, num_warmup_steps);
    return std::max(0.0, static_cast<double>(num_training_steps - step) /
                             static_cast<double>(std::max<int64_t>(1, num_training_steps - num_warmup_steps)));
  });
}

std::shared_ptr<LRScheduler> get_cosine_schedule_with_warmup(std::shared_ptr<torch::optim::Optimizer> optimizer,
                                                             int64_t num_warmup_steps, int64_t num_training_steps,
                                                             double num_cycles) {
  constexpr const char* kApi = "get_cosine_schedule_with_warmup";
  checked(optimizer, kApi);
  check_steps(kApi, num_warmup_steps, num_training_steps);
  TORCH_CHECK_VALUE(std::isfinite(num_cycles) && num_cycles >= 0, "[", kApi,
                    "] num_cycles must be a finite number >= 0, got ", num_cycles);
  return std::make_shared<LambdaLR>(
      std::move(optimizer), [num_warmup_steps, num_training_steps, num_cycles](int64_t step) {
        if (step < num_warmup_steps) return warmup_factor(step, num_warmup_steps);
        const double progress = progress_after_warmup(step, num_warmup_steps, num_training_steps);
        return std::max(0.0, 0.5 * (1.0 + std::cos(std::numbers::pi * num_cycles * 2.0 * progress)));
      });
}

std::shared_ptr<LRScheduler> get_cosine_with_hard_restarts_schedule_with_warmup(
    std::shared_ptr<torch::optim::Optimizer> optimizer, int64_t num_warmup_steps, int64_t num_training_steps,
    int64_t num_cycles) {
  constexpr const char* kApi = "get_cosine_with_hard_restarts_schedule_with_warmup";
  checked(optimizer, kApi);
  check_steps(kApi, num_warmup_steps, num_training_steps);
  TORCH_CHECK_VALUE(num_cycles >= 0, "[", kApi, "] num_cycles must be >= 0, got ", num_cycles);
  return std::make_shared<LambdaLR>(
      std::move(optimizer), [num_warmup_steps, num_training_steps, num_cycles](int64_t step) {
        if (step < num_warmup_steps) return warmup_factor(step, num_warmup_steps);
        const double progress = progress_after_warmup(step, num_warmup_steps, num_training_steps);
        if (progress >= 1.0) return 0.0;
        // The operand is >= 0, where fmod equals Python's `% 1.0`.
        return std::max(
            0.0, 0.5 * (1.0 + std::cos(std::numbers::pi * std::fmod(static_cast<double>(num_cycles) * progress, 1.0))));
      });
}

std::shared_ptr<LRScheduler> get_polynomial_decay_schedule_with_warmup(
    std::shared_ptr<torch::optim::Optimizer> optimizer, int64_t num_warmup_steps, int64_t num_training_steps,
    double lr_end, double power) {
  constexpr const char* kApi = "get_polynomial_decay_schedule_with_warmup";
  const double lr_init = checked(optimizer, kApi).defaults().get_lr();
  check_steps(kApi, num_warmup_steps, num_training_steps);
  TORCH_CHECK_VALUE(num_training_steps > num_warmup_steps, "[", kApi, "] num_training_steps (", num_training_steps,
                    ") must be greater than num_warmup_steps (", num_warmup_steps,
                    "): the decay would divide by zero steps");
  TORCH_CHECK_VALUE(std::isfinite(lr_end) && lr_end >= 0, "[", kApi, "] lr_end must be a finite number >= 0, got ",
                    lr_end);
  TORCH_CHECK_VALUE(std::isfinite(power) && power >= 0, "[", kApi, "] power must be a finite number >= 0, got ", power);
  TORCH_CHECK_VALUE(lr_init > lr_end, "[", kApi, "] lr_end (", lr_end, ") must be smaller than initial lr (", lr_init,
                    ")");
  return std::make_shared<LambdaLR>(std::move(optimizer), [num_warmup_steps, num_training_steps, lr_end, power,
                                                           lr_init](int64_t step) {
    if (step < num_warmup_steps) return warmup_factor(step, num_warmup_steps);
    if (step > num_training_steps) return lr_end / lr_init;  // LambdaLR multiplies by the base rate
    const double lr_range = lr_init - lr_end;
    const int64_t decay_steps = num_training_steps - num_warmup_steps;
    const double pct_remaining = 1.0 - static_cast<double>(step - num_warmup_steps) / static_cast<double>(decay_steps);
    const double decay = lr_range * std::pow(pct_remaining, power) + lr_end;
    return decay / lr_init;
  });
}

// ---- GroupValues ----------------------------------------------------------------------------

GroupValues::GroupValues(double value) : values_{value}, set_(true) {}
GroupValues::GroupValues(std::initializer_list<double> values) : values_(values), per_group_(true), set_(true) {}
GroupValues::GroupValues(std::vector<double> values) : values_(std::move(values)), per_group_(true), set_(true) {}

bool GroupValues::has_value() const { return set_; }

std::vector<double> GroupValues::resolve(const std::string& api_name, const std::string& name,
                                         size_t num_groups) const {
  TORCH_CHECK_VALUE(set_, "[", api_name, "] ", name, " is required, got no value");
  if (!per_group_) return std::vector<double>(num_groups, values_.front());
  TORCH_CHECK_VALUE(values_.size() == num_groups, "[", api_name, "] expected ", num_groups, " values for ", name,
                    " (one per param group), got ", values_.size());
  return values_;
}

// ---- OneCycleLR -----------------------------------------------------------------------------

namespace {

constexpr const char* kOneCycle = "OneCycleLR";

int64_t positive_steps(std::optional<int64_t> value, const char* name) {
  TORCH_CHECK_VALUE(*value > 0, "[OneCycleLR] Expected positive integer ", name, ", but got ", *value);
  return *value;
}

int64_t resolve_total_steps(const OneCycleLROptions& options) {
  if (options.total_steps) return positive_steps(options.total_steps, "total_steps");
  TORCH_CHECK_VALUE(options.epochs && options.steps_per_epoch,
                    "[OneCycleLR] You must define either total_steps OR (epochs AND steps_per_epoch)");
  const int64_t epochs = positive_steps(options.epochs, "epochs");
  const int64_t steps_per_epoch = positive_steps(options.steps_per_epoch, "steps_per_epoch");
  int64_t total = 0;
  TORCH_CHECK_VALUE(!__builtin_mul_overflow(epochs, steps_per_epoch, &total), "[OneCycleLR] epochs (", epochs,
                    ") * steps_per_epoch (", steps_per_epoch, ") does not fit in 64 bits");
  return total;
}

bool parse_anneal_strategy(const std::string& strategy, const std::string& where) {
  TORCH_CHECK_VALUE(strategy == "cos" || strategy == "linear", "[", where,
                    "] anneal_strategy must be one of 'cos' or 'linear', instead got '", strategy, "'");
  return strategy == "linear";
}

void check_pct_start(double pct_start, const std::string& where) {
  TORCH_CHECK_VALUE(pct_start >= 0 && pct_start <= 1, "[", where,
                    "] Expected float between 0 and 1 pct_start, but got ", pct_start);
}

}  // namespace

std::vector<OneCycleLR::Phase> OneCycleLR::make_phases(int64_t total_steps, double pct_start, bool three_phase) {
  const double total = static_cast<double>(total_steps);
  if (three_phase) {
    return {
        {pct_start * total - 1, Bound::kInitialLr, Bound::kMaxLr, Bound::kMaxMomentum, Bound::kBaseMomentum},
        {2 * pct_start * total - 2, Bound::kMaxLr, Bound::kInitialLr, Bound::kBaseMomentum, Bound::kMaxMomentum},
        {total - 1, Bound::kInitialLr, Bound::kMinLr, Bound::kMaxMomentum, Bound::kMaxMomentum},
    };
  }
  return {
      {pct_start * total - 1, Bound::kInitialLr, Bound::kMaxLr, Bound::kMaxMomentum, Bound::kBaseMomentum},
      {total - 1, Bound::kMaxLr, Bound::kMinLr, Bound::kBaseMomentum, Bound::kMaxMomentum},
  };
}

namespace {

// Whether `options` are those of one optimizer type (PyTorch asks its defaults for `momentum`,
// then for `betas`; LibTorch's options are typed).
template <typename Options>
bool options_are(const torch::optim::OptimizerOptions& options) {
  return dynamic_cast<const Options*>(&options) != nullptr;
}

}  // namespace

OneCycleLR::OneCycleLR(std::shared_ptr<torch::optim::Optimizer> optimizer, OneCycleLROptions options)
    : LRScheduler(std::move(optimizer), kOneCycle) {
  // The checks come in PyTorch's order, so that the first error reported is PyTorch's.
  total_steps_ = resolve_total_steps(options);
  check_pct_start(options.pct_start, kOneCycle);
  pct_start_ = options.pct_start;
  three_phase_ = options.three_phase;
  phases_ = make_phases(total_steps_, pct_start_, three_phase_);
  linear_ = parse_anneal_strategy(options.anneal_strategy, kOneCycle);

  max_lr_ = options.max_lr.resolve(kOneCycle, "max_lr", num_groups());
  for (double lr : max_lr_) {
    TORCH_CHECK_VALUE(std::isfinite(lr) && lr >= 0, "[OneCycleLR] max_lr must be finite and >= 0, got ", lr);
  }
  TORCH_CHECK_VALUE(std::isfinite(options.div_factor) && options.div_factor > 0,
                    "[OneCycleLR] div_factor must be a finite number > 0, got ", options.div_factor);
  TORCH_CHECK_VALUE(std::isfinite(options.final_div_factor) && options.final_div_factor > 0,
                    "[OneCycleLR] final_div_factor must be a finite number > 0, got ", options.final_div_factor);
  for (double max_lr : max_lr_) {
    initial_lr_.push_back(max_lr / options.div_factor);
    min_lr_.push_back(initial_lr_.back() / options.final_div_factor);
  }

  cycle_momentum_ = options.cycle_momentum;
  if (cycle_momentum_) {
    const auto& defaults = this->optimizer()->defaults();
    if (options_are<torch::optim::SGDOptions>(defaults) || options_are<torch::optim::RMSpropOptions>(defaults)) {
      momentum_kind_ = Momentum::kMomentum;
    } else if (options_are<torch::optim::AdamOptions>(defaults) || options_are<torch::optim::AdamWOptions>(defaults)) {
      momentum_kind_ = Momentum::kBeta1;
    } else {
      C10_THROW_ERROR(ValueError,
                      "[OneCycleLR] optimizer must support momentum with `cycle_momentum` option enabled "
                      "(SGD, RMSprop, Adam or AdamW); set cycle_momentum = false for this one");
    }
    max_momentum_ = options.max_momentum.resolve(kOneCycle, "max_momentum", num_groups());
    base_momentum_ = options.base_momentum.resolve(kOneCycle, "base_momentum", num_groups());
    for (size_t i = 0; i < num_groups(); ++i) set_momentum(i, max_momentum_[i]);
  }
  set_base_lrs(initial_lr_);
  initial_step();
}

std::optional<int64_t> OneCycleLR::total_steps() const { return total_steps_; }

double OneCycleLR::bound(Bound which, size_t group) const {
  if (which == Bound::kInitialLr) return initial_lr_[group];
  if (which == Bound::kMaxLr) return max_lr_[group];
  if (which == Bound::kMinLr) return min_lr_[group];
  if (which == Bound::kMaxMomentum) return max_momentum_[group];
  return base_momentum_[group];
}

double OneCycleLR::anneal(double start, double end, double pct) const {
  if (linear_) return (end - start) * pct + start;
  const double cos_out = std::cos(std::numbers::pi * pct) + 1;
  return end + (start - end) / 2.0 * cos_out;
}

void OneCycleLR::set_momentum(size_t group, double momentum) {
  auto& options = optimizer()->param_groups()[group].options();
  if (momentum_kind_ == Momentum::kBeta1) {
    if (auto* adam = dynamic_cast<torch::optim::AdamOptions*>(&options)) {
      adam->betas(std::make_tuple(momentum, std::get<1>(adam->betas())));
      return;
    }
    if (auto* adamw = dynamic_cast<torch::optim::AdamWOptions*>(&options)) {
      adamw->betas(std::make_tuple(momentum, std::get<1>(adamw->betas())));
      return;
    }
  } else if (momentum_kind_ == Momentum::kMomentum) {
    if (auto* sgd = dynamic_cast<torch::optim::SGDOptions*>(&options)) {
      sgd->momentum(momentum);
      return;
    }
    if (auto* rmsprop = dynamic_cast<torch::optim::RMSpropOptions*>(&options)) {
      rmsprop->momentum(momentum);
      return;
    }
  }
  TORCH_CHECK(false, "[OneCycleLR] param group ", group, " has options of another type than the optimizer's defaults");
}

std::vector<double> OneCycleLR::compute_lr() {
  const int64_t step_num = last_epoch();
  // PyTorch 1.13 counts this step as `step_num + 1` (later versions print `step_num`).
  TORCH_CHECK_VALUE(step_num <= total_steps_, "[OneCycleLR::step] Tried to step ", step_num + 1,
                    " times. The specified number of total steps is ", total_steps_);
  double start_step = 0;
  size_t index = 0;
  for (; index < phases_.size(); ++index) {
    const double end_step = phases_[index].end_step;
    if (step_num <= end_step || index == phases_.size() - 1) break;
    start_step = end_step;
  }
  const Phase& phase = phases_[index];
  // PyTorch raises ZeroDivisionError here.
  TORCH_CHECK_VALUE(phase.end_step != start_step, "[OneCycleLR] phase ", index + 1,
                    " of the schedule has no steps at step ", step_num, " (pct_start ", pct_start_, ", total_steps ",
                    total_steps_, "): PyTorch divides by zero here; choose another pct_start or total_steps");
  const double pct = (static_cast<double>(step_num) - start_step) / (phase.end_step - start_step);

  std::vector<double> lrs(num_groups());
  for (size_t i = 0; i < lrs.size(); ++i) {
    lrs[i] = anneal(bound(phase.start_lr, i), bound(phase.end_lr, i), pct);
    if (cycle_momentum_) set_momentum(i, anneal(bound(phase.start_momentum, i), bound(phase.end_momentum, i), pct));
  }
  return lrs;
}

void OneCycleLR::save_extra_state(nlohmann::json& state) const {
  state["total_steps"] = total_steps_;
  state["pct_start"] = pct_start_;
  state["three_phase"] = three_phase_;
  state["anneal_strategy"] = linear_ ? "linear" : "cos";
  state["cycle_momentum"] = cycle_momentum_;
  // PyTorch keeps these in the param groups; LibTorch's groups cannot hold them.
  state["initial_lr"] = initial_lr_;
  state["max_lr"] = max_lr_;
  state["min_lr"] = min_lr_;
  if (cycle_momentum_) {
    state["max_momentum"] = max_momentum_;
    state["base_momentum"] = base_momentum_;
  }
}

void OneCycleLR::load_extra_state(const nlohmann::json& state, const std::string& where) {
  const int64_t total_steps = integer_entry(state, "total_steps", where, 1);
  const double pct_start = number_entry(state, "pct_start", where);
  check_pct_start(pct_start, where);
  const bool three_phase = bool_entry(state, "three_phase", where);
  const auto& strategy = entry(state, "anneal_strategy", where);
  TORCH_CHECK_VALUE(strategy.is_string(), "[", where,
                    "] expected \"anneal_strategy\" to be \"cos\" or \"linear\", got ", brief(strategy));
  const bool linear = parse_anneal_strategy(strategy.get<std::string>(), where);
  const bool cycle_momentum = bool_entry(state, "cycle_momentum", where);
  TORCH_CHECK_VALUE(!cycle_momentum || cycle_momentum_, "[", where,
                    "] the state cycles the momentum (\"cycle_momentum\": true), this scheduler was built without "
                    "cycle_momentum");
  auto initial_lr = numbers_entry(state, "initial_lr", where, num_groups());
  auto max_lr = numbers_entry(state, "max_lr", where, num_groups());
  auto min_lr = numbers_entry(state, "min_lr", where, num_groups());
  std::vector<double> max_momentum, base_momentum;
  if (cycle_momentum) {
    max_momentum = numbers_entry(state, "max_momentum", where, num_groups());
    base_momentum = numbers_entry(state, "base_momentum", where, num_groups());
  }

  total_steps_ = total_steps;
  pct_start_ = pct_start;
  three_phase_ = three_phase;
  phases_ = make_phases(total_steps, pct_start, three_phase);
  linear_ = linear;
  cycle_momentum_ = cycle_momentum;
  initial_lr_ = std::move(initial_lr);
  max_lr_ = std::move(max_lr);
  min_lr_ = std::move(min_lr);
  max_momentum_ = std::move(max_momentum);
  base_momentum_ = std::move(base_momentum);
}

}  // namespace accelerate
