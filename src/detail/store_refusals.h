// What the job's store says about the clients it turns away (Note [Reporting refusals] in
// store_refusals.cpp): the kinds of refusal, and a report that names the first refusal after a
// quiet second at once and counts the others, by kind and address, into one line a second. The
// server (store_server.cpp) decides whom to refuse; this file only words and paces what it says.
// Torch-free, like the server.
#pragma once

#include "detail/durations.h"

#include <array>
#include <chrono>
#include <cstddef>
#include <functional>
#include <string>
#include <unordered_set>
#include <vector>

namespace accelerate::detail {

/// Why the store turned a connection or a request away.
enum class Refusal {
  kNotTheProtocol,
  kOtherVersion,
  kWrongSecret,
  kMalformedGreeting,
  kCrowdedOut,
  kSilent,
  // Clients that know the secret (Note [What a client may hold] in store_server.cpp).
  kTooManyClients,
  kStalled,
  kOverBudget,
  kTooLarge,
  kValuesFull,
};
inline constexpr size_t kRefusalKinds = 11;

/// The store's refusals, reported through a callback at most once a second.
class RefusalReport {
 public:
  using Clock = detail::Clock;

  /// Reports through `report`; an empty one reports nothing.
  explicit RefusalReport(std::function<void(const std::string&)> report) : report_(std::move(report)) {}

  /// Reports a refusal of `peer` ("127.0.0.1:40000", from the address `host`): at once after a
  /// quiet second, `what` (such as "refused a rendezvous connection from ") naming what was
  /// refused and `why` the reason; else counted for the next line.
  void refused(const std::string& host, const std::string& peer, Refusal kind, const std::string& why,
               const char* what);

  /// Reports the refusals counted since the last line, once a second has passed since it.
  void report_counted(Clock::time_point now);

  /// Whether refusals wait to be reported, at `due()`.
  bool counting() const { return unreported_ > 0; }
  Clock::time_point due() const;

 private:
  std::function<void(const std::string&)> report_;
  Clock::time_point last_report_{};
  size_t unreported_ = 0;
  std::array<size_t, kRefusalKinds> unreported_kinds_{};
  std::vector<std::string> unreported_named_;  // the first kNamedAddresses addresses
  std::unordered_set<std::string> unreported_from_;
};

}  // namespace accelerate::detail
