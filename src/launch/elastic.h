// Elastic membership for `accelerate launch --nnodes MIN:MAX --rdzv_backend c10d`: the rounds of
// the rendezvous through which the machines of a job form, lose and regain their group (Note
// [Elastic membership] in elastic.cpp).
#pragma once

#include "accelerate/commands/launch.h"
#include "launch/supervisor.h"

#include <filesystem>
#include <map>
#include <string>

namespace accelerate::commands {

/// Runs an elastic job on this machine until it succeeds, fails past --max_restarts, or is
/// stopped; returns the launcher's exit code. `serves_store`: this machine's launcher serves the
/// rendezvous store at `port` (it has --main_process_ip's address).
int run_elastic(const LaunchPlan& plan, detail::Supervisor& supervisor, const std::map<std::string, std::string>& base,
                const std::filesystem::path& scratch, int port, bool serves_store);

}  // namespace accelerate::commands
