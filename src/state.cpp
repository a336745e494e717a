// PartialState, AcceleratorState and GradientState; see include/accelerate/state.h.
#include "accelerate/state.h"

#include "accelerate/utils/environment.h"
#include "detail/accelerator_device.h"
#include "detail/blas.h"
#include "detail/buffer_pool.h"
#include "detail/collective_watch.h"
#include "detail/collectives.h"
#include "detail/check.h"
#include "detail/process_group.h"
#include "detail/state_impl.h"
#include "detail/warn.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <exception>
#include <mutex>

namespace accelerate {
namespace {

// InitProcessGroupKwargs::init_method: where the processes meet, as PyTorch's URLs say it.
void apply_init_method(const PartialStateOptions& options, detail::Topology& topo, detail::RendezvousConfig& config) {
  const std::string& url = options.init_kwargs.init_method;
  if (url.empty() || url == "env://") return;
  constexpr const char* kWhere = "[PartialState] InitProcessGroupKwargs.init_method \"";
  TORCH_CHECK_VALUE(url.find('?') == std::string::npos, kWhere, url,
                    "\": a query (rank, world_size) is not taken; the rank and the number of processes come from "
                    "the environment (RANK, WORLD_SIZE) or PartialStateOptions");
  TORCH_CHECK_VALUE(!options.store, kWhere, url, "\" and PartialStateOptions.store both say where to meet; give one");
  if (url.rfind("tcp://", 0) == 0) {
    const std::string rest = url.substr(6);
    const auto colon = rest.rfind(':');
    TORCH_CHECK_VALUE(colon != std::string::npos && colon > 0 && colon + 1 < rest.size(), kWhere, url,
                      "\" must be tcp://<host>:<port>");
    std::string host = rest.substr(0, colon);
    if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
    const std::string port = rest.substr(colon + 1);
    const bool digits = std::all_of(port.begin(), port.end(), [](unsigned char c) { return std::isdigit(c); });
    TORCH_CHECK_VALUE(digits && port.size() <= 5 && std::stoi(port) > 0 && std::stoi(port) < 65536, kWhere, url,
                      "\": the port must be a number from 1 to 65535");
    topo.master_addr = host;
    topo.master_port = std::stoi(port);
    return;
  }
  if (url.rfind("file://", 0) == 0) {
    const std::string path = url.substr(7);
    TORCH_CHECK_VALUE(!path.empty() && path.front() == '/', kWhere, url,
                      "\" must be file:///<absolute path>");
    config.store = c10::make_intrusive<c10d::FileStore>(path, topo.world_size);
    return;
  }
  TORCH_CHECK_VALUE(false, kWhere, url, "\" is not supported; use env://, tcp://<host>:<port> or file:///<path>");
}


std::mutex g_state_mutex;
std::shared_ptr<detail::PartialStateImpl> g_partial;
std::optional<PrecisionType> g_mixed_precision;
std::shared_ptr<detail::GradientStateImpl> g_gradient;

// Note [Error file]
// `accelerate launch` names a file per worker in ACCELERATE_ERROR_FILE. When an exception
// escapes main, the terminate handler writes its message there before aborting, so the
// launcher can report the root cause in one line instead of a tail of interleaved output.
std::terminate_handler g_previous_terminate = nullptr;

void write_error_file_and_abort() {
  if (const char* path = std::getenv("ACCELERATE_ERROR_FILE"); path != nullptr && *path != '\0') {
    std::string message = "terminated without an active exception";
    if (auto current = std::current_exception()) {
      try {
        std::rethrow_exception(current);
      } catch (const std::exception& e) {
        message = detail::error_text(e);
      } catch (...) {
        message = "terminated by an exception that is not a std::exception";
      }
    }
    if (FILE* f = std::fopen(path, "w")) {
      std::fwrite(message.data(), 1, message.size(), f);
      std::fclose(f);
    }
  }
  if (g_previous_terminate != nullptr) g_previous_terminate();
  std::abort();
}

// The process-wide state's processes learn that this one has ended its program (Note [The
// collective watch]) before any static destructor runs: the MPI runtime's would wait for them.
void publish_ended_at_exit() {
  static std::once_flag once;
  std::call_once(once, [] {
    std::atexit([] {
      std::shared_ptr<detail::PartialStateImpl> impl;
      {
        std::lock_guard<std::mutex> lock(g_state_mutex);
        impl = g_partial;
      }
      if (impl && impl->process_group) detail::publish_ended(*impl);
    });
  });
}

void install_error_file_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (std::getenv("ACCELERATE_ERROR_FILE") == nullptr) return;
    g_previous_terminate = std::set_terminate(write_error_file_and_abort);
  });
}

std::chrono::milliseconds seconds_from_env(const char* key, std::chrono::milliseconds fallback) {
  auto value = get_env(key);
  if (!value || value->empty()) return fallback;
  size_t used = 0;
  double parsed = -1;
  try {
    parsed = std::stod(*value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TORCH_CHECK_VALUE(used == value->size() && parsed > 0, "[PartialState] environment variable ", key,
                    " must be a positive number of seconds, got '", *value, "'");
  return std::chrono::milliseconds(static_cast<int64_t>(parsed * 1000));
}

// The collective watch's delay (Note [The collective watch]): ACCELERATE_COLLECTIVE_CHECK_SECONDS,
// 5 s by default; 0 turns the watch off.
std::chrono::milliseconds check_delay_from_env() {
  const auto value = get_env("ACCELERATE_COLLECTIVE_CHECK_SECONDS");
  if (value && *value == "0") return std::chrono::milliseconds(0);
  return seconds_from_env("ACCELERATE_COLLECTIVE_CHECK_SECONDS", std::chrono::seconds(5));
}

std::shared_ptr<detail::PartialStateImpl> build_partial_state(const PartialStateOptions& options) {
  detail::install_host_pool();  // before the process group allocates anything
  install_error_file_handler();
  detail::warn_once_if_reference_blas();  // Note [Reference BLAS warning]
  auto impl = std::make_shared<detail::PartialStateImpl>();
  detail::Topology topo = detail::detect_topology(detail::process_env());
  if (options.num_processes) {
    topo.world_size = *options.num_processes;
    topo.local_world_size = options.local_num_processes.value_or(*options.num_processes);
  } else if (options.local_num_processes) {
    topo.local_world_size = *options.local_num_processes;
  }
  if (options.process_index) {
    topo.rank = *options.process_index;
    topo.local_rank = options.local_process_index.value_or(*options.process_index);
  } else if (options.local_process_index) {
    topo.local_rank = *options.local_process_index;
  }
  if (!options.master_addr.empty()) topo.master_addr = options.master_addr;
  if (options.master_port) topo.master_port = *options.master_port;
  TORCH_CHECK_VALUE(topo.world_size >= 1, "[PartialState] num_processes must be at least 1, got ", topo.world_size);
  TORCH_CHECK_VALUE(topo.rank >= 0 && topo.rank < topo.world_size, "[PartialState] process_index ", topo.rank,
                    " is outside [0, num_processes=", topo.world_size, ")");
  TORCH_CHECK_VALUE(topo.local_world_size >= 1 && topo.local_world_size <= topo.world_size,
                    "[PartialState] local_num_processes ", topo.local_world_size, " must be between 1 and ",
                    topo.world_size);
  TORCH_CHECK_VALUE(topo.local_rank >= 0 && topo.local_rank < topo.local_world_size,
                    "[PartialState] local_process_index ", topo.local_rank, " is outside [0, local_num_processes=",
                    topo.local_world_size, ")");
  impl->topology = topo;

  impl->cpu = options.cpu || parse_flag_from_env("ACCELERATE_USE_CPU");
  if (!impl->cpu) {
    // Note [Accelerators other than CUDA]
    const c10::DeviceType type = detail::accelerator_type();
    if (type != c10::kCPU) {
      impl->device = c10::Device(type, static_cast<c10::DeviceIndex>(topo.local_rank % detail::accelerator_count()));
      detail::set_current_device(impl->device);  // upstream's set_device, part of its __init__
    }
  }
  impl->debug = options.debug.value_or(parse_flag_from_env("ACCELERATE_DEBUG_MODE"));
  impl->timeout = options.init_kwargs.timeout.value_or(std::chrono::minutes(30));
  TORCH_CHECK_VALUE(impl->timeout.count() > 0, "[PartialState] InitProcessGroupKwargs.timeout must be positive");
  impl->check_delay = check_delay_from_env();

  if (topo.world_size > 1) {
    TORCH_CHECK_VALUE(impl->device.is_cpu() || impl->device.is_cuda(), "[PartialState] a job of ", topo.world_size,
                      " processes cannot run on ", impl->device,
                      ": c10d's Gloo and NCCL back-ends take CPU and CUDA tensors only; pass cpu=true (or set "
                      "ACCELERATE_USE_CPU=1) to run it on the CPU");
    impl->distributed_type = impl->device.is_cuda() ? DistributedType::kMultiGpu : DistributedType::kMultiCpu;
    impl->backend = options.init_kwargs.backend;
    if (impl->backend.empty()) impl->backend = get_env("ACCELERATE_BACKEND").value_or("");
    if (impl->backend.empty()) {
      // A CPU job started by mpirun itself uses MPI when this build has it.
      const bool mpi = topo.family == detail::LauncherFamily::kMpi && detail::started_by_mpirun() && is_mpi_available();
      impl->backend = impl->device.is_cuda() ? "nccl" : mpi ? "mpi" : "gloo";
    }
    TORCH_CHECK_VALUE(impl->backend != "mpi" || is_mpi_available(),
                      "[PartialState] the MPI backend is not available in this build of accelerate-cpp; use \"gloo\"");
    if (impl->backend == "mpi") detail::require_started_by_mpirun();
    TORCH_CHECK_VALUE(impl->backend != "nccl" || impl->device.is_cuda(),
                      "[PartialState] backend \"nccl\" needs CUDA devices, but this process runs on ", impl->device,
                      "; use \"gloo\" for CPU processes");

    detail::RendezvousConfig config;
    apply_init_method(options, topo, config);
    config.topology = topo;
    config.backend = impl->backend;
    config.collective_timeout = impl->timeout;
    config.rdzv_timeout = options.rdzv_timeout.value_or(
        seconds_from_env("ACCELERATE_RDZV_TIMEOUT", std::chrono::seconds(900)));
    if (options.store) config.store = options.store->impl()->store;
    // A store the launcher serves is at MASTER_ADDR:MASTER_PORT; an init_method names its own.
    const auto& url = options.init_kwargs.init_method;
    config.store_hosted = !options.store && (url.empty() || url == "env://") && parse_flag_from_env("ACCELERATE_STORE_HOSTED");
    config.secret = get_env("ACCELERATE_RDZV_SECRET").value_or("");
    config.restart_count = get_int_from_env({"TORCHELASTIC_RESTART_COUNT"}, 0);
    auto rdzv = detail::rendezvous(config);
    impl->store = rdzv.store;
    impl->process_group = rdzv.process_group;
    impl->addresses = std::move(rdzv.addresses);
  }
  if (parse_flag_from_env("ACCELERATE_CPU_AFFINITY")) set_numa_affinity(topo.local_rank);
  return impl;
}

}  // namespace

// ---- Store ----------------------------------------------------------------------------------

Store Store::in_memory() {
  auto impl = std::make_shared<detail::StoreImpl>();
  impl->store = c10::make_intrusive<c10d::HashStore>();
  return Store(std::move(impl));
}

Store Store::file(const std::string& path, int num_processes) {
  TORCH_CHECK_VALUE(num_processes >= 1, "[Store::file] num_processes must be at least 1, got ", num_processes);
  auto impl = std::make_shared<detail::StoreImpl>();
  impl->store = c10::make_intrusive<c10d::FileStore>(path, num_processes);
  return Store(std::move(impl));
}

// ---- PartialState ---------------------------------------------------------------------------

PartialState::PartialState() : PartialState(PartialStateOptions{}) {}

PartialState::PartialState(const PartialStateOptions& options) {
  std::lock_guard<std::mutex> lock(g_state_mutex);
  if (g_partial) {
    const auto& topo = g_partial->topology;
    TORCH_CHECK_VALUE(!options.process_index || *options.process_index == topo.rank,
                      "[PartialState] the process-wide state already exists with process_index ", topo.rank,
                      ", got ", *options.process_index, "; call PartialState::reset() first");
    TORCH_CHECK_VALUE(!options.num_processes || *options.num_processes == topo.world_size,
                      "[PartialState] the process-wide state already exists with num_processes ", topo.world_size,
                      ", got ", *options.num_processes, "; call PartialState::reset() first");
    TORCH_CHECK_VALUE(!options.cpu || g_partial->device.is_cpu(),
                      "[PartialState] the process-wide state already exists on ", g_partial->device,
                      ", cpu=true cannot apply; call PartialState::reset() first");
  } else {
    g_partial = build_partial_state(options);
    if (g_partial->process_group) publish_ended_at_exit();
  }
  impl_ = g_partial;
}

PartialState PartialState::standalone(const PartialStateOptions& options) {
  return PartialState(build_partial_state(options));
}

bool PartialState::initialized() {
  std::lock_guard<std::mutex> lock(g_state_mutex);
  return g_partial != nullptr;
}

void PartialState::reset() {
  std::lock_guard<std::mutex> lock(g_state_mutex);
  g_partial.reset();
  g_mixed_precision.reset();
}

DistributedType PartialState::distributed_type() const { return impl_->distributed_type; }
c10::Device PartialState::device() const { return impl_->device; }
std::string PartialState::backend() const { return impl_->backend; }
int PartialState::num_processes() const { return impl_->topology.world_size; }
int PartialState::process_index() const { return impl_->topology.rank; }
int PartialState::local_process_index() const { return impl_->topology.local_rank; }
int PartialState::local_num_processes() const { return impl_->topology.local_world_size; }
bool PartialState::is_main_process() const { return impl_->topology.rank == 0; }
bool PartialState::is_local_main_process() const { return impl_->topology.local_rank == 0; }
bool PartialState::is_last_process() const { return impl_->topology.rank == impl_->topology.world_size - 1; }
bool PartialState::use_distributed() const { return impl_->distributed_type != DistributedType::kNo; }
bool PartialState::debug() const { return impl_->debug; }
std::chrono::milliseconds PartialState::timeout() const { return impl_->timeout; }

namespace {

std::string barrier_failure(const PartialState& state, const char* api, const std::exception& e) {
  return c10::str("[", api, "] process ", state.process_index(), " of ", state.num_processes(),
                  " failed while waiting for the others (a peer died, or did not arrive within ",
                  state.timeout().count() / 1000.0, "s): ", detail::collective_error_text(state, e));
}

}  // namespace

void PartialState::wait_for_everyone() const {
  if (!use_distributed()) return;
  constexpr const char* kApi = "wait_for_everyone";
  // Debug mode checks the barrier like every other collective (Note [Debug-mode collective check]).
  detail::verify_signature(*this, kApi, "barrier", "call the same collective");
  auto pg = detail::process_group(*this, kApi);
  const auto ticket = detail::enter_collective(*this, "barrier", 0);
  detail::watch_wait(*this, ticket, pg->barrier(), kApi, barrier_failure);
}

PartialState::Share PartialState::share_of(int64_t length, bool apply_padding, const char* what) const {
  const int64_t n = num_processes();
  const int64_t idx = process_index();
  const int64_t per_process = length / n;
  const int64_t extras = length % n;
  Share share{};
  share.begin = std::min(length, idx * per_process + std::min(idx, extras));
  share.end = std::min(length, share.begin + per_process + (idx < extras ? 1 : 0));
  share.padded_size = share.end - share.begin;
  if (apply_padding) {
    TORCH_CHECK_INDEX(length > 0, "[split_between_processes] apply_padding repeats the last element, but ", what,
                      " of length 0 has none");
    share.padded_size = per_process + (extras > 0 ? 1 : 0);
  }
  return share;
}

void PartialState::check_same_length(size_t actual, size_t expected) {
  TORCH_CHECK_VALUE(actual == expected,
                    "[split_between_processes] all values in the map must have the same length; found ", expected,
                    " and ", actual);
}

at::Tensor PartialState::split_between_processes(const at::Tensor& inputs, bool apply_padding) const {
  if (num_processes() == 1) return inputs;
  TORCH_CHECK_VALUE(inputs.dim() >= 1, "[split_between_processes] expected a tensor with at least one dimension, "
                                       "got a 0-dim tensor");
  const auto share = share_of(inputs.size(0), apply_padding, "a tensor");
  at::Tensor result = inputs.slice(0, share.begin, share.end);
  const int64_t missing = share.padded_size - (share.end - share.begin);
  if (missing > 0) {
    auto last = inputs.slice(0, inputs.size(0) - 1, inputs.size(0));
    std::vector<int64_t> repeats(inputs.dim(), 1);
    repeats[0] = missing;
    result = at::cat({result, last.repeat(repeats)}, 0);
  }
  return result;
}

void PartialState::set_trigger() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->trigger = true;
}

bool PartialState::check_trigger() const {
  bool mine = false;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    mine = impl_->trigger;
  }
  bool any = mine;
  if (use_distributed()) {
    // Watched like every library collective (Note [The collective watch]).
    const auto flag = detail::all_reduce(*this, at::full({1}, mine ? 1 : 0, at::kInt), detail::Reduction::kMax,
                                         "check_trigger");
    any = flag.item<int>() > 0;
  }
  if (any) {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->trigger = false;
  }
  return any;
}

void PartialState::set_device() const { detail::set_current_device(impl_->device); }

void PartialState::destroy_process_group() const {
  {
    std::lock_guard<std::mutex> lock(impl_->groups_mutex);
    for (auto& [tag, group] : impl_->groups) {
      std::lock_guard<std::mutex> group_lock(group->mutex);
      if (group->process_group) detail::publish_ended(*group);
      group->process_group.reset();
    }
    impl_->groups.clear();
  }
  std::lock_guard<std::mutex> lock(impl_->mutex);
  if (impl_->process_group) detail::publish_ended(*impl_);
  impl_->process_group.reset();
}

namespace detail {

PartialStateImpl::~PartialStateImpl() {
  if (process_group) publish_ended(*this);
}

c10::intrusive_ptr<c10d::ProcessGroup> process_group(const PartialState& state, const char* api) {
  auto& impl = *state.impl();
  std::lock_guard<std::mutex> lock(impl.mutex);
  TORCH_CHECK(state.use_distributed(), "[", api, "] needs several processes, but this job has one");
  TORCH_CHECK(impl.process_group, "[", api, "] the process group was destroyed (destroy_process_group)");
  return impl.process_group;
}

PartialState split_state(const PartialState& state, const std::vector<std::vector<int>>& groups,
                         const std::string& tag) {
  auto& parent = *state.impl();
  const Topology& topo = parent.topology;
  // Note [Groups within groups]
  // A state made by split_state may be split again (the data-parallel processes of one tensor-
  // parallel rank into their shard groups). The groups are named by the job's own ranks, so that
  // the groups made at once by the processes of different parents are told apart: the layout
  // (which names the store's prefix of a Gloo or NCCL group) lists job ranks, and an MPI split,
  // a collective of every process of the job, takes the group's first job rank as its color.
  const bool nested = !parent.world_ranks.empty();
  const Topology& world = nested ? parent.world_topology : topo;
  const auto job_rank = [&](int r) { return nested ? parent.world_ranks[r] : r; };
  std::string layout = tag;
  std::vector<int> seen(topo.world_size, 0);
  int color = -1;
  for (size_t g = 0; g < groups.size(); ++g) {
    layout += g == 0 ? ":" : "|";
    for (size_t i = 0; i < groups[g].size(); ++i) {
      const int r = groups[g][i];
      TORCH_CHECK(r >= 0 && r < topo.world_size && !seen[r]++, "[split_state] ", tag, ": process ", r,
                  " is outside the job or in two groups");
      layout += (i == 0 ? "" : ",") + std::to_string(job_rank(r));
      if (r == topo.rank) color = static_cast<int>(g);
    }
  }
  TORCH_CHECK(color >= 0, "[split_state] ", tag, ": no group holds process ", topo.rank);
  std::lock_guard<std::mutex> lock(parent.groups_mutex);
  if (auto it = parent.groups.find(layout); it != parent.groups.end()) return PartialState::from_impl(it->second);

  const auto own = static_cast<size_t>(color);
  std::vector<int> members;  // job ranks
  for (int r : groups[own]) members.push_back(job_rank(r));
  if (nested) color = *std::min_element(members.begin(), members.end());
  auto impl = std::make_shared<PartialStateImpl>();
  impl->device = parent.device;
  impl->backend = parent.backend;
  impl->cpu = parent.cpu;
  impl->debug = parent.debug;
  impl->timeout = parent.timeout;
  impl->check_delay = parent.check_delay;
  impl->watch_prefix = "watch/group/" + layout + "/";
  impl->store = parent.store;
  impl->world_ranks = members;
  impl->world_topology = world;
  Topology& sub = impl->topology;
  sub = world;
  sub.world_size = static_cast<int>(members.size());
  sub.rank = static_cast<int>(std::find(members.begin(), members.end(), world.rank) - members.begin());
  // The members on this machine (machines hold consecutive ranks, as every launcher numbers them).
  const int machine = world.rank / world.local_world_size;
  sub.local_rank = 0;
  sub.local_world_size = 0;
  for (int r : members) {
    if (r / world.local_world_size != machine) continue;
    if (r < world.rank) ++sub.local_rank;
    ++sub.local_world_size;
  }
  for (int r : groups[own]) {
    if (static_cast<size_t>(r) < parent.addresses.size()) impl->addresses.push_back(parent.addresses[r]);
  }
  if (members.size() > 1) {
    TORCH_CHECK(parent.process_group, "[split_state] the process group was destroyed (destroy_process_group)");
    impl->distributed_type = parent.distributed_type;
    impl->process_group = make_subgroup(parent.backend, parent.store, world, members, color,
                                        "group/" + layout + "/" + std::to_string(color), parent.timeout);
  } else if (parent.backend == "mpi" && world.world_size > 1) {
    // MPI's split is a collective of every process, one-process groups included.
    (void)make_subgroup(parent.backend, parent.store, world, members, color, "", parent.timeout);
  }
  parent.groups.emplace(layout, impl);
  return PartialState::from_impl(impl);
}

std::string collective_error_text(const PartialState& state, const std::exception& e) {
  const std::string text = error_text(e);
  return text + name_lost_machines(state.impl()->addresses, text);
}

}  // namespace detail

// ---- AcceleratorState -----------------------------------------------------------------------

namespace {

PrecisionType resolve_precision(const std::string& option) {
  if (!option.empty()) return parse_precision_type(option);
  if (auto env = get_env("ACCELERATE_MIXED_PRECISION"); env && !env->empty()) {
    try {
      return parse_precision_type(*env);
    } catch (const c10::ValueError& e) {
      C10_THROW_ERROR(ValueError, c10::str("[AcceleratorState] environment variable ACCELERATE_MIXED_PRECISION: ",
                        e.what_without_backtrace()));
    }
  }
  return PrecisionType::kNo;
}

// fp16 training needs CUDA (autocast and loss scaling); on the CPU it runs in full precision.
PrecisionType supported_precision(PrecisionType precision, const PartialState& partial) {
  if (precision == PrecisionType::kFp16 && !partial.device().is_cuda()) {
    detail::warn("accelerate.state",
                 c10::str("[AcceleratorState] fp16 mixed precision needs a CUDA device, but this process runs on ",
                          partial.device(), "; mixed precision is disabled (use bf16 on the CPU)"),
                 {.state = partial});
    return PrecisionType::kNo;
  }
  return precision;
}

}  // namespace

AcceleratorState::AcceleratorState() : AcceleratorState(AcceleratorStateOptions{}) {}

AcceleratorState::AcceleratorState(const AcceleratorStateOptions& options)
    : partial_(options.partial), mixed_precision_(PrecisionType::kNo) {
  std::lock_guard<std::mutex> lock(g_state_mutex);
  if (!g_mixed_precision) g_mixed_precision = supported_precision(resolve_precision(options.mixed_precision), partial_);
  mixed_precision_ = *g_mixed_precision;
}

AcceleratorState AcceleratorState::standalone(const AcceleratorStateOptions& options) {
  auto partial = PartialState::standalone(options.partial);
  const auto precision = supported_precision(resolve_precision(options.mixed_precision), partial);
  return AcceleratorState(std::move(partial), precision);
}

void AcceleratorState::reset(bool reset_partial_state) {
  if (reset_partial_state) {
    PartialState::reset();
    return;
  }
  std::lock_guard<std::mutex> lock(g_state_mutex);
  g_mixed_precision.reset();
}

bool AcceleratorState::initialized() {
  std::lock_guard<std::mutex> lock(g_state_mutex);
  return g_mixed_precision.has_value();
}

// ---- GradientState --------------------------------------------------------------------------

namespace {

std::shared_ptr<detail::GradientStateImpl> shared_gradient_state() {
  std::lock_guard<std::mutex> lock(g_state_mutex);
  if (!g_gradient) g_gradient = std::make_shared<detail::GradientStateImpl>();
  return g_gradient;
}

void check_plugin(const GradientAccumulationPlugin& plugin) {
  TORCH_CHECK_VALUE(plugin.num_steps >= 1, "[GradientState] GradientAccumulationPlugin.num_steps must be >= 1, got ",
                    plugin.num_steps);
}

}  // namespace

GradientState::GradientState() : impl_(shared_gradient_state()) {}

GradientState::GradientState(const GradientAccumulationPlugin& plugin) : impl_(shared_gradient_state()) {
  set_plugin(plugin);
}

GradientState GradientState::standalone(const GradientAccumulationPlugin& plugin) {
  check_plugin(plugin);
  auto impl = std::make_shared<detail::GradientStateImpl>();
  impl->plugin = plugin;
  return GradientState(std::move(impl));
}

void GradientState::reset() {
  std::lock_guard<std::mutex> lock(g_state_mutex);
  g_gradient.reset();
}

#define ACCELERATE_GRADIENT_GETTER(type, name, expr) \
  type GradientState::name() const {                 \
    std::lock_guard<std::mutex> lock(impl_->mutex);  \
    return expr;                                     \
  }
ACCELERATE_GRADIENT_GETTER(bool, sync_gradients, impl_->sync_gradients)
ACCELERATE_GRADIENT_GETTER(bool, end_of_dataloader, impl_->end_of_dataloader)
ACCELERATE_GRADIENT_GETTER(int64_t, remainder, impl_->remainder)
ACCELERATE_GRADIENT_GETTER(int, num_steps, impl_->plugin.num_steps)
ACCELERATE_GRADIENT_GETTER(bool, adjust_scheduler, impl_->plugin.adjust_scheduler)
ACCELERATE_GRADIENT_GETTER(bool, sync_with_dataloader, impl_->plugin.sync_with_dataloader)
ACCELERATE_GRADIENT_GETTER(bool, sync_each_batch, impl_->plugin.sync_each_batch)
ACCELERATE_GRADIENT_GETTER(const void*, active_dataloader,
                           impl_->dataloaders.empty() ? nullptr : impl_->dataloaders.back())
ACCELERATE_GRADIENT_GETTER(std::vector<const void*>, dataloader_references, impl_->dataloaders)
ACCELERATE_GRADIENT_GETTER(bool, in_dataloader, !impl_->dataloaders.empty())
ACCELERATE_GRADIENT_GETTER(GradientAccumulationPlugin, plugin, impl_->plugin)
#undef ACCELERATE_GRADIENT_GETTER

void GradientState::set_sync_gradients(bool sync) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->sync_gradients = sync;
}

void GradientState::set_end_of_dataloader(bool end) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->end_of_dataloader = end;
}

void GradientState::set_remainder(int64_t remainder) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->remainder = remainder;
}

void GradientState::add_dataloader(const void* loader) const {
  TORCH_CHECK_VALUE(loader != nullptr, "[GradientState] add_dataloader expects a data loader, got null");
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->end_of_dataloader = false;
  impl_->dataloaders.push_back(loader);
}

void GradientState::remove_dataloader(const void* loader) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  auto it = std::find(impl_->dataloaders.rbegin(), impl_->dataloaders.rend(), loader);
  TORCH_CHECK_VALUE(it != impl_->dataloaders.rend(),
                    "[GradientState] remove_dataloader got a data loader that is not being iterated");
  impl_->dataloaders.erase(std::next(it).base());
  // The outer loader, if any, continues: its end is decided by its own look-ahead.
  impl_->end_of_dataloader = false;
}

void GradientState::set_plugin(const GradientAccumulationPlugin& plugin) const {
  check_plugin(plugin);
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->plugin = plugin;
}

void GradientState::set_step_boundary_callback(std::function<void(const GradientState&)> callback) const {
  auto shared = callback ? std::make_shared<const std::function<void(const GradientState&)>>(std::move(callback))
                         : nullptr;
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->step_boundary = std::move(shared);
}

void GradientState::at_step_boundary() const {
  std::shared_ptr<const std::function<void(const GradientState&)>> callback;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    callback = impl_->step_boundary;
  }
  if (callback) (*callback)(*this);
}

}  // namespace accelerate
