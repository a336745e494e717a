// Optimizer state as a StateDict: `optimizer_state_dict` and `load_optimizer_state_dict` for
// LibTorch's SGD, Adam, AdamW, Adagrad, RMSprop and LBFGS (their hyperparameters per param group as
// JSON, their per-parameter state tensors by the name "state.<index>.<name>", as PyTorch's
// `Optimizer.state_dict()` numbers parameters), and the loads that check everything before they
// change the optimizer, reading a file's values only after the checks passed (`optimizer_state.h`).
// Upstream keeps an optimizer's state as PyTorch's own pickled dict (`optimizer.bin`); that
// layout is converted in python_layout.cpp. The state-dict files themselves are checkpointing.cpp's.
#include "accelerate/checkpointing.h"
#include "checkpoint/optimizer_state.h"

#include "detail/dtype_names.h"
#include "detail/torch_compat.h"

#include <c10/util/Exception.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <map>
#include <optional>
#include <tuple>

namespace accelerate {

namespace {

// ---- reading JSON fields with errors that name them ----------------------------------------

struct Reader {
  const nlohmann::json& json;
  std::string where;

  const nlohmann::json& at(const std::string& key) const {
    TORCH_CHECK_VALUE(json.is_object() && json.contains(key), where, ": missing \"", key, "\"");
    return json.at(key);
  }
  double number(const std::string& key) const {
    const auto& v = at(key);
    TORCH_CHECK_VALUE(v.is_number(), where, ": \"", key, "\" should be a number, got ", v.dump());
    return v.get<double>();
  }
  int64_t integer(const std::string& key) const {
    const auto& v = at(key);
    TORCH_CHECK_VALUE(v.is_number_integer(), where, ": \"", key, "\" should be an integer, got ", v.dump());
    return v.get<int64_t>();
  }
  bool boolean(const std::string& key) const {
    const auto& v = at(key);
    TORCH_CHECK_VALUE(v.is_boolean(), where, ": \"", key, "\" should be true or false, got ", v.dump());
    return v.get<bool>();
  }
  std::optional<int64_t> optional_integer(const std::string& key) const {
    const auto& v = at(key);
    if (v.is_null()) return std::nullopt;
    return integer(key);
  }
  std::tuple<double, double> pair(const std::string& key) const {
    const auto& v = at(key);
    TORCH_CHECK_VALUE(v.is_array() && v.size() == 2 && v[0].is_number() && v[1].is_number(), where, ": \"", key,
                      "\" should be two numbers, got ", v.dump());
    return {v[0].get<double>(), v[1].get<double>()};
  }
};

// ---- optimizer kinds -----------------------------------------------------------------------

enum class Kind { kSGD, kAdam, kAdamW, kAdagrad, kRMSprop, kLBFGS };

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::kSGD: return "SGD";
    case Kind::kAdam: return "Adam";
    case Kind::kAdamW: return "AdamW";
    case Kind::kAdagrad: return "Adagrad";
    case Kind::kRMSprop: return "RMSprop";
    case Kind::kLBFGS: return "LBFGS";
  }
  return "?";
}

Kind kind_of(const torch::optim::Optimizer& optimizer, const char* api) {
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer)) return Kind::kSGD;
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer)) return Kind::kAdamW;
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer)) return Kind::kAdam;
  if (dynamic_cast<const torch::optim::Adagrad*>(&optimizer)) return Kind::kAdagrad;
  if (dynamic_cast<const torch::optim::RMSprop*>(&optimizer)) return Kind::kRMSprop;
  if (dynamic_cast<const torch::optim::LBFGS*>(&optimizer)) return Kind::kLBFGS;
  C10_THROW_ERROR(ValueError, c10::str("[", api, "] cannot checkpoint an optimizer of type ",
                                       c10::demangle(typeid(optimizer).name()),
                                       "; LibTorch's SGD, Adam, AdamW, Adagrad, RMSprop and LBFGS are supported "
                                       "(register other optimizers with register_for_checkpointing through an object "
                                       "with state_dict() and load_state_dict())"));
}

nlohmann::json options_json(Kind kind, const torch::optim::OptimizerOptions& options) {
  using namespace torch::optim;
  switch (kind) {
    case Kind::kSGD: {
      const auto& o = static_cast<const SGDOptions&>(options);
      return {{"lr", o.lr()}, {"momentum", o.momentum()}, {"dampening", o.dampening()},
              {"weight_decay", o.weight_decay()}, {"nesterov", o.nesterov()}};
    }
    case Kind::kAdam: {
      const auto& o = static_cast<const AdamOptions&>(options);
      return {{"lr", o.lr()}, {"betas", {std::get<0>(o.betas()), std::get<1>(o.betas())}}, {"eps", o.eps()},
              {"weight_decay", o.weight_decay()}, {"amsgrad", o.amsgrad()}};
    }
    case Kind::kAdamW: {
      const auto& o = static_cast<const AdamWOptions&>(options);
      return {{"lr", o.lr()}, {"betas", {std::get<0>(o.betas()), std::get<1>(o.betas())}}, {"eps", o.eps()},
              {"weight_decay", o.weight_decay()}, {"amsgrad", o.amsgrad()}};
    }
    case Kind::kAdagrad: {
      const auto& o = static_cast<const AdagradOptions&>(options);
      return {{"lr", o.lr()}, {"lr_decay", o.lr_decay()}, {"weight_decay", o.weight_decay()},
              {"initial_accumulator_value", o.initial_accumulator_value()}, {"eps", o.eps()}};
    }
    case Kind::kRMSprop: {
      const auto& o = static_cast<const RMSpropOptions&>(options);
      return {{"lr", o.lr()}, {"alpha", o.alpha()}, {"eps", o.eps()}, {"weight_decay", o.weight_decay()},
              {"momentum", o.momentum()}, {"centered", o.centered()}};
    }
    case Kind::kLBFGS: {
      const auto& o = static_cast<const LBFGSOptions&>(options);
      return {{"lr", o.lr()},
              {"max_iter", o.max_iter()},
              {"max_eval", o.max_eval() ? nlohmann::json(*o.max_eval()) : nlohmann::json()},
              {"tolerance_grad", o.tolerance_grad()},
              {"tolerance_change", o.tolerance_change()},
              {"history_size", o.history_size()},
              {"line_search_fn", o.line_search_fn() ? nlohmann::json(*o.line_search_fn()) : nlohmann::json()}};
    }
  }
  return {};
}

std::unique_ptr<torch::optim::OptimizerOptions> options_from_json(Kind kind, const Reader& r) {
  using namespace torch::optim;
  switch (kind) {
    case Kind::kSGD: {
      auto o = std::make_unique<SGDOptions>(r.number("lr"));
      o->momentum(r.number("momentum")).dampening(r.number("dampening")).weight_decay(r.number("weight_decay"));
      o->nesterov(r.boolean("nesterov"));
      return o;
    }
    case Kind::kAdam: {
      auto o = std::make_unique<AdamOptions>(r.number("lr"));
      o->betas(r.pair("betas")).eps(r.number("eps")).weight_decay(r.number("weight_decay")).amsgrad(r.boolean("amsgrad"));
      return o;
    }
    case Kind::kAdamW: {
      auto o = std::make_unique<AdamWOptions>(r.number("lr"));
      o->betas(r.pair("betas")).eps(r.number("eps")).weight_decay(r.number("weight_decay")).amsgrad(r.boolean("amsgrad"));
      return o;
    }
    case Kind::kAdagrad: {
      auto o = std::make_unique<AdagradOptions>(r.number("lr"));
      o->lr_decay(r.number("lr_decay")).weight_decay(r.number("weight_decay"));
      o->initial_accumulator_value(r.number("initial_accumulator_value")).eps(r.number("eps"));
      return o;
    }
    case Kind::kRMSprop: {
      auto o = std::make_unique<RMSpropOptions>(r.number("lr"));
      o->alpha(r.number("alpha")).eps(r.number("eps")).weight_decay(r.number("weight_decay"));
      o->momentum(r.number("momentum")).centered(r.boolean("centered"));
      return o;
    }
    case Kind::kLBFGS: {
      auto o = std::make_unique<LBFGSOptions>(r.number("lr"));
      const auto max_eval = r.optional_integer("max_eval");
      o->max_iter(r.integer("max_iter")).max_eval(max_eval ? c10::optional<int64_t>(*max_eval) : c10::nullopt);
      o->tolerance_grad(r.number("tolerance_grad")).tolerance_change(r.number("tolerance_change"));
      o->history_size(r.integer("history_size"));
      const auto& search = r.at("line_search_fn");
      TORCH_CHECK_VALUE(search.is_null() || search.is_string(), r.where,
                        ": \"line_search_fn\" should be a string or null, got ", search.dump());
      o->line_search_fn(search.is_null() ? c10::nullopt : c10::optional<std::string>(search.get<std::string>()));
      return o;
    }
  }
  return nullptr;
}

auto param_key(const at::Tensor& p) { return detail::compat::optimizer_state_key(p); }

// Where load_optimizer_state takes the values of the state tensors from: copies of the
// StateDict's tensors, or (with `file`) the file, read in bulk after every check passed, the
// StateDict's tensors then being views of it for the checks.
struct TensorSource {
  const SafetensorsFile* file = nullptr;
  bool convert_dtypes = false;
  bool check_only = false;  // stop after the checks, changing nothing
};

// Adam and AdamW keep the same per-parameter state in two unrelated LibTorch types.
template <typename State, typename Put>
void save_moments(const State& s, nlohmann::json& scalars, const Put& put) {
  scalars["step"] = s.step();
  put("exp_avg", s.exp_avg());
  put("exp_avg_sq", s.exp_avg_sq());
  put("max_exp_avg_sq", s.max_exp_avg_sq());
}

template <typename State, typename Get>
std::unique_ptr<torch::optim::OptimizerParamState> load_moments(const Reader& scalars, const Get& get) {
  auto s = std::make_unique<State>();
  s->step(scalars.integer("step"));
  s->exp_avg(get("exp_avg", true, true)).exp_avg_sq(get("exp_avg_sq", true, true));
  s->max_exp_avg_sq(get("max_exp_avg_sq", false, true));
  return s;
}

// Adds one parameter's state: scalars to `scalars`, tensors to `tensors` under "state.<index>.".
void save_param_state(Kind kind, const torch::optim::OptimizerParamState& state, const std::string& prefix,
                      nlohmann::json& scalars, TensorMap& tensors) {
  using namespace torch::optim;
  const auto put = [&](const char* name, const at::Tensor& t) {
    if (t.defined()) tensors.emplace(prefix + name, t.detach());
  };
  switch (kind) {
    case Kind::kSGD:
      put("momentum_buffer", static_cast<const SGDParamState&>(state).momentum_buffer());
      break;
    case Kind::kAdam:
      save_moments(static_cast<const AdamParamState&>(state), scalars, put);
      break;
    case Kind::kAdamW:
      save_moments(static_cast<const AdamWParamState&>(state), scalars, put);
      break;
    case Kind::kAdagrad: {
      const auto& s = static_cast<const AdagradParamState&>(state);
      scalars["step"] = s.step();
      put("sum", s.sum());
      break;
    }
    case Kind::kRMSprop: {
      const auto& s = static_cast<const RMSpropParamState&>(state);
      scalars["step"] = s.step();
      put("square_avg", s.square_avg());
      put("momentum_buffer", s.momentum_buffer());
      put("grad_avg", s.grad_avg());
      break;
    }
    case Kind::kLBFGS: {
      const auto& s = static_cast<const LBFGSParamState&>(state);
      scalars["func_evals"] = s.func_evals();
      scalars["n_iter"] = s.n_iter();
      scalars["t"] = s.t();
      scalars["prev_loss"] = s.prev_loss();
      scalars["old_dirs"] = s.old_dirs().size();
      scalars["old_stps"] = s.old_stps().size();
      scalars["ro"] = s.ro().size();
      scalars["al"] = s.al() ? nlohmann::json(s.al()->size()) : nlohmann::json();
      put("d", s.d());
      put("H_diag", s.H_diag());
      put("prev_flat_grad", s.prev_flat_grad());
      for (size_t i = 0; i < s.old_dirs().size(); ++i) put(("old_dirs." + std::to_string(i)).c_str(), s.old_dirs()[i]);
      for (size_t i = 0; i < s.old_stps().size(); ++i) put(("old_stps." + std::to_string(i)).c_str(), s.old_stps()[i]);
      for (size_t i = 0; i < s.ro().size(); ++i) put(("ro." + std::to_string(i)).c_str(), s.ro()[i]);
      if (s.al()) {
        for (size_t i = 0; i < s.al()->size(); ++i) put(("al." + std::to_string(i)).c_str(), (*s.al())[i]);
      }
      break;
    }
  }
}

// Builds one parameter's state from the checkpoint, its tensors moved to `param`'s device. A
// tensor that mirrors the parameter must have its shape.
std::unique_ptr<torch::optim::OptimizerParamState> load_param_state(Kind kind, const Reader& scalars,
                                                                    const TensorMap& tensors, const std::string& prefix,
                                                                    const at::Tensor& param, const std::string& where,
                                                                    const TensorSource& source, const TensorMap& existing,
                                                                    TensorMap& pending) {
  using namespace torch::optim;
  const auto get = [&](const char* name, bool required, bool like_param) -> at::Tensor {
    auto it = tensors.find(prefix + name);
    if (it == tensors.end()) {
      TORCH_CHECK_VALUE(!required, where, ": missing tensor ", prefix, name);
      return {};
    }
    TORCH_CHECK_VALUE(!like_param || it->second.sizes() == param.sizes(), where, ": tensor ", prefix, name,
                      " has shape ", it->second.sizes(), " but its parameter has shape ", param.sizes(),
                      " (was the checkpoint saved from another model?)");
    // A state tensor that mirrors its parameter has its dtype (Note [Dtypes are checked like shapes]).
    const bool convert = like_param && it->second.scalar_type() != param.scalar_type();
    TORCH_CHECK_VALUE(!convert || source.convert_dtypes, where, ": tensor ", prefix, name, " holds ",
                      detail::dtype_name(it->second.scalar_type()), " but its parameter holds ",
                      detail::dtype_name(param.scalar_type()), "; set convert_dtypes to convert");
    const auto dtype = convert ? param.scalar_type() : it->second.scalar_type();
    if (source.check_only) return it->second;
    if (source.file != nullptr) {
      // Filled from the file once every check has passed: into the optimizer's own tensor of
      // that name when it matches, else into a new one.
      const auto& view = it->second;
      auto current = existing.find(prefix + name);
      at::Tensor destination;
      if (current != existing.end() && current->second.sizes() == view.sizes() &&
          current->second.scalar_type() == dtype && current->second.device() == param.device() &&
          current->second.is_contiguous()) {
        destination = current->second;
      } else {
        destination = at::empty(view.sizes(), view.options().dtype(dtype).device(param.device()));
      }
      pending.insert_or_assign(prefix + name, destination);
      return destination;
    }
    // An owned copy: the optimizer updates its state in place.
    return it->second.to(param.device(), dtype, /*non_blocking=*/false, /*copy=*/true);
  };
  const auto list = [&](const char* name) {
    std::vector<at::Tensor> out;
    const auto count = scalars.integer(name);
    TORCH_CHECK_VALUE(count >= 0 && count <= 1 << 20, where, ": \"", name, "\" has an impossible length ", count);
    for (int64_t i = 0; i < count; ++i) out.push_back(get((std::string(name) + "." + std::to_string(i)).c_str(), true, false));
    return out;
  };
  switch (kind) {
    case Kind::kSGD: {
      auto s = std::make_unique<SGDParamState>();
      s->momentum_buffer(get("momentum_buffer", false, true));
      return s;
    }
    case Kind::kAdam:
      return load_moments<AdamParamState>(scalars, get);
    case Kind::kAdamW:
      return load_moments<AdamWParamState>(scalars, get);
    case Kind::kAdagrad: {
      auto s = std::make_unique<AdagradParamState>();
      s->step(scalars.integer("step"));
      s->sum(get("sum", true, true));
      return s;
    }
    case Kind::kRMSprop: {
      auto s = std::make_unique<RMSpropParamState>();
      s->step(scalars.integer("step"));
      s->square_avg(get("square_avg", true, true));
      s->momentum_buffer(get("momentum_buffer", false, true)).grad_avg(get("grad_avg", false, true));
      return s;
    }
    case Kind::kLBFGS: {
      auto s = std::make_unique<LBFGSParamState>();
      s->func_evals(scalars.integer("func_evals")).n_iter(scalars.integer("n_iter"));
      s->t(scalars.number("t")).prev_loss(scalars.number("prev_loss"));
      s->d(get("d", false, false)).H_diag(get("H_diag", false, false)).prev_flat_grad(get("prev_flat_grad", false, false));
      const auto dirs = list("old_dirs");
      const auto stps = list("old_stps");
      const auto ro = list("ro");
      s->old_dirs(std::deque<at::Tensor>(dirs.begin(), dirs.end()));
      s->old_stps(std::deque<at::Tensor>(stps.begin(), stps.end()));
      s->ro(std::deque<at::Tensor>(ro.begin(), ro.end()));
      if (!scalars.at("al").is_null()) s->al(list("al"));
      return s;
    }
  }
  return nullptr;
}

}  // namespace

// ---- optimizers ----------------------------------------------------------------------------

StateDict optimizer_state_dict(const torch::optim::Optimizer& optimizer) {
  const Kind kind = kind_of(optimizer, "optimizer_state_dict");
  StateDict out;
  out.values["optimizer"] = kind_name(kind);
  auto& groups = out.values["param_groups"] = nlohmann::json::array();
  auto& scalars = out.values["state"] = nlohmann::json::object();
  int64_t index = 0;
  for (const auto& group : optimizer.param_groups()) {
    auto g = options_json(kind, group.options());
    auto& params = g["params"] = nlohmann::json::array();
    for (const auto& p : group.params()) {
      params.push_back(index);
      auto it = optimizer.state().find(param_key(p));
      if (it != optimizer.state().end() && it->second) {
        const std::string prefix = "state." + std::to_string(index) + ".";
        nlohmann::json s = nlohmann::json::object();
        save_param_state(kind, *it->second, prefix, s, out.tensors);
        scalars[std::to_string(index)] = std::move(s);
      }
      ++index;
    }
    groups.push_back(std::move(g));
  }
  return out;
}

namespace {

void load_optimizer_state(torch::optim::Optimizer& optimizer, const StateDict& state, const TensorSource& source) {
  const Kind kind = kind_of(optimizer, "load_optimizer_state_dict");
  const std::string where =
      source.file != nullptr ? "[load_optimizer_state_dict] " + source.file->path() + ":" : "[load_optimizer_state_dict]";
  const Reader top{state.values, where};
  const auto& saved_kind = top.at("optimizer");
  TORCH_CHECK_VALUE(saved_kind.is_string() && saved_kind.get<std::string>() == kind_name(kind), where,
                    " the checkpoint holds the state of a ", saved_kind.dump(), " optimizer, this one is ",
                    kind_name(kind));
  const auto& groups = top.at("param_groups");
  const auto& scalars = top.at("state");
  auto& live_groups = optimizer.param_groups();
  TORCH_CHECK_VALUE(groups.is_array() && groups.size() == live_groups.size(), where, " the checkpoint has ",
                    groups.is_array() ? groups.size() : 0, " param groups, the optimizer has ", live_groups.size());
  TORCH_CHECK_VALUE(scalars.is_object(), where, " \"state\" should be an object, got ", scalars.dump());
  // Everything is built first, then swapped in.
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> new_options;
  std::vector<std::pair<decltype(param_key(at::Tensor())), std::unique_ptr<torch::optim::OptimizerParamState>>>
      new_states;
  std::vector<at::Tensor> params_by_index;
  for (size_t g = 0; g < live_groups.size(); ++g) {
    const Reader group{groups[g], c10::str(where, " param group ", g)};
    new_options.push_back(options_from_json(kind, group));
    const auto& indices = group.at("params");
    const auto& params = live_groups[g].params();
    TORCH_CHECK_VALUE(indices.is_array() && indices.size() == params.size(), where, " param group ", g,
                      " of the checkpoint has ", indices.is_array() ? indices.size() : 0,
                      " parameters, the optimizer's has ", params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      TORCH_CHECK_VALUE(indices[i].is_number_integer() &&
                            indices[i].get<int64_t>() == static_cast<int64_t>(params_by_index.size()),
                        where, " param group ", g, " lists parameter ", indices[i].dump(), " where ",
                        params_by_index.size(), " was expected");
      params_by_index.push_back(params[i]);
    }
  }
  // The optimizer's current state tensors, by checkpoint name (destinations for a file source).
  TensorMap existing, pending;
  if (source.file != nullptr) {
    for (size_t i = 0; i < params_by_index.size(); ++i) {
      auto it = optimizer.state().find(param_key(params_by_index[i]));
      if (it == optimizer.state().end() || !it->second) continue;
      nlohmann::json ignored;
      save_param_state(kind, *it->second, "state." + std::to_string(i) + ".", ignored, existing);
    }
  }
  for (const auto& [key, value] : scalars.items()) {
    size_t used = 0;
    int64_t index = -1;
    try {
      index = std::stoll(key, &used);
    } catch (const std::exception&) {
    }
    TORCH_CHECK_VALUE(used == key.size() && index >= 0 && index < static_cast<int64_t>(params_by_index.size()), where,
                      " the state names parameter \"", key, "\", but the optimizer has ", params_by_index.size(),
                      " parameters");
    const auto& param = params_by_index[static_cast<size_t>(index)];
    new_states.emplace_back(param_key(param),
                            load_param_state(kind, Reader{value, c10::str(where, " state of parameter ", index)},
                                             state.tensors, "state." + key + ".", param,
                                             c10::str(where, " state of parameter ", index), source, existing,
                                             pending));
  }
  if (source.check_only) return;
  if (source.file != nullptr) source.file->read_into(pending);
  for (size_t g = 0; g < live_groups.size(); ++g) live_groups[g].set_options(std::move(new_options[g]));
  optimizer.state().clear();
  for (auto& [key, s] : new_states) optimizer.state()[key] = std::move(s);
}

}  // namespace

void load_optimizer_state_dict(torch::optim::Optimizer& optimizer, const StateDict& state,
                               const LoadOptimizerStateOptions& options) {
  load_optimizer_state(optimizer, state, {.file = nullptr, .convert_dtypes = options.convert_dtypes});
}

namespace detail::checkpoint {

void load_optimizer_state_from_file(torch::optim::Optimizer& optimizer, const StateDict& views,
                                    const SafetensorsFile& file, const LoadOptimizerStateOptions& options) {
  load_optimizer_state(optimizer, views, {.file = &file, .convert_dtypes = options.convert_dtypes});
}

void check_optimizer_state(torch::optim::Optimizer& optimizer, const StateDict& state, const SafetensorsFile* file,
                           const LoadOptimizerStateOptions& options) {
  load_optimizer_state(optimizer, state, {.file = file, .convert_dtypes = options.convert_dtypes, .check_only = true});
}

}  // namespace detail::checkpoint

}  // namespace accelerate
