// Stopping cleanly when the job is asked to stop: `AcceleratorOptions::preemption`,
// `Accelerator::preemption_requested`; see Note [Preemption].
#include "accelerate/accelerator.h"
#include "accelerator_impl.h"
#include "detail/collectives.h"
#include "detail/exit_status.h"
#include "detail/warn.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <mutex>

namespace accelerate {

// Note [Preemption]
// A cluster that takes a job's machines back, or whose time limit comes, first signals the job:
// Slurm sends SIGTERM (then SIGKILL after its KillWait), or with `--signal=USR1@N` SIGUSR1 N
// seconds before the limit; `accelerate launch` passes both on to its workers. With
// `AcceleratorOptions::preemption`, the signals it names no longer end the process: a handler
// records that one came, and nothing else happens in the handler (it may interrupt anything). An
// Accelerator counts only those that came after it was made.
// The processes may learn of it at different times (each machine's launcher is signalled on its
// own; a signal may come between two steps on one process and in the middle of one on another),
// so the question "was the job asked to stop?" is a collective: the largest signal number any
// process recorded, over the whole job. Every process asks at the same points, so all of them
// answer alike and stop after the same step.
// Those points, for `save_on_preemption`, are the step boundaries of the prepared data loaders
// (GradientState::at_step_boundary): before a pass starts, and before each next batch, when the
// batch before it completed an optimizer step (its gradients were synchronised) and gradients are
// enabled (an evaluation under a NoGradGuard is not interrupted), and not inside
// join_uneven_inputs (whose processes see different numbers of batches; save_on_preemption with
// even_batches off is refused for the same reason). There, everything of the
// finished step is done — the optimizer and scheduler stepped, the loop's own bookkeeping after
// them — and the loader has not yet delivered the next batch, so the state that `save_state()`
// writes, the loaders' positions included, resumes into exactly the run that was interrupted.
// When the newest checkpoint, saved or loaded by this Accelerator, already holds this step (no
// step boundary passed with gradients enabled since, on any process), nothing new is saved: a
// stop that comes right after a periodic save, or while `load_state` resumes, would otherwise
// write a copy of it, and `total_limit` would prune an older, distinct checkpoint for that copy.
// After saving, every process ends the trackers, waits for the others, flushes its output and
// ends at once with kPreemptedExitCode, without running static destructors: the data loader's
// workers and the process group's threads may still be running, and unwinding them could turn a
// saved, clean stop into a crash. `accelerate launch` reports workers that end with that status
// as preempted and does not restart them.

static_assert(kPreemptedExitCode == detail::kPreemptedExitStatus);

namespace detail {
namespace {

// The signals that asked the job to stop: how many came, and the latest; and how many of them an
// Accelerator has answered (seen in preemption_requested or at a step boundary). An Accelerator
// counts those after the answered ones when it installed its handlers
// (AcceleratorImpl::preemption_base): one made after an earlier one was asked to stop, in the
// same process, starts unasked, while a signal that came between the two, which no Accelerator
// answered, still asks the new one.
std::atomic<int> g_signal{0};
std::atomic<int> g_signals_seen{0};
std::atomic<int> g_signals_answered{0};
static_assert(std::atomic<int>::is_always_lock_free, "the handler needs lock-free atomics");

extern "C" void record_preemption_signal(int sig) {
  g_signal.store(sig);
  g_signals_seen.fetch_add(1);
}

struct NamedSignal {
  const char* name;
  int number;
};
constexpr NamedSignal kSignals[] = {
    {"SIGTERM", SIGTERM}, {"SIGUSR1", SIGUSR1}, {"SIGUSR2", SIGUSR2}, {"SIGINT", SIGINT}, {"SIGHUP", SIGHUP}};

int signal_of(const std::string& name) {
  const std::string full = name.rfind("SIG", 0) == 0 ? name : "SIG" + name;
  for (const auto& s : kSignals) {
    if (full == s.name) return s.number;
  }
  C10_THROW_ERROR(ValueError, c10::str("[Accelerator] preemption.signals: unknown signal \"", name,
                                       "\"; the signals that can ask a job to stop are SIGTERM, SIGUSR1, SIGUSR2, "
                                       "SIGINT and SIGHUP"));
}

const char* name_of(int sig) {
  for (const auto& s : kSignals) {
    if (sig == s.number) return s.name;
  }
  return "a signal";
}

// The signal any process of `state` recorded since `base` (the largest number), or 0. A collective.
int agreed_signal(const PartialState& state, int base) {
  const int seen = g_signals_seen.load();
  const int mine = seen != base ? g_signal.load() : 0;
  if (mine != 0) {
    int answered = g_signals_answered.load();
    while (answered < seen && !g_signals_answered.compare_exchange_weak(answered, seen)) {
    }
  }
  if (!state.use_distributed()) return mine;
  return all_reduce(state, at::tensor({mine}, at::kInt), Reduction::kMax, "Accelerator::preemption_requested")
      .item<int>();
}

}  // namespace
}  // namespace detail

void Accelerator::install_preemption() const {
  const auto& kwargs = *impl_->options.preemption;
  TORCH_CHECK_VALUE(!kwargs.signals.empty(), "[Accelerator] preemption.signals is empty: name the signals that ask "
                                             "the job to stop (SIGTERM, SIGUSR1, ...)");
  std::vector<int> numbers;
  for (const auto& name : kwargs.signals) numbers.push_back(detail::signal_of(name));
  if (kwargs.save_on_preemption) {
    TORCH_CHECK_VALUE(impl_->options.dataloader_config.even_batches,
                      "[Accelerator] preemption.save_on_preemption asks at every step boundary of the data loaders, "
                      "a collective, so every process must see as many batches: it cannot be used with "
                      "dataloader_config.even_batches false (set save_on_preemption to false and call "
                      "preemption_requested() where every process is)");
    TORCH_CHECK_VALUE(impl_->project.automatic_checkpoint_naming && !impl_->project.project_dir.empty(),
                      "[Accelerator] preemption.save_on_preemption saves into the project's next automatic "
                      "checkpoint: set project_config.automatic_checkpoint_naming and a project_dir (or set "
                      "save_on_preemption to false and call preemption_requested() in the loop)");
  }
  impl_->preemption_base = detail::g_signals_answered.load();
  for (int sig : numbers) {
    struct sigaction action {};
    action.sa_handler = detail::record_preemption_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    TORCH_CHECK(::sigaction(sig, &action, nullptr) == 0, "[Accelerator] cannot handle ", detail::name_of(sig), ": ",
                std::strerror(errno));
  }
  if (!kwargs.save_on_preemption) return;
  if (!impl_->options.dataloader_config.use_stateful_dataloader) {
    detail::warn("accelerate.accelerator",
                 "preemption.save_on_preemption without dataloader_config.use_stateful_dataloader: the checkpoint "
                 "saved on preemption does not hold the data loaders' positions, so the resumed run starts the "
                 "interrupted pass again",
                 {.state = partial()});
  }
  // The callback holds no Accelerator (the gradient state it lives in would then keep the
  // Accelerator alive): it builds one from its parts while they exist.
  std::weak_ptr<detail::AcceleratorImpl> weak = impl_;
  gradient_state_.set_step_boundary_callback([state = state_, weak](const GradientState& gradient_state) {
    auto impl = weak.lock();
    if (!impl) return;
    Accelerator(state, gradient_state, impl).stop_if_preempted();
    if (at::GradMode::is_enabled()) {
      std::lock_guard<std::mutex> lock(impl->mutex);
      ++impl->boundaries_passed;
    }
  });
}

bool Accelerator::preemption_requested() const {
  if (!impl_->options.preemption) return false;
  return detail::agreed_signal(partial(), impl_->preemption_base) != 0;
}

void Accelerator::stop_if_preempted() const {
  if (!at::GradMode::is_enabled() || !gradient_state_.sync_gradients() || impl_->joining.load() > 0) return;
  const int sig = detail::agreed_signal(partial(), impl_->preemption_base);
  if (sig == 0) return;
  detail::warn("accelerate.accelerator",
               c10::str("the job was asked to stop (", detail::name_of(sig), "): every process saves the state at "
                        "this step and ends with exit status ", kPreemptedExitCode),
               {.state = partial()});
  // The newest checkpoint may hold this very step (saved just before, or loaded): then saving
  // again would only add a copy of it, which total_limit would keep instead of an older one.
  std::string saved;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    if (impl_->checkpoint_boundary == impl_->boundaries_passed) saved = impl_->checkpoint_folder;
  }
  int held = !saved.empty() && std::filesystem::is_directory(saved) ? 1 : 0;
  if (partial().use_distributed()) {
    held = detail::all_reduce(partial(), at::tensor({held}, at::kInt), detail::Reduction::kMin,
                              "Accelerator::preemption_requested")
               .item<int>();
  }
  if (held) {
    detail::warn("accelerate.accelerator",
                 "the newest checkpoint, " + saved + ", already holds this step: nothing new is saved; resume with "
                 "load_state()",
                 {.state = partial()});
  } else {
    const std::string folder = save_state();
    detail::warn("accelerate.accelerator", "saved " + folder + "; resume with load_state()", {.state = partial()});
  }
  try {
    end_training();
  } catch (const std::exception& e) {  // a tracker that fails must not keep the others waiting below
    detail::warn("accelerate.accelerator", std::string("ending the trackers failed: ") + e.what(),
                 {.every_process = true, .state = partial()});
  }
  wait_for_everyone();
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  std::_Exit(kPreemptedExitCode);
}

}  // namespace accelerate
