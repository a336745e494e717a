// The keys and values of the job's rendezvous store, and the requests of its protocol on them
// (store_protocol.h): what a request answers, or that it waits for a key not written yet, and the
// cap on what keys and values may take (Note [What a client may hold] in store_server.cpp). It
// knows nothing of connections: the server (store_server.cpp) reads the requests, sends the
// replies, names the clients and retries the requests that wait. Torch-free, like the server.
#pragma once

#include "detail/store_protocol.h"

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace accelerate::detail {

/// The answer to one request of the store's protocol.
struct StoreReply {
  uint8_t status = store_protocol::kReplyOk;
  std::vector<std::string> strings;
  /// Why the request was refused at the cap on keys and values, which it would have gone over
  /// (the server words the reply and reports it, naming the client); empty otherwise.
  std::string over_cap;
  /// Whether the request wrote a key, so that requests waiting for keys may be answered now.
  bool wrote = false;
};

/// The store's keys and values, holding at most `max_stored_bytes` of them (each key counted with
/// a fixed overhead more, for what the map spends on it).
class StoreTable {
 public:
  explicit StoreTable(size_t max_stored_bytes) : max_stored_bytes_(max_stored_bytes) {}

  /// Answers `op` on `args` (moving from them) when it can be answered now; nullopt when it waits
  /// for keys that do not exist yet (get, wait), and leaves `args` as they were.
  std::optional<StoreReply> execute(store_protocol::Op op, std::vector<std::string>& args);

 private:
  // Why `key` may not take `value_bytes` within the cap; empty when it may.
  std::string over_cap(const std::string& key, size_t value_bytes) const;
  void put(const std::string& key, std::string value);

  size_t max_stored_bytes_;
  std::unordered_map<std::string, std::string> data_;
  size_t stored_ = 0;  // `data_`'s keys and values, each with kEntryOverhead
};

}  // namespace accelerate::detail
