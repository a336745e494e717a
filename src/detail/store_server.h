// The server of the job's rendezvous store: a key-value store on one TCP address, which only
// clients that know the job's secret may use (Note [The job's store] in store_server.cpp). It
// needs no LibTorch; its client is `JobStoreClient` (store_client.h).
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>

namespace accelerate::detail {

/// A failure of the store: a port in use, an address that is not this machine's, a refused
/// secret. The message names what was wrong.
class StoreError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// 32 random hexadecimal digits from the kernel's generator: a fresh secret for one job.
std::string new_job_secret();

/// Whether an address names this machine's loopback interface.
bool is_loopback_address(const std::string& address);

/// The address the store of a job should listen on, given the main process's address: that
/// address itself, except for a job on several machines whose address is a name that resolves
/// here only to loopback (Debian maps its own host name to 127.0.1.1), where the other machines
/// could not reach it: then "" (every interface; the secret still keeps others out).
std::string store_bind_address(const std::string& main_process_address, bool several_machines);

/// What the store lets the clients that know the job's secret hold (Note [What a client may hold]
/// in store_server.cpp). The defaults are far beyond what the library's own use needs.
struct StoreLimits {
  /// Connections past their greeting, at once.
  size_t max_clients = 32768;
  /// Bytes of keys and values kept, each key counted with a fixed overhead more.
  size_t max_stored_bytes = size_t{1} << 30;
  /// Bytes held for unfinished requests, unsent replies and requests that wait for a key, over all
  /// connections.
  size_t max_buffered_bytes = size_t{1} << 30;
  /// How long a connection may hold an unfinished request, or a reply it does not read, without a
  /// byte going either way.
  std::chrono::milliseconds stall_timeout = std::chrono::seconds(10);
};

class StoreServer {
 public:
  /// Listens on `host`:`port` ("" for every interface; port 0 picks a free one) and serves until destroyed, on a thread
  /// of its own. `report` receives a line naming a refused client, then at most one a second
  /// counting those refused since, and a line when the server cannot accept connections for want
  /// of descriptors (Note [Reporting refusals] in store_refusals.cpp); also the clients dropped or
  /// refused at `limits`.
  StoreServer(const std::string& host, int port, std::string secret,
              std::function<void(const std::string&)> report = {}, StoreLimits limits = {});
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  /// The port it listens on.
  int port() const { return port_; }
  /// The address it listens on, as given.
  const std::string& host() const { return host_; }

 private:
  struct State;
  std::unique_ptr<State> state_;
  std::string host_;
  int port_ = 0;
  std::thread thread_;
};

}  // namespace accelerate::detail
