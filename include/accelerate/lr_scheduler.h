// Learning-rate schedulers, which LibTorch's C++ frontend lacks (upstream: torch.optim.lr_scheduler
// — the `LRScheduler` base, `LambdaLR` and `OneCycleLR` — and the `get_*_schedule*` functions of
// transformers/optimization.py, which are `LambdaLR`s with particular lambdas). A scheduler sets the
// `lr` of each param group of a `torch::optim::Optimizer` on every `step()`, with PyTorch's
// semantics and floating-point arithmetic: construction performs the first step (epoch 0),
// `last_epoch()` counts the steps since then, and `state_dict()` / `load_state_dict()` resume a
// schedule exactly where it stopped, as plain JSON. Left out: the other PyTorch schedulers, the
// `last_epoch` constructor argument (resume through `load_state_dict` instead; PyTorch needs an
// `initial_lr` entry in the param groups for it, which LibTorch's groups cannot hold), `verbose`,
// the deprecated `step(epoch)`, and the warnings about calling `step()` before `optimizer.step()`.
//
// Example:
//   auto optimizer = std::make_shared<torch::optim::AdamW>(model->parameters(), 3e-4);
//   auto scheduler = accelerate::get_cosine_schedule_with_warmup(optimizer, 100, 5000);
//   for (auto& batch : loader) {
//     train_step(batch);
//     optimizer->step();
//     scheduler->step();
//   }
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace accelerate {

// ---- the base class -------------------------------------------------------------------------

/// Sets the learning rate of every param group of an optimizer, one epoch (or batch) at a time
/// (upstream: `torch.optim.lr_scheduler.LRScheduler`). Subclasses compute the rates of
/// `last_epoch()` in `compute_lr()` and call `initial_step()` at the end of their constructor,
/// which, as in PyTorch, moves `last_epoch()` from -1 to 0 and sets the epoch-0 rates.
///
/// The base rates are the groups' `lr` when the scheduler is built. (PyTorch instead takes a
/// group's `initial_lr` entry when an earlier scheduler left one there; LibTorch's groups have no
/// room for it, so a second scheduler on the same optimizer starts from the current rates.) There
/// is no `last_epoch` constructor argument: a resumed scheduler is built afresh and then given the
/// saved state with `load_state_dict()`.
class LRScheduler {
 public:
  /// Wraps `optimizer` (sharing its ownership) and records each group's current `lr` as its base
  /// rate. A null optimizer is refused with a `c10::ValueError`.
  explicit LRScheduler(std::shared_ptr<torch::optim::Optimizer> optimizer);
  virtual ~LRScheduler();
  LRScheduler(const LRScheduler&) = delete;
  LRScheduler& operator=(const LRScheduler&) = delete;

  /// Advances one epoch: `last_epoch()` and `step_count()` grow by one and every group's `lr`
  /// becomes the rate of the new epoch. When the rates cannot be computed (e.g. `OneCycleLR`
  /// stepped beyond its total steps) it throws and leaves everything unchanged, where PyTorch
  /// would already have advanced `last_epoch`.
  void step();

  /// The rates set by the last step, one per param group.
  std::vector<double> get_last_lr() const;
  /// The rates the schedule scales, one per param group (PyTorch's `base_lrs`).
  const std::vector<double>& base_lrs() const;
  /// The index of the last epoch: 0 right after construction, +1 per `step()`.
  int64_t last_epoch() const;
  /// How many steps were taken, the one made at construction included (PyTorch's `_step_count`).
  int64_t step_count() const;
  /// Overwrites `step_count()`; the accelerated scheduler counts skipped steps during gradient
  /// accumulation with it, as upstream does with `scheduler._step_count += 1`. Must be >= 0.
  void set_step_count(int64_t count);
  /// The number of steps the schedule is defined for, when it has such a limit (`OneCycleLR`).
  virtual std::optional<int64_t> total_steps() const;
  /// The optimizer whose rates this scheduler sets.
  const std::shared_ptr<torch::optim::Optimizer>& optimizer() const;

  /// The scheduler's state as a JSON object: "base_lrs", "last_epoch", "step_count", "last_lr"
  /// and the subclass's own fields. Like PyTorch's, it leaves out the optimizer, whose param
  /// groups carry the current rates (and momenta) and are saved with the optimizer's state.
  nlohmann::json state_dict() const;
  /// Restores a state returned by `state_dict()` of a scheduler of the same kind over an
  /// optimizer with as many param groups, so that the next `step()` continues that schedule.
  /// Like PyTorch's, it does not touch the optimizer: load the optimizer's state too. A missing
  /// or malformed entry is refused with a `c10::ValueError` naming its key, before anything changes.
  void load_state_dict(const nlohmann::json& state);

 protected:
  /// As the public constructor, with `api_name` starting the messages of errors (e.g. "LambdaLR").
  LRScheduler(std::shared_ptr<torch::optim::Optimizer> optimizer, std::string api_name);

  /// The rate of every param group for epoch `last_epoch()`. Called by `step()`; it may throw
  /// (nothing has changed then) and must not change anything before its last check.
  virtual std::vector<double> compute_lr() = 0;
  /// The step PyTorch's constructor performs; subclasses call it last in their constructor.
  void initial_step();
  /// Replaces the base rates (subclasses that derive them from their options, like `OneCycleLR`).
  void set_base_lrs(std::vector<double> base_lrs);
  /// The name that starts error messages.
  const std::string& api_name() const;
  /// The number of param groups the scheduler was built for.
  size_t num_groups() const;

  /// Adds the subclass's fields to `state` (called by `state_dict()`).
  virtual void save_extra_state(nlohmann::json& state) const;
  /// Checks the subclass's fields in `state` and restores them; must throw before changing
  /// anything. `where` ("<api_name>::load_state_dict") starts error messages.
  virtual void load_extra_state(const nlohmann::json& state, const std::string& where);

 private:
  std::shared_ptr<torch::optim::Optimizer> optimizer_;
  std::string api_name_;
  std::vector<double> base_lrs_;
  std::vector<double> last_lr_;
  int64_t last_epoch_ = -1;
  int64_t step_count_ = 0;
};

// ---- LambdaLR -------------------------------------------------------------------------------

/// A multiplicative factor of the base rate as a function of the epoch.
using LRLambda = std::function<double(int64_t epoch)>;

/// Sets each group's rate to its base rate times `lr_lambda(epoch)` (upstream:
/// `torch.optim.lr_scheduler.LambdaLR`). The lambdas are not part of `state_dict()` (PyTorch
/// stores None for plain functions too): a resumed scheduler must be built with the same ones.
///
/// Example:
///   accelerate::LambdaLR scheduler(optimizer, [](int64_t epoch) { return std::pow(0.95, epoch); });
class LambdaLR : public LRScheduler {
 public:
  /// One lambda for every param group.
  LambdaLR(std::shared_ptr<torch::optim::Optimizer> optimizer, LRLambda lr_lambda);
  /// One lambda per param group, in the order of the groups.
  LambdaLR(std::shared_ptr<torch::optim::Optimizer> optimizer, std::vector<LRLambda> lr_lambdas);

 protected:
  std::vector<double> compute_lr() override;
  void save_extra_state(nlohmann::json& state) const override;
  void load_extra_state(const nlohmann::json& state, const std::string& where) override;

 private:
  std::vector<LRLambda> lr_lambdas_;
};

// ---- transformers' schedules ----------------------------------------------------------------

/// A constant rate: the groups' rates when called (upstream: transformers' `get_constant_schedule`).
std::shared_ptr<LRScheduler> get_constant_schedule(std::shared_ptr<torch::optim::Optimizer> optimizer);

/// A rate growing linearly from 0 to the base rate over `num_warmup_steps` steps, constant after
/// (upstream: transformers' `get_constant_schedule_with_warmup`).
std::shared_ptr<LRScheduler> get_constant_schedule_with_warmup(std::shared_ptr<torch::optim::Optimizer> optimizer,
                                                               int64_t num_warmup_steps);

/// Linear warmup over `num_warmup_steps`, then a linear decrease to 0 at `num_training_steps`
/// (upstream: transformers' `get_linear_schedule_with_warmup`).
std::shared_ptr<LRScheduler> get_linear_schedule_with_warmup(std::shared_ptr<torch::optim::Optimizer> optimizer,
                                                             int64_t num_warmup_steps, int64_t num_training_steps);

/// Linear warmup, then `num_cycles` waves of a cosine from the base rate towards 0 over the
/// remaining steps; the default half wave decreases once to 0 (upstream: transformers'
/// `get_cosine_schedule_with_warmup`).
std::shared_ptr<LRScheduler> get_cosine_schedule_with_warmup(std::shared_ptr<torch::optim::Optimizer> optimizer,
                                                             int64_t num_warmup_steps, int64_t num_training_steps,
                                                             double num_cycles = 0.5);

/// Linear warmup, then `num_cycles` half-cosine decreases from the base rate to 0, each
/// restarting at the base rate (a hard restart); 0 from `num_training_steps` on (upstream:
/// transformers' `get_cosine_with_hard_restarts_schedule_with_warmup`).
std::shared_ptr<LRScheduler> get_cosine_with_hard_restarts_schedule_with_warmup(
    std::shared_ptr<torch::optim::Optimizer> optimizer, int64_t num_warmup_steps, int64_t num_training_steps,
    int64_t num_cycles = 1);

/// Linear warmup, then a polynomial decay of degree `power` from the optimizer's default rate
/// (`optimizer->defaults().get_lr()`) to `lr_end` at `num_training_steps`, and `lr_end` after
/// (upstream: transformers' `get_polynomial_decay_schedule_with_warmup`). Each group's rate is its
/// base rate times that curve divided by the default rate. `lr_end` must be smaller than the
/// default rate, and `num_training_steps` greater than `num_warmup_steps` (transformers would
/// divide by zero on reaching the end of the warmup).
std::shared_ptr<LRScheduler> get_polynomial_decay_schedule_with_warmup(
    std::shared_ptr<torch::optim::Optimizer> optimizer, int64_t num_warmup_steps, int64_t num_training_steps,
    double lr_end = 1e-7, double power = 1.0);

// ---- OneCycleLR -----------------------------------------------------------------------------

/// One value for every param group (`0.9`), or one value per group (`{0.9, 0.8}`), like the
/// "float or list" arguments of PyTorch's schedulers. A braced list is always per group, even of
/// one value: it must have exactly one value per group.
class GroupValues {
 public:
  /// No value at all (for a required option left unset).
  GroupValues() = default;
  /// The same value for every group.
  GroupValues(double value);  // NOLINT(google-explicit-constructor): reads like Python's float
  /// One value per group.
  GroupValues(std::initializer_list<double> values);
  /// One value per group.
  GroupValues(std::vector<double> values);

  /// Whether any value was given.
  bool has_value() const;
  /// The value of each of `num_groups` groups; throws `c10::ValueError` "[<api_name>] expected
  /// <num_groups> values for <name>, got <n>" when a per-group list has another length.
  std::vector<double> resolve(const std::string& api_name, const std::string& name, size_t num_groups) const;

 private:
  std::vector<double> values_;
  bool per_group_ = false;
  bool set_ = false;
};

/// Options of `OneCycleLR` (upstream: the keyword arguments of `torch.optim.lr_scheduler.OneCycleLR`).
struct OneCycleLROptions {
  /// The highest rate of the cycle, for every group or per group (required).
  GroupValues max_lr{};
  /// The number of steps of the cycle. Unset: `epochs * steps_per_epoch`.
  std::optional<int64_t> total_steps{};
  /// With `steps_per_epoch`, gives the number of steps when `total_steps` is unset.
  std::optional<int64_t> epochs{};
  /// With `epochs`, gives the number of steps when `total_steps` is unset.
  std::optional<int64_t> steps_per_epoch{};
  /// The fraction of the cycle, in [0, 1], spent increasing the rate.
  double pct_start = 0.3;
  /// How the rate moves between its bounds: "cos" (cosine annealing) or "linear".
  std::string anneal_strategy = "cos";
  /// Cycle the momentum inversely to the rate between `base_momentum` and `max_momentum`: SGD's
  /// and RMSprop's `momentum`, Adam's and AdamW's first beta. Other optimizers are refused.
  bool cycle_momentum = true;
  /// The momentum at the peak rate, for every group or per group.
  GroupValues base_momentum = 0.85;
  /// The momentum at the start (and end) of the cycle, for every group or per group.
  GroupValues max_momentum = 0.95;
  /// The first rate is `max_lr / div_factor`.
  double div_factor = 25.0;
  /// The last rate is `max_lr / div_factor / final_div_factor`.
  double final_div_factor = 1e4;
  /// Three phases as in the 1cycle paper (up, back down to the first rate, then down to the last
  /// rate) instead of fastai's two (up, then down to the last rate).
  bool three_phase = false;
};

/// The 1cycle policy: the rate anneals from `max_lr / div_factor` up to `max_lr`, then down to a
/// rate much lower than the first, one step per batch (upstream:
/// `torch.optim.lr_scheduler.OneCycleLR`). Construction sets every group's rate to the first rate
/// (and, with `cycle_momentum`, its momentum to `max_momentum`). As in PyTorch, `step()` may be
/// called until `last_epoch()` is `total_steps` and throws a `c10::ValueError` ("Tried to step
/// ... times. The specified number of total steps is ...", counted as PyTorch 1.13 counts) after.
///
/// Example:
///   auto optimizer = std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
///   accelerate::OneCycleLR scheduler(optimizer, {.max_lr = 0.01, .epochs = 10, .steps_per_epoch = 100});
class OneCycleLR : public LRScheduler {
 public:
  /// Checks `options` as PyTorch does (and refuses non-positive division factors and negative
  /// rates) and sets the first rates and momenta.
  OneCycleLR(std::shared_ptr<torch::optim::Optimizer> optimizer, OneCycleLROptions options);

  /// The number of steps of the cycle.
  std::optional<int64_t> total_steps() const override;

 protected:
  std::vector<double> compute_lr() override;
  void save_extra_state(nlohmann::json& state) const override;
  void load_extra_state(const nlohmann::json& state, const std::string& where) override;

 private:
  enum class Momentum { kNone, kMomentum, kBeta1 };
  /// Which per-group value a phase starts or ends at.
  enum class Bound { kInitialLr, kMaxLr, kMinLr, kMaxMomentum, kBaseMomentum };
  struct Phase {
    double end_step;
    Bound start_lr, end_lr, start_momentum, end_momentum;
  };

  static std::vector<Phase> make_phases(int64_t total_steps, double pct_start, bool three_phase);
  double bound(Bound which, size_t group) const;
  double anneal(double start, double end, double pct) const;
  void set_momentum(size_t group, double momentum);

  int64_t total_steps_ = 0;
  double pct_start_ = 0.3;
  bool three_phase_ = false;
  bool linear_ = false;
  bool cycle_momentum_ = true;
  Momentum momentum_kind_ = Momentum::kNone;
  std::vector<Phase> phases_;
  std::vector<double> initial_lr_, max_lr_, min_lr_, max_momentum_, base_momentum_;
};

}  // namespace accelerate
