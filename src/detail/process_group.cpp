// Rendezvous and process groups; see process_group.h.
#include "detail/process_group.h"

#include "build_config.h"
#include "detail/check.h"
#include "detail/durations.h"
#include "detail/network.h"
#include "detail/process_group_mpi.h"
#include "detail/store_client.h"
#include "detail/torch_compat.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#ifdef USE_C10D_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>

namespace accelerate::detail {
namespace {

c10::intrusive_ptr<c10d::Store> connect_job_store(const RendezvousConfig& config) {
  const Topology& topo = config.topology;
  std::shared_ptr<StoreServer> server;
  int port = topo.master_port;
  if (topo.rank == 0 && !config.store_hosted) {
    try {
      server = std::make_shared<StoreServer>(
          store_bind_address(topo.master_addr, topo.local_world_size < topo.world_size), port, config.secret,
          [](const std::string& line) { std::cerr << "[rendezvous] " + line + "\n" << std::flush; });
    } catch (const StoreError& e) {
      C10_THROW_ERROR(Error, e.what());
    }
    port = server->port();
  }
  return c10::make_intrusive<JobStoreClient>(topo.master_addr, port, config.secret, config.rdzv_timeout,
                                             std::move(server));
}

#ifdef USE_C10D_GLOO
// Note [The address Gloo announces]
// Every Gloo process announces one address through the store, and its peers connect to it.
// Gloo's default is the address this machine's host name resolves to, which on many machines
// (Debian's /etc/hosts among them) is a loopback address: peers on other machines then connect
// to themselves and fail with "Connection refused". The address that matters is the one this
// machine reaches the main process from, which every peer reaches too, so without
// GLOO_SOCKET_IFNAME that is the one announced: the kernel's choice of source address for a
// route to MASTER_ADDR (a UDP socket's connect sends nothing).
std::shared_ptr<::gloo::transport::Device> gloo_device(const Topology& topo) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname != nullptr && *ifname != '\0') {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  // On one machine the loopback interface needs no name resolution and never leaves the host.
  if (is_loopback_address(topo.master_addr) || topo.local_world_size == topo.world_size) {
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  }
  return c10d::ProcessGroupGloo::createDeviceForHostname(source_address_towards(topo.master_addr, topo.master_port));
}
#endif

// Every rank adds itself to the counter `key`; the one that completes it releases the others.
// A barrier that does not complete either timed out (`count` is then the count seen at the end,
// -1 when even that could not be read) or failed: the store's error, e.g. a lost connection to a
// store whose process has ended, which is reported as it is and at once. Only a timeout asks the
// store for the count again, since asking a store that is gone would wait for it to come back.
struct BarrierResult {
  bool complete = false;
  int64_t count = 0;
  std::string failure;  // the store's error when it failed before the timeout
};

BarrierResult store_barrier(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key, int world_size,
                            std::chrono::milliseconds timeout) {
  BarrierResult out;
  out.count = store->add(key, 1);
  if (out.count >= world_size) {
    store->set(key + "/complete", std::vector<uint8_t>{1});
    out.complete = true;
    return out;
  }
  const auto start = std::chrono::steady_clock::now();
  try {
    store->wait({key + "/complete"}, timeout);
    out.complete = true;
  } catch (const std::exception& e) {
    // A store may give up a little before the whole timeout (its clock rounds): a failure in its
    // last tenth counts as the timeout.
    if (std::chrono::steady_clock::now() - start < timeout - timeout / 10) {
      out.failure = error_text(e);
      return out;
    }
    try {
      out.count = store->add(key, 0);
    } catch (const std::exception&) {
      out.count = -1;
    }
  }
  return out;
}

void wait_for_all(const c10::intrusive_ptr<c10d::Store>& store, const RendezvousConfig& config) {
  const Topology& topo = config.topology;
  const BarrierResult joined = store_barrier(store, "joined", topo.world_size, config.rdzv_timeout);
  TORCH_CHECK(joined.count <= topo.world_size, "[PartialState] rendezvous saw ", joined.count,
              " processes join a job of ", topo.world_size, ": another job is using the same MASTER_ADDR:MASTER_PORT (",
              topo.master_addr, ":", topo.master_port, ")");
  if (joined.complete) return;
  if (!joined.failure.empty()) {
    C10_THROW_ERROR(Error, c10::str("[PartialState] rendezvous at ", topo.master_addr, ":", topo.master_port,
                                    " failed while process ", topo.rank, " of ", topo.world_size,
                                    " waited for the others: ", joined.failure));
  }
  C10_THROW_ERROR(
      Error, c10::str("[PartialState] rendezvous timed out after ", seconds_text(config.rdzv_timeout), ": only ",
                      joined.count < 0 ? std::string("an unknown number") : std::to_string(joined.count), " of ",
                      topo.world_size, " processes joined at ", topo.master_addr, ":", topo.master_port,
                      " (the others never started, crashed, or point at another address)"));
}

// Note [Every process group is built]
// A Gloo process group is usable on one rank before its peers have finished connecting to it.
// Were a rank to destroy its group (or exit) right away, a peer still in its side of the
// handshake would fail with "Connection closed by peer". So no rank leaves the rendezvous until
// every rank has built its group.
void wait_until_every_group_is_built(const c10::intrusive_ptr<c10d::Store>& store, const RendezvousConfig& config) {
  const BarrierResult built = store_barrier(store, "pg_built", config.topology.world_size, config.rdzv_timeout);
  if (built.complete) return;
  if (!built.failure.empty()) {
    C10_THROW_ERROR(Error, c10::str("[PartialState] process ", config.topology.rank, " of ",
                                    config.topology.world_size,
                                    " built its process group, but the rendezvous store failed while it waited for the "
                                    "others: ", built.failure));
  }
  C10_THROW_ERROR(Error,
                  c10::str("[PartialState] process ", config.topology.rank, " of ", config.topology.world_size,
                           " built its process group, but only ",
                           built.count < 0 ? std::string("an unknown number") : std::to_string(built.count), " of ",
                           config.topology.world_size, " processes did within ", seconds_text(config.rdzv_timeout),
                           " (the others ended, failed, or were still building theirs)"));
}

}  // namespace

Rendezvous rendezvous(const RendezvousConfig& config) {
  const Topology& topo = config.topology;
  c10::intrusive_ptr<c10d::Store> base = config.store ? config.store : connect_job_store(config);
  auto store = c10::make_intrusive<c10d::PrefixStore>("accelerate/attempt" + std::to_string(config.restart_count),
                                                      base);
  store->setTimeout(config.rdzv_timeout);
  wait_for_all(store, config);
  store->setTimeout(config.collective_timeout);

  Rendezvous out;
  out.store = store;
  auto pg_store = c10::make_intrusive<c10d::PrefixStore>("pg", store);
  if (config.backend == "gloo") {
#ifdef USE_C10D_GLOO
    auto options = c10d::ProcessGroupGloo::Options::create(config.collective_timeout);
    options->devices.push_back(gloo_device(topo));
    out.process_group = compat::as_process_group(
        c10::make_intrusive<c10d::ProcessGroupGloo>(pg_store, topo.rank, topo.world_size, options), pg_store, "gloo",
        {c10::kCPU, c10::kCUDA});  // Gloo also serves CUDA tensors (staged through host memory)
#else
    C10_THROW_ERROR(Error, c10::str("[PartialState] this LibTorch was built without Gloo; use backend \"nccl\" or \"mpi\""));
#endif
  } else if (config.backend == "nccl") {
#ifdef USE_C10D_NCCL
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = config.collective_timeout;
    out.process_group = compat::as_process_group(
        c10::make_intrusive<c10d::ProcessGroupNCCL>(pg_store, topo.rank, topo.world_size, options), pg_store, "nccl",
        {c10::kCUDA});
#else
    C10_THROW_ERROR(Error, c10::str("[PartialState] backend \"nccl\" needs a LibTorch built with CUDA and NCCL; this one has none "
                       "(use \"gloo\")"));
#endif
  } else if (config.backend == "mpi") {
    out.process_group = make_mpi_process_group(topo, config.collective_timeout, pg_store);
  } else {
    C10_THROW_ERROR(ValueError, c10::str("[PartialState] unknown process-group backend \"", config.backend,
                      "\"; expected \"gloo\", \"nccl\" or \"mpi\""));
  }
  // Note [Naming the lost machine]
  // When a machine dies, its peers' collectives fail with Gloo's "Connection reset by peer" or
  // "Read error [10.0.0.2]:port": the address, not which processes ran there. So in a job of
  // several machines every process publishes the address the others reach it at (the one Gloo
  // announces; Note [The address Gloo announces]) before the group-built barrier, and reads them
  // all after it, when none can be missing. A failure then names the processes of each address
  // it mentions, without asking anyone (the store may have died with the machine). Jobs of more
  // than kMaxAddressTable processes skip it, since every process reads every address.
  constexpr int kMaxAddressTable = 256;
  const bool several_machines = topo.local_world_size < topo.world_size;
  const bool table = several_machines && topo.world_size <= kMaxAddressTable && config.backend != "mpi";
  if (table) {
    const std::string own = source_address_towards(topo.master_addr, topo.master_port);
    store->set("address/" + std::to_string(topo.rank), std::vector<uint8_t>(own.begin(), own.end()));
  }
  wait_until_every_group_is_built(store, config);
  if (table) {
    out.addresses.reserve(topo.world_size);
    for (int rank = 0; rank < topo.world_size; ++rank) {
      const auto bytes = store->get("address/" + std::to_string(rank));
      out.addresses.emplace_back(bytes.begin(), bytes.end());
    }
  }
  return out;
}

c10::intrusive_ptr<c10d::ProcessGroup> make_subgroup(const std::string& backend,
                                                     const c10::intrusive_ptr<c10d::Store>& store,
                                                     const Topology& topology, const std::vector<int>& ranks,
                                                     int color, const std::string& tag,
                                                     std::chrono::milliseconds timeout) {
  const auto found = std::find(ranks.begin(), ranks.end(), topology.rank);
  TORCH_CHECK(found != ranks.end(), "[process group] process ", topology.rank, " is not one of the group's");
  const int rank = static_cast<int>(found - ranks.begin());
  const int size = static_cast<int>(ranks.size());
  if (backend == "mpi") return make_mpi_subgroup(topology, color, rank, size, timeout);
  auto group_store = c10::make_intrusive<c10d::PrefixStore>(tag, store);
  if (backend == "gloo") {
#ifdef USE_C10D_GLOO
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    options->devices.push_back(gloo_device(topology));
    return compat::as_process_group(c10::make_intrusive<c10d::ProcessGroupGloo>(group_store, rank, size, options),
                                    group_store, "gloo", {c10::kCPU, c10::kCUDA});
#endif
  } else if (backend == "nccl") {
#ifdef USE_C10D_NCCL
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout;
    return compat::as_process_group(c10::make_intrusive<c10d::ProcessGroupNCCL>(group_store, rank, size, options),
                                    group_store, "nccl", {c10::kCUDA});
#endif
  }
  C10_THROW_ERROR(ValueError, c10::str("[process group] cannot make a group of the \"", backend, "\" back-end"));
}

std::string name_lost_machines(const std::vector<std::string>& addresses, const std::string& error) {
  std::string out;
  std::vector<std::string> named;
  for (size_t open = error.find('['); open != std::string::npos; open = error.find('[', open + 1)) {
    const size_t close = error.find(']', open);
    if (close == std::string::npos) break;
    const std::string address = error.substr(open + 1, close - open - 1);
    if (std::find(named.begin(), named.end(), address) != named.end()) continue;
    std::vector<int> ranks;
    for (size_t rank = 0; rank < addresses.size(); ++rank) {
      if (addresses[rank] == address) ranks.push_back(static_cast<int>(rank));
    }
    if (ranks.empty()) continue;
    named.push_back(address);
    std::ostringstream text;
    text << "; " << address << " is the machine of process" << (ranks.size() > 1 ? "es " : " ");
    for (size_t i = 0; i < ranks.size(); ++i) {
      text << (i == 0 ? "" : (i + 1 == ranks.size() ? " and " : ", ")) << ranks[i];
    }
    out += text.str();
  }
  return out;
}

bool started_by_mpirun() {
  // The MPI launcher's process-management server, which MPI_Init contacts: PMIx (Open MPI) or
  // PMI (MPICH's Hydra). Rank variables alone can be set by hand and prove nothing.
  for (const char* name : {"PMIX_NAMESPACE", "PMI_FD", "PMI_PORT"}) {
    const char* value = std::getenv(name);
    if (value != nullptr && *value != '\0') return true;
  }
  return false;
}

void require_started_by_mpirun() {
  // Starting MPI outside an MPI launcher would make this process a job of its own (or hang
  // looking for one), so that case is refused before MPI is touched.
  TORCH_CHECK_VALUE(started_by_mpirun(), "[PartialState] backend \"mpi\" needs the processes to be started by mpirun: "
                    "use `accelerate launch --backend mpi ...` or `mpirun -np N <program>`");
}

#if !ACCELERATE_HAVE_MPI
c10::intrusive_ptr<c10d::ProcessGroup> make_mpi_process_group(const Topology&, std::chrono::milliseconds,
                                                              const c10::intrusive_ptr<c10d::Store>&) {
  C10_THROW_ERROR(ValueError, "[PartialState] the MPI back-end is not available in this build of accelerate-cpp "
                              "(it was built without MPI); use \"gloo\"");
}
c10::intrusive_ptr<c10d::ProcessGroup> make_mpi_subgroup(const Topology&, int, int, int, std::chrono::milliseconds) {
  C10_THROW_ERROR(ValueError, "[process group] the MPI back-end is not available in this build of accelerate-cpp");
}
#endif

}  // namespace accelerate::detail
