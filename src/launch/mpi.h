// The MPI back-end of `accelerate launch`: when a job runs on it, checking what it needs, and
// one attempt of a job whose workers mpirun starts (Note [Workers under mpirun] in mpi.cpp).
#pragma once

#include "accelerate/commands/launch.h"
#include "launch/supervisor.h"

#include <filesystem>
#include <map>
#include <string>

namespace accelerate::detail::launch {

/// Whether a job of `plan` runs on MPI when no back-end was chosen (Note [MPI by default]).
bool mpi_is_the_default(const commands::LaunchPlan& plan);
/// Checks what the MPI back-end needs and finds mpirun (in `plan.mpirun`).
void resolve_mpirun(commands::LaunchPlan& plan);
/// Runs one attempt of an MPI job, its pipes in `scratch`, and says how it ended.
AttemptResult run_mpi_attempt(const commands::LaunchPlan& plan, Supervisor& supervisor,
                    const std::map<std::string, std::string>& base, const std::filesystem::path& scratch, int port,
                    int attempt);

}  // namespace accelerate::detail::launch
