// The client of the job's rendezvous store (Note [The job's store] in store_server.cpp): a
// c10d::Store, so that the process groups use it like LibTorch's own stores.
#pragma once

#include "detail/store_connection.h"
#include "detail/store_server.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace accelerate::detail {

class JobStoreClient : public c10d::Store {
 public:
  /// Connects to the store at `host`:`port` with the job's `secret`, retrying for up to `timeout`
  /// while nothing listens there yet. Throws naming the address when it cannot, and saying so when
  /// the store refuses the secret. `server`, when given, is kept alive as long as the client.
  JobStoreClient(std::string host, int port, std::string secret, std::chrono::milliseconds timeout,
                 std::shared_ptr<StoreServer> server = nullptr);
  ~JobStoreClient() override;

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;

  /// A second client of the same store, with its own connection (newer LibTorch releases ask
  /// stores for one, as a pure virtual function: 2.11 does, 2.6 does not). Declared
  /// without `override` on purpose: on releases whose c10d::Store has no clone() it is an
  /// ordinary member, on the others it overrides; so no release test is needed.
  c10::intrusive_ptr<c10d::Store> clone();  // NOLINT(modernize-use-override)

  int port() const { return port_; }

 private:
  // One request on the connection, one thread at a time.
  std::vector<std::string> request(store_protocol::Op op, const std::vector<std::string>& args,
                                   std::chrono::milliseconds timeout);

  std::string host_;
  int port_;
  std::string secret_;
  std::chrono::milliseconds connect_timeout_;
  std::shared_ptr<StoreServer> server_;
  std::mutex mutex_;
  StoreConnection connection_;
};

}  // namespace accelerate::detail
