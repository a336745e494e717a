// The project's layout of a save_state folder and upstream Python Accelerate's, each one class,
// and the one place that chooses between them; see layout.h. Upstream's conversions of each
// object's state are python_layout.cpp's.
#include "checkpoint/layout.h"

#include "checkpoint/checkpointing.h"
#include "checkpoint/python_layout.h"
#include "checkpoint/state_objects.h"
#include "detail/warn.h"

#include <c10/util/Exception.h>

namespace fs = std::filesystem;

namespace accelerate::detail::checkpoint {

namespace {

namespace python = checkpoint::python_layout;

// The project's own layout: safetensors files for tensors, JSON for the rest.
class CppLayout final : public Layout {
 public:
  void check_savable(const CheckpointObjects&) const override {}

  std::optional<std::vector<fs::path>> model_files(const fs::path&, size_t) const override { return std::nullopt; }

  bool reads_sharded_optimizer(bool) const override { return true; }
  std::string optimizer_file(size_t i) const override { return numbered("optimizer", i, ".safetensors"); }
  void write_optimizer(const StateDict& state, const std::string& path, const std::vector<std::string>&) const override {
    save_state_dict_file(state, path);
  }
  bool writes_dcp() const override { return false; }
  std::optional<std::string> fsdp_model_file(size_t) const override { return std::nullopt; }
  void write_fsdp_model(const std::vector<std::pair<std::string, at::Tensor>>&, const std::string&) const override {}
  StateDict read_optimizer(const std::string& path, const torch::optim::Optimizer&, const std::vector<std::string>&,
                           std::unique_ptr<SafetensorsFile>& file) const override {
    file = std::make_unique<SafetensorsFile>(path);
    return state_dict_views(*file);
  }

  std::string scheduler_file(size_t i) const override { return numbered("scheduler", i, ".json"); }
  void write_scheduler(const LRScheduler& scheduler, const std::string& path) const override {
    save_state_dict_file({scheduler.state_dict(), {}}, path);
  }
  StateDict read_scheduler(const std::string& path, const LRScheduler&) const override {
    return load_state_dict_file(path);
  }

  bool keeps_data_loaders() const override { return true; }
  void warn_skipped(const CheckpointObjects&, const fs::path&, const PartialState&) const override {}

  std::string scaler_file() const override { return "scaler.json"; }
  void write_scaler(const nlohmann::json& state, const std::string& path) const override {
    save_state_dict_file({state, {}}, path);
  }
  StateDict read_scaler(const std::string& path) const override { return load_state_dict_file(path); }

  std::string custom_file(size_t i, const StateDict& state) const override {
    return "custom_checkpoint_" + std::to_string(i) + (state.tensors.empty() ? ".json" : ".safetensors");
  }
  void write_custom(const StateDict& state, const std::string& path) const override {
    save_state_dict_file(state, path);
  }

  std::string random_file(int process_index) const override {
    return "random_states_" + std::to_string(process_index) + ".safetensors";
  }
  void write_random(StateDict generators, int64_t step, const std::string& path) const override {
    generators.values["step"] = step;
    save_state_dict_file(generators, path);
  }
  StateDict read_random(const fs::path& path, const PartialState&) const override {
    auto random = load_state_dict_file(path.string());
    TORCH_CHECK_VALUE(random.values.contains("step") && random.values.at("step").is_number_integer(), path.string(),
                      " has no integer \"step\"");
    return random;
  }
};

// Upstream's layout: torch.save archives under upstream's names (Note [Checkpoints from and for
// Python] in python_layout.cpp).
class PythonLayout final : public Layout {
 public:
  // What upstream's layout cannot hold.
  void check_savable(const CheckpointObjects& objects) const override {
    // SHARDED_STATE_DICT becomes torch.distributed.checkpoint folders, as upstream's FSDP writes;
    // LOCAL_STATE_DICT has no counterpart there (upstream's FSDP2 has none, FSDP1's files hold
    // ShardedTensor objects).
    for (size_t i = 0; i < objects.models.size(); ++i) {
      TORCH_CHECK_VALUE(!objects.model_engines[i] || !local_state(objects.model_engines[i]),
                        "[Accelerator::save_state] model ", i, " saves LOCAL_STATE_DICT states, which Python's "
                        "layout cannot hold (upstream's FSDP2 has no LOCAL_STATE_DICT); use SHARDED_STATE_DICT, "
                        "FULL_STATE_DICT or the project's layout");
    }
    for (size_t i = 0; i < objects.schedulers.size(); ++i) {
      TORCH_CHECK_VALUE(dynamic_cast<const LambdaLR*>(objects.schedulers[i].scheduler().get()) != nullptr,
                        "[Accelerator::save_state] scheduler ", i, " is not a LambdaLR: only LambdaLR schedulers (and "
                        "transformers' schedules) are written in Python's layout");
    }
    // Refused here, on every process, rather than where the optimizer is written: a sharded
    // state's folder is written by every process together (its metadata is gathered).
    for (size_t i = 0; i < objects.optimizers.size(); ++i) {
      const auto kind = optimizer_state_dict(*objects.optimizers[i].optimizer()).values.at("optimizer");
      TORCH_CHECK_VALUE(kind != "LBFGS", "[Accelerator::save_state] optimizer ", i,
                        " is an LBFGS, whose state is not written in Python's layout: ", python::kLbfgsReason);
      if (!objects.optimizer_engines[i]) continue;
      const auto names = optimizer_param_names(objects, i);
      for (size_t k = 0; k < names.size(); ++k) {
        TORCH_CHECK_VALUE(!names[k].empty(), "[Accelerator::save_state] parameter ", k, " of optimizer ", i,
                          " is in no prepared model, so it has no name for upstream's FSDP files (which name "
                          "every parameter); prepare the model that holds it");
      }
    }
  }

  std::optional<std::vector<fs::path>> model_files(const fs::path& folder, size_t i) const override {
    auto files = python::model_files(folder, i);
    // Upstream's FSDP keeps a SHARDED_STATE_DICT in the folder `pytorch_model_fsdp_<i>`.
    if (files.empty() && fs::is_directory(folder / ("pytorch_model_fsdp_" + std::to_string(i)))) return std::nullopt;
    TORCH_CHECK_VALUE(!files.empty(), "the checkpoint has no ", python::model_file(i, true), " nor ",
                      python::model_file(i, false), " nor ", python::fsdp_model_file(i), " nor the folder pytorch_model_fsdp_",
                      i);
    return files;
  }

  bool reads_sharded_optimizer(bool has_engine) const override { return has_engine; }
  std::string optimizer_file(size_t i) const override { return python::optimizer_file(i); }
  void write_optimizer(const StateDict& state, const std::string& path,
                       const std::vector<std::string>& names) const override {
    python::write_optimizer(state, path, names);
  }
  bool writes_dcp() const override { return true; }
  std::optional<std::string> fsdp_model_file(size_t i) const override { return python::fsdp_model_file(i); }
  void write_fsdp_model(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                        const std::string& path) const override {
    python::write_pickled_model(tensors, path);
  }
  StateDict read_optimizer(const std::string& path, const torch::optim::Optimizer& optimizer,
                           const std::vector<std::string>& names, std::unique_ptr<SafetensorsFile>&) const override {
    return python::read_optimizer(path, optimizer, names);
  }

  std::string scheduler_file(size_t i) const override { return python::scheduler_file(i); }
  void write_scheduler(const LRScheduler& scheduler, const std::string& path) const override {
    python::write_scheduler(scheduler, path);
  }
  StateDict read_scheduler(const std::string& path, const LRScheduler& scheduler) const override {
    return {python::read_scheduler(path, scheduler), {}};
  }

  bool keeps_data_loaders() const override { return false; }  // upstream's are pickled Python objects
  // The data loaders' files of upstream's layout, which hold pickled Python objects (the sampler).
  void warn_skipped(const CheckpointObjects& objects, const fs::path& folder,
                    const PartialState& state) const override {
    std::vector<std::string> skipped;
    for (size_t i = 0; i < objects.loaders.size(); ++i) {
      for (const auto& name : {python::sampler_file(i), python::loader_state_file(i)}) {
        if (fs::is_regular_file(folder / name)) skipped.push_back(name);
      }
    }
    if (skipped.empty() && objects.loaders.empty()) return;
    warn("accelerate.checkpointing",
         c10::str("[Accelerator::load_state] ", folder.string(), " is in Python Accelerate's layout; the ",
                  "data loaders keep their state (", skipped.empty() ? "none saved" : c10::Join(", ", skipped),
                  ": pickled Python samplers, which are not read)"),
         {.once = true, .state = state});
  }

  std::string scaler_file() const override { return python::kScalerFile; }
  void write_scaler(const nlohmann::json& state, const std::string& path) const override {
    python::write_scaler(state, path);
  }
  StateDict read_scaler(const std::string& path) const override { return {python::read_scaler(path), {}}; }

  std::string custom_file(size_t i, const StateDict&) const override { return python::custom_file(i); }
  void write_custom(const StateDict& state, const std::string& path) const override {
    python::write_custom(state, path);
  }

  std::string random_file(int process_index) const override { return python::random_file(process_index); }
  void write_random(StateDict generators, int64_t step, const std::string& path) const override {
    python::write_random(generators, step, path);
  }
  StateDict read_random(const fs::path& path, const PartialState& state) const override {
    std::vector<std::string> skipped;
    auto random = python::read_random(path.string(), skipped);
    if (!skipped.empty()) {
      warn("accelerate.checkpointing",
           c10::str("[Accelerator::load_state] ", path.filename().string(), " holds ", c10::Join(", ", skipped),
                    ", which have no C++ counterpart (Python's random and numpy generators) and are skipped"),
           {.once = true, .state = state});
    }
    return random;
  }
};

const CppLayout kCpp;
const PythonLayout kPython;

}  // namespace

const Layout& layout_to_save(CheckpointLayout layout) {
  TORCH_CHECK_VALUE(layout != CheckpointLayout::kDetect, "[Accelerator::save_state] CheckpointLayout::kDetect is for "
                                                         "loading; save with kCpp or kPython");
  return layout == CheckpointLayout::kPython ? static_cast<const Layout&>(kPython) : kCpp;
}

const Layout& layout_to_load(CheckpointLayout layout, const fs::path& folder) {
  const bool python =
      layout == CheckpointLayout::kPython || (layout == CheckpointLayout::kDetect && python::is_python_folder(folder));
  return python ? static_cast<const Layout&>(kPython) : kCpp;
}

}  // namespace accelerate::detail::checkpoint
