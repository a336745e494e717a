// The wire format of the job's rendezvous store (Note [The job's store] in store_server.cpp).
// Shared by the server, which needs no LibTorch, and the client, a c10d::Store.
//
// A connection opens with a greeting from the client: the 8 bytes "ACCSTORE", the protocol
// version (u32) and the job's secret (u32 length, bytes). The server answers one byte
// (kGreetingAccepted, kGreetingWrongSecret, kGreetingWrongVersion or kGreetingTooManyClients) and
// closes the connection unless it accepted. Then each request is an operation byte and a list of byte strings, and each
// reply a status byte and a list of byte strings; integers are little-endian, lists are a u32
// count then, per string, a u32 length and its bytes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace accelerate::detail::store_protocol {

inline constexpr char kMagic[8] = {'A', 'C', 'C', 'S', 'T', 'O', 'R', 'E'};
inline constexpr uint32_t kVersion = 1;

inline constexpr uint8_t kGreetingAccepted = 0;
inline constexpr uint8_t kGreetingWrongSecret = 1;
inline constexpr uint8_t kGreetingWrongVersion = 2;
/// The store serves as many connections as it lets in at once (StoreLimits::max_clients).
inline constexpr uint8_t kGreetingTooManyClients = 3;

/// Limits a peer must respect, so that a stray client cannot make the server allocate at will.
inline constexpr uint32_t kMaxSecretBytes = 4096;
inline constexpr uint32_t kMaxStringBytes = 256u << 20;
inline constexpr uint32_t kMaxStrings = 1u << 16;

enum class Op : uint8_t {
  kSet = 1,         ///< key, value
  kGet = 2,         ///< key; answered once the key exists
  kAdd = 3,         ///< key, decimal delta; replies the decimal sum
  kCheck = 4,       ///< keys; replies "1" when every key exists, else "0"
  kWait = 5,        ///< keys; answered once every key exists
  kCompareSet = 6,  ///< key, expected, desired; replies the value the key then holds
  kDelete = 7,      ///< key; replies "1" when it existed
  kNumKeys = 8,     ///< replies the decimal number of keys
};

inline constexpr uint8_t kReplyOk = 0;
inline constexpr uint8_t kReplyError = 1;  ///< one string: the reason

inline void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

inline uint32_t get_u32(const char* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

inline void put_strings(std::string& out, const std::vector<std::string>& strings) {
  put_u32(out, static_cast<uint32_t>(strings.size()));
  for (const auto& s : strings) {
    put_u32(out, static_cast<uint32_t>(s.size()));
    out += s;
  }
}

/// Parses a list at `data` (of `size` bytes available). Returns the bytes it took, 0 when more
/// are needed, or -1 when the list breaks the limits.
inline long parse_strings(const char* data, size_t size, std::vector<std::string>& strings) {
  if (size < 4) return 0;
  const uint32_t count = get_u32(data);
  if (count > kMaxStrings) return -1;
  size_t at = 4;
  std::vector<std::string> parsed;
  parsed.reserve(count);
  for (uint32_t i = 0; i < count; ++i) {
    if (size - at < 4) return 0;
    const uint32_t length = get_u32(data + at);
    if (length > kMaxStringBytes) return -1;
    at += 4;
    if (size - at < length) return 0;
    parsed.emplace_back(data + at, length);
    at += length;
  }
  strings = std::move(parsed);
  return static_cast<long>(at);
}

}  // namespace accelerate::detail::store_protocol
