// The process's communication counters; see include/accelerate/utils/communication.h and
// Note [Counting the bytes a process sends].
#include "accelerate/utils/communication.h"

#include "detail/collective_watch.h"

namespace accelerate {

CommunicationCounters communication_counters() noexcept {
  const auto totals = detail::communication_totals();
  return {totals.collectives, totals.bytes_sent};
}

}  // namespace accelerate
