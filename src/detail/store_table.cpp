// The keys and values of the job's store; see store_table.h.
#include "detail/store_table.h"

#include "detail/byte_sizes.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>

namespace accelerate::detail {
namespace {

namespace proto = store_protocol;

// What a key costs beyond its bytes and its value's (Note [What a client may hold] in
// store_server.cpp): a map node with its two strings, malloc's headers, a bucket.
constexpr size_t kEntryOverhead = 128;

size_t entry_bytes(const std::string& key, size_t value_bytes) { return key.size() + value_bytes + kEntryOverhead; }

// A key as a message names it: quoted, its first 64 bytes.
std::string quoted(const std::string& key) {
  return key.size() <= 64 ? "'" + key + "'" : "'" + key.substr(0, 64) + "...'";
}

bool parse_integer(const std::string& text, long long& value) {
  if (text.empty()) return false;
  char* end = nullptr;
  errno = 0;
  value = std::strtoll(text.c_str(), &end, 10);
  return errno == 0 && end == text.c_str() + text.size();
}

StoreReply answered(std::vector<std::string> strings, bool wrote = false) {
  return StoreReply{proto::kReplyOk, std::move(strings), {}, wrote};
}

StoreReply failed(std::string why) { return StoreReply{proto::kReplyError, {std::move(why)}, {}, false}; }

StoreReply over_cap_reply(std::string why) { return StoreReply{proto::kReplyError, {}, std::move(why), false}; }

}  // namespace

std::string StoreTable::over_cap(const std::string& key, size_t value_bytes) const {
  const auto it = data_.find(key);
  const size_t now_held = it == data_.end() ? 0 : entry_bytes(key, it->second.size());
  const size_t after = stored_ - now_held + entry_bytes(key, value_bytes);
  if (after <= max_stored_bytes_) return {};
  return "storing " + quoted(key) + " (" + std::to_string(value_bytes) +
         " bytes) would take the store's keys and values to " + std::to_string(after) + " bytes, over their cap of " +
         bytes_text(max_stored_bytes_) + " (" + std::to_string(data_.size()) + (data_.size() == 1 ? " key" : " keys") +
         " stored)";
}

void StoreTable::put(const std::string& key, std::string value) {
  auto [it, inserted] = data_.try_emplace(key);
  stored_ = stored_ - (inserted ? 0 : entry_bytes(key, it->second.size())) + entry_bytes(key, value.size());
  it->second = std::move(value);
}

std::optional<StoreReply> StoreTable::execute(proto::Op op, std::vector<std::string>& a) {
  const auto takes = [&](size_t n) { return a.size() == n; };
  switch (op) {
    case proto::Op::kSet: {
      if (!takes(2)) return failed("malformed request");
      if (auto why = over_cap(a[0], a[1].size()); !why.empty()) return over_cap_reply(std::move(why));
      put(a[0], std::move(a[1]));
      return answered({}, /*wrote=*/true);
    }
    case proto::Op::kGet: {
      if (!takes(1)) return failed("malformed request");
      auto it = data_.find(a[0]);
      if (it == data_.end()) return std::nullopt;
      return answered({it->second});
    }
    case proto::Op::kAdd: {
      if (!takes(2)) return failed("malformed request");
      long long delta = 0, current = 0;
      auto it = data_.find(a[0]);
      if (!parse_integer(a[1], delta) || (it != data_.end() && !parse_integer(it->second, current))) {
        return failed("add: the key '" + a[0] + "' does not hold an integer");
      }
      current += delta;
      std::string sum = std::to_string(current);
      if (auto why = over_cap(a[0], sum.size()); !why.empty()) return over_cap_reply(std::move(why));
      put(a[0], sum);
      return answered({std::move(sum)}, /*wrote=*/true);
    }
    case proto::Op::kCheck: {
      const bool all = std::all_of(a.begin(), a.end(), [&](const std::string& k) { return data_.count(k) > 0; });
      return answered({all ? "1" : "0"});
    }
    case proto::Op::kWait: {
      const bool all = std::all_of(a.begin(), a.end(), [&](const std::string& k) { return data_.count(k) > 0; });
      if (!all) return std::nullopt;
      return answered({});
    }
    case proto::Op::kCompareSet: {
      if (!takes(3)) return failed("malformed request");
      auto it = data_.find(a[0]);
      bool wrote = false;
      if (it == data_.end()) {
        if (a[1].empty()) {
          if (auto why = over_cap(a[0], a[2].size()); !why.empty()) return over_cap_reply(std::move(why));
          put(a[0], a[2]);
          wrote = true;
        }
        return answered({a[1].empty() ? a[2] : a[1]}, wrote);
      }
      if (it->second == a[1]) {
        if (auto why = over_cap(a[0], a[2].size()); !why.empty()) return over_cap_reply(std::move(why));
        put(a[0], a[2]);
        wrote = true;
      }
      return answered({data_.at(a[0])}, wrote);
    }
    case proto::Op::kDelete: {
      if (!takes(1)) return failed("malformed request");
      const auto it = data_.find(a[0]);
      const bool existed = it != data_.end();
      if (existed) {
        stored_ -= entry_bytes(it->first, it->second.size());
        data_.erase(it);
      }
      return answered({existed ? "1" : "0"});
    }
    case proto::Op::kNumKeys: return answered({std::to_string(data_.size())});
  }
  return failed("unknown operation");
}

}  // namespace accelerate::detail
