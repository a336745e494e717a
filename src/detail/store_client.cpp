// The client of the job's store; see store_client.h and Note [The job's store].
#include "detail/store_client.h"

#include "detail/store_protocol.h"

#include <c10/util/Exception.h>

namespace accelerate::detail {
namespace {

namespace proto = store_protocol;

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }
std::string string_of(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }

}  // namespace

JobStoreClient::JobStoreClient(std::string host, int port, std::string secret, std::chrono::milliseconds timeout,
                               std::shared_ptr<StoreServer> server)
    : c10d::Store(timeout),
      host_(std::move(host)),
      port_(port),
      secret_(std::move(secret)),
      connect_timeout_(timeout),
      server_(std::move(server)),
      connection_(host_, port_, secret_, connect_timeout_) {}

JobStoreClient::~JobStoreClient() = default;

std::vector<std::string> JobStoreClient::request(store_protocol::Op op, const std::vector<std::string>& args,
                                                 std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mutex_);
  return connection_.request(op, args, timeout);
}

c10::intrusive_ptr<c10d::Store> JobStoreClient::clone() {
  auto copy = c10::make_intrusive<JobStoreClient>(host_, port_, secret_, connect_timeout_, server_);
  copy->setTimeout(getTimeout());
  return copy;
}

void JobStoreClient::set(const std::string& key, const std::vector<uint8_t>& value) {
  request(proto::Op::kSet, {key, string_of(value)}, timeout_);
}

std::vector<uint8_t> JobStoreClient::compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                                const std::vector<uint8_t>& desired) {
  auto r = request(proto::Op::kCompareSet, {key, string_of(expected), string_of(desired)}, timeout_);
  TORCH_CHECK(r.size() == 1, "[rendezvous] the rendezvous store sent a malformed reply");
  return bytes_of(r[0]);
}

std::vector<uint8_t> JobStoreClient::get(const std::string& key) {
  auto r = request(proto::Op::kGet, {key}, timeout_);
  TORCH_CHECK(r.size() == 1, "[rendezvous] the rendezvous store sent a malformed reply");
  return bytes_of(r[0]);
}

int64_t JobStoreClient::add(const std::string& key, int64_t value) {
  auto r = request(proto::Op::kAdd, {key, std::to_string(value)}, timeout_);
  TORCH_CHECK(r.size() == 1, "[rendezvous] the rendezvous store sent a malformed reply");
  return std::stoll(r[0]);
}

bool JobStoreClient::deleteKey(const std::string& key) {
  auto r = request(proto::Op::kDelete, {key}, timeout_);
  return r.size() == 1 && r[0] == "1";
}

bool JobStoreClient::check(const std::vector<std::string>& keys) {
  auto r = request(proto::Op::kCheck, keys, timeout_);
  return r.size() == 1 && r[0] == "1";
}

int64_t JobStoreClient::getNumKeys() {
  auto r = request(proto::Op::kNumKeys, {}, timeout_);
  TORCH_CHECK(r.size() == 1, "[rendezvous] the rendezvous store sent a malformed reply");
  return std::stoll(r[0]);
}

void JobStoreClient::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void JobStoreClient::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  request(proto::Op::kWait, keys, timeout);
}

}  // namespace accelerate::detail
