// The Accelerator's experiment tracking: init_trackers, log, get_tracker, trackers and
// end_training (upstream: the tracking methods of accelerator.py). The trackers are in
// src/tracking.cpp.
#include "accelerate/accelerator.h"
#include "accelerator_impl.h"
#include "tracking_impl.h"

#include <c10/util/Exception.h>

#include <exception>
#include <string>

namespace accelerate {

namespace {

// What a process that does not run a tracker holds in its place (upstream: `GeneralTracker(_blank=True)`).
class BlankTracker : public GeneralTracker {
 public:
  BlankTracker(std::string name, bool requires_logging_directory)
      : name_(std::move(name)), requires_logging_directory_(requires_logging_directory) {}
  std::string name() const override { return name_; }
  bool requires_logging_directory() const override { return requires_logging_directory_; }
  void store_init_configuration(const nlohmann::json&) override {}
  void log(const nlohmann::json&, std::optional<int64_t>) override {}
  void log_images(const std::map<std::string, at::Tensor>&, std::optional<int64_t>) override {}

 private:
  std::string name_;
  bool requires_logging_directory_;
};

std::string tracker_names(const std::vector<Tracker>& trackers) {
  std::string out;
  for (const auto& t : trackers) out += (out.empty() ? "" : ", ") + t.name();
  return out.empty() ? "none" : out;
}

const Tracker* find_tracker(const std::vector<Tracker>& trackers, const std::string& name) {
  for (const auto& t : trackers) {
    if (t.name() == name) return &t;
  }
  return nullptr;
}

}  // namespace

void Accelerator::init_trackers(const std::string& project_name, const nlohmann::json& config,
                                const nlohmann::json& init_kwargs) const {
  constexpr const char* api = "Accelerator.init_trackers";
  TORCH_CHECK_VALUE(config.is_object(), "[", api, "] config: expected a JSON object, got ", config.type_name());
  TORCH_CHECK_VALUE(init_kwargs.is_object(), "[", api,
                    "] init_kwargs: expected a JSON object keyed by tracker name, got ", init_kwargs.type_name());
  std::vector<Tracker> log_with;
  std::string logging_dir;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    TORCH_CHECK(!impl_->trackers_running, "[", api,
                "] the trackers are already running; call end_training() before starting new runs");
    log_with = impl_->log_with;
    logging_dir = impl_->project.logging_dir;
  }
  // Every process checks the arguments, so that a mistake fails everywhere alike.
  for (const auto& [name, kwargs] : init_kwargs.items()) {
    const Tracker* tracker = find_tracker(log_with, name);
    TORCH_CHECK_VALUE(tracker != nullptr, "[", api, "] init_kwargs: no tracker named '", name, "' in log_with (",
                      tracker_names(log_with), ")");
    TORCH_CHECK_VALUE(tracker->is_name(), "[", api, "] init_kwargs['", name, "']: '", name,
                      "' is a tracker you constructed; pass its options to its constructor");
    detail::check_init_kwargs(name, kwargs, api);
  }
  if (!config.empty() && find_tracker(log_with, "tensorboard") != nullptr) detail::check_hparams(config, api);

  const bool main = is_main_process();
  std::vector<std::shared_ptr<GeneralTracker>> made;
  for (const auto& t : log_with) {
    if (t.is_name()) {
      const nlohmann::json kwargs = init_kwargs.value(t.name(), nlohmann::json::object());
      made.push_back(main ? detail::make_tracker(t.name(), project_name, logging_dir, kwargs, api)
                          : std::make_shared<BlankTracker>(t.name(), detail::find_tracker_entry(t.name())->needs_logging_dir));
    } else if (main || !t.tracker()->main_process_only()) {
      made.push_back(t.tracker());
    } else {
      made.push_back(std::make_shared<BlankTracker>(t.name(), t.tracker()->requires_logging_directory()));
    }
  }
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->trackers = made;
    impl_->trackers_running = true;
  }
  if (!config.empty()) {
    for (const auto& tracker : made) tracker->store_init_configuration(config);
  }
}

void Accelerator::log(const nlohmann::json& values, std::optional<int64_t> step,
                      const nlohmann::json& log_kwargs) const {
  constexpr const char* api = "Accelerator.log";
  check_log_values(values, api);
  TORCH_CHECK_VALUE(log_kwargs.is_object(), "[", api,
                    "] log_kwargs: expected a JSON object keyed by tracker name, got ", log_kwargs.type_name());
  if (!log_kwargs.empty()) {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    for (const auto& [name, kwargs] : log_kwargs.items()) {
      TORCH_CHECK_VALUE(find_tracker(impl_->log_with, name) != nullptr, "[", api, "] log_kwargs: no tracker named '",
                        name, "' in log_with (", tracker_names(impl_->log_with), ")");
      TORCH_CHECK_VALUE(kwargs.is_object() && kwargs.empty(), "[", api, "] log_kwargs['", name,
                        "']: the trackers take no log options, got ", kwargs.dump());
    }
  }
  if (!is_main_process()) return;
  std::vector<std::shared_ptr<GeneralTracker>> trackers;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    trackers = impl_->trackers;
  }
  for (const auto& tracker : trackers) tracker->log(values, step);
}

std::shared_ptr<GeneralTracker> Accelerator::get_tracker(const std::string& name) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  if (impl_->trackers.empty()) return std::make_shared<BlankTracker>(name, false);
  std::string names;
  for (const auto& tracker : impl_->trackers) {
    if (tracker->name() == name) return tracker;
    names += (names.empty() ? "" : ", ") + tracker->name();
  }
  C10_THROW_ERROR(ValueError, "[Accelerator.get_tracker] '" + name +
                                  "' is not an available tracker stored inside the Accelerator (trackers: " + names +
                                  ")");
}

const std::vector<std::shared_ptr<GeneralTracker>>& Accelerator::trackers() const { return impl_->trackers; }

void Accelerator::end_training() const {
  std::vector<std::shared_ptr<GeneralTracker>> trackers;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    trackers = impl_->trackers;
    impl_->trackers_running = false;
  }
  std::exception_ptr first_error;
  for (const auto& tracker : trackers) {
    try {
      tracker->finish();
    } catch (...) {
      if (!first_error) first_error = std::current_exception();
    }
  }
  wait_for_everyone();
  if (first_error) std::rethrow_exception(first_error);
}

}  // namespace accelerate
