// What the job's store says about the clients it turns away; see store_refusals.h.
#include "detail/store_refusals.h"

#include <algorithm>

namespace accelerate::detail {
namespace {

// Note [Reporting refusals]
// The first refusal after a quiet second is reported at once, naming the peer and why; later
// ones are counted, with their reasons and addresses, and the server's loop reports them
// together once a second has passed since the last line, whether or not another refusal comes.
// A line names at most kNamedAddresses addresses.
constexpr auto kReportInterval = std::chrono::seconds(1);
constexpr size_t kNamedAddresses = 8;
constexpr size_t kCountedAddresses = 1024;
constexpr size_t kStrangerKinds = 6;  // the kinds before kTooManyClients

// How the summary of Note [Reporting refusals] counts a kind: "3 without the job's secret".
const char* counted_as(Refusal kind) {
  switch (kind) {
    case Refusal::kNotTheProtocol: return "not speaking the store's protocol";
    case Refusal::kOtherVersion: return "speaking another version of the store's protocol";
    case Refusal::kWrongSecret: return "without the job's secret (ACCELERATE_RDZV_SECRET)";
    case Refusal::kMalformedGreeting: return "with a malformed greeting";
    case Refusal::kCrowdedOut: return "crowded out by newer connections without a greeting";
    case Refusal::kSilent: return "without a greeting within 10s";
    case Refusal::kTooManyClients: return "turned away at the cap on connections that know the secret";
    case Refusal::kStalled: return "dropped for stalling mid-request or mid-reply";
    case Refusal::kOverBudget: return "dropped for holding the most when the store's buffers were full";
    case Refusal::kTooLarge: return "dropped for requests larger than the store takes";
    case Refusal::kValuesFull: return "requests refused at the cap on the store's keys and values";
  }
  return "refused";
}

}  // namespace

void RefusalReport::refused(const std::string& host, const std::string& peer, Refusal kind, const std::string& why,
                            const char* what) {
  if (!report_) return;
  const auto now = Clock::now();
  if (unreported_ == 0 && now - last_report_ >= kReportInterval) {
    last_report_ = now;
    report_(what + peer + ": " + why);
    return;
  }
  ++unreported_;
  ++unreported_kinds_[static_cast<size_t>(kind)];
  if (unreported_from_.size() < kCountedAddresses && unreported_from_.insert(host).second &&
      unreported_named_.size() < kNamedAddresses) {
    unreported_named_.push_back(host);
  }
  report_counted(now);
}

void RefusalReport::report_counted(Clock::time_point now) {
  if (unreported_ == 0 || now - last_report_ < kReportInterval) return;
  const bool only_strangers = std::all_of(unreported_kinds_.begin() + kStrangerKinds, unreported_kinds_.end(),
                                          [](size_t n) { return n == 0; });
  std::string line = (only_strangers ? "refused " : "refused or dropped ") + std::to_string(unreported_) +
                     " more rendezvous connection" + (unreported_ == 1 ? "" : "s") +
                     (only_strangers ? "" : " or requests") + " since the last report, from ";
  for (size_t i = 0; i < unreported_named_.size(); ++i) line += (i == 0 ? "" : ", ") + unreported_named_[i];
  if (unreported_from_.size() > unreported_named_.size()) {
    line += " and " + std::string(unreported_from_.size() >= kCountedAddresses ? "over " : "") +
            std::to_string(unreported_from_.size() - unreported_named_.size()) + " more addresses";
  }
  const char* separator = ": ";
  for (size_t k = 0; k < kRefusalKinds; ++k) {
    if (unreported_kinds_[k] == 0) continue;
    line += separator + std::to_string(unreported_kinds_[k]) + " " + counted_as(static_cast<Refusal>(k));
    separator = ", ";
  }
  unreported_ = 0;
  unreported_kinds_.fill(0);
  unreported_named_.clear();
  unreported_from_.clear();
  last_report_ = now;
  report_(line);
}

RefusalReport::Clock::time_point RefusalReport::due() const { return last_report_ + kReportInterval; }

}  // namespace accelerate::detail
