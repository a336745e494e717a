// Tracker helpers shared by src/tracking.cpp and the Accelerator; `api` starts error messages.
#pragma once

#include "accelerate/tracking.h"

#include <memory>
#include <string>
#include <vector>

namespace accelerate::detail {

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
