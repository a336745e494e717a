// One connection to the job's store (Note [The job's store] in store_server.cpp), torch-free: the
// workers' c10d::Store (store_client.h) and the launchers (Note [A machine that comes back] in
// src/launch/restarts.cpp) both talk through it. Not thread-safe: one request at a time.
#pragma once

#include "detail/store_protocol.h"

#include <chrono>
#include <string>
#include <vector>

namespace accelerate::detail {

class StoreConnection {
 public:
  /// Connects to the store at `host`:`port` with the job's `secret`, retrying for up to
  /// `connect_timeout` while nothing listens there yet. Throws naming the address when it
  /// cannot, and saying so when the store refuses the secret.
  StoreConnection(std::string host, int port, std::string secret, std::chrono::milliseconds connect_timeout);
  ~StoreConnection();
  StoreConnection(const StoreConnection&) = delete;
  StoreConnection& operator=(const StoreConnection&) = delete;

  /// Sends one request and returns the reply's strings; waits at most `timeout` (zero: forever).
  /// A connection lost or timed out is made again for the next request.
  std::vector<std::string> request(store_protocol::Op op, const std::vector<std::string>& args,
                                   std::chrono::milliseconds timeout);

  const std::string& host() const { return host_; }
  int port() const { return port_; }

 private:
  void connect(std::chrono::milliseconds timeout);
  void disconnect();

  std::string host_;
  int port_;
  std::string secret_;
  std::chrono::milliseconds connect_timeout_;
  int fd_ = -1;
};

}  // namespace accelerate::detail
