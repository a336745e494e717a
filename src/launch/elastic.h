// The c10d rendezvous of `accelerate launch --rdzv_backend c10d`: machine ranks numbered as the
// launchers join (Note [Machine ranks from the rendezvous] in elastic.cpp), and, with --nnodes
// MIN:MAX, the rounds through which the machines of a job form, lose and regain their group
// (Note [Elastic membership]).
#pragma once

#include "accelerate/commands/launch.h"
#include "launch/supervisor.h"

#include <filesystem>
#include <map>
#include <string>

namespace accelerate::detail::launch {

/// Seconds the launchers wait for each other at their rendezvous: rdzv_conf's join_timeout, else
/// --rdzv_timeout.
double join_timeout(const commands::LaunchPlan& plan);
/// That limit as the launcher's messages name it: "rdzv_conf's join_timeout (5s)", or
/// "--rdzv_timeout (900s)".
std::string join_timeout_text(const commands::LaunchPlan& plan);

/// This machine's rank, numbered at the rendezvous at --main_process_ip:`port` (a launcher that is
/// not machine 0, which serves the store). Throws when it cannot be reached within
/// `join_timeout(plan)`, or when more launchers than --num_machines joined.
int machine_rank_at_rendezvous(const commands::LaunchPlan& plan, int port);

/// Runs an elastic job on this machine until it succeeds, fails past --max_restarts, or is
/// stopped; returns the launcher's exit code. `serves_store`: this machine's launcher serves the
/// rendezvous store at `port` (it has --main_process_ip's address).
int run_elastic(const commands::LaunchPlan& plan, Supervisor& supervisor,
                const std::map<std::string, std::string>& base, const std::filesystem::path& scratch, int port,
                bool serves_store);

}  // namespace accelerate::detail::launch
