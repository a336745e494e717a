// Exit statuses the library and the launcher agree on (the launcher reaches no public header,
// which pulls in LibTorch).
#pragma once

namespace accelerate::detail {

/// A worker that saved its state and stopped because the job was asked to (Note [Preemption] in
/// src/preemption.cpp): the public `kPreemptedExitCode`.
inline constexpr int kPreemptedExitStatus = 75;

}  // namespace accelerate::detail
