// Tracker helpers shared by src/tracking.cpp and the Accelerator; `api` starts error messages.
#pragma once

#include "accelerate/tracking.h"

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace accelerate::detail {

/// A tracker name the library knows (Note [The tracker registry] in tracking.cpp): a built-in
/// tracker, or one of upstream's that is refused by name (`make` empty).
struct TrackerEntry {
  using Make = std::function<std::shared_ptr<GeneralTracker>(const std::string& run_name,
                                                             const std::string& logging_dir,
                                                             const nlohmann::json& init_kwargs)>;
  std::string name;
  std::vector<std::string> init_keys;  // the options its init_kwargs accept
  bool needs_logging_dir = true;       // whether it writes under the project's logging folder
  std::function<void(const nlohmann::json& init_kwargs, const std::string& api)> check;  // beyond the keys
  Make make;
  std::function<bool()> available{};  // whether "all" and available_trackers take it now (null: always)

  bool built_in() const { return static_cast<bool>(make); }
};

/// One image as PNG.
struct TrackerImage {
  int64_t height, width, channels;
  std::string png;
};
/// A `[C, H, W]` tensor, or a `[N, C, H, W]` batch tiled in a grid of up to 8 columns, as PNG
/// (upstream's add_images: floating values scaled by 255 and clipped, grey repeated to RGB).
TrackerImage tracker_image(const std::string& api, const std::string& key, at::Tensor tensor);
/// This machine's name (the TensorBoard event files' and W&B's runs' host).
std::string tracker_hostname();

/// Every tracker name the library knows, built-in ones first, in `available_trackers`' order.
const std::vector<TrackerEntry>& tracker_registry();
/// The entry named `name`, or null.
const TrackerEntry* find_tracker_entry(const std::string& name);

/// `accelerate::filter_trackers` with errors naming `api`.
std::vector<Tracker> filter_trackers(const std::vector<Tracker>& log_with, const std::string& logging_dir,
                                     const std::string& api);
/// Checks the options `kwargs` of the built-in tracker `name` without creating it.
void check_init_kwargs(const std::string& name, const nlohmann::json& kwargs, const std::string& api);
/// `accelerate::make_tracker` with errors naming `api`.
std::shared_ptr<GeneralTracker> make_tracker(const std::string& name, const std::string& run_name,
                                             const std::string& logging_dir, const nlohmann::json& init_kwargs,
                                             const std::string& api);
/// Checks that `values` can be TensorBoard hyperparameters (upstream's add_hparams accepts
/// numbers, booleans, strings and None).
void check_hparams(const nlohmann::json& values, const std::string& api);

}  // namespace accelerate::detail
