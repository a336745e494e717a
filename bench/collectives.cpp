// W4: allreduce and gather bandwidth over 2+ processes, next to single-process memory copy.
// Run through the launcher: `accelerate launch -n 2 bench_collectives [--quick]`. Rank 0 prints one
// JSON object per (operation, size) on stdout; bench/collectives_twin.py prints the same for
// PyTorch, and bench/run_collectives compares them.
#include <accelerate/accelerate.h>

#include <ATen/ATen.h>

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

namespace acc = accelerate;
using Clock = std::chrono::steady_clock;

namespace {

struct Stats {
  double median_us;
  double mean_us;
};

// Times `fn`; with a state, all processes start each iteration together.
template <typename Fn>
Stats time_it(int iterations, Fn&& fn, const acc::PartialState* state) {
  for (int i = 0; i < 3; ++i) fn();  // warm-up
  std::vector<double> us;
  us.reserve(iterations);
  for (int i = 0; i < iterations; ++i) {
    if (state != nullptr) state->wait_for_everyone();
    const auto start = Clock::now();
    fn();
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
  }
  std::sort(us.begin(), us.end());
  return {us[us.size() / 2], std::accumulate(us.begin(), us.end(), 0.0) / static_cast<double>(us.size())};
}

int iterations_for(int64_t bytes, bool quick) {
  const int base = bytes <= (1 << 16) ? 400 : bytes <= (1 << 20) ? 100 : bytes <= (16 << 20) ? 20 : 8;
  return quick ? std::max(5, base / 4) : base;
}

void report(const acc::PartialState& state, const char* op, int64_t bytes, const Stats& s, double bus_factor) {
  if (!state.is_main_process()) return;
  const double gbps = static_cast<double>(bytes) * bus_factor / (s.median_us * 1e3);
  std::printf("{\"side\": \"%s\", \"op\": \"%s\", \"bytes\": %lld, \"median_us\": %.2f, \"mean_us\": %.2f, "
              "\"busbw_gbps\": %.4f}\n",
              state.backend() == "mpi" ? "cpp-mpi" : "cpp", op, static_cast<long long>(bytes), s.median_us, s.mean_us, gbps);
  std::fflush(stdout);
}

// The machine's own figure: writing 64 MiB into pages the process already has, and into fresh
// ones mapped for the write and unmapped after it (what glibc does with a buffer above its mmap
// threshold). Where the kernel hands freed pages back to a hypervisor, the second is several
// times slower (Note [One pool for the process's large CPU buffers]).
void report_fill_rates() {
  constexpr size_t kBytes = size_t{64} << 20;
  auto fill = [](void* p) { std::memset(p, 1, kBytes); };
  void* kept = ::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (kept == MAP_FAILED) return;
  fill(kept);
  const Stats reused = time_it(8, [&] { fill(kept); }, nullptr);
  ::munmap(kept, kBytes);
  const Stats fresh = time_it(8, [&] {
    void* p = ::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    fill(p);
    ::munmap(p, kBytes);
  }, nullptr);
  for (auto [op, s] : {std::pair{"fill_reused", reused}, std::pair{"fill_fresh", fresh}}) {
    std::printf("{\"side\": \"machine\", \"op\": \"%s\", \"bytes\": %zu, \"median_us\": %.2f, \"gbps\": %.4f}\n", op,
                kBytes, s.median_us, static_cast<double>(kBytes) / (s.median_us * 1e3));
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  acc::PartialState state;
  const double n = state.num_processes();
  if (state.is_main_process()) report_fill_rates();
  for (int64_t bytes : {int64_t{4} << 10, int64_t{64} << 10, int64_t{1} << 20, int64_t{16} << 20, int64_t{64} << 20}) {
    const int64_t numel = bytes / 4;
    auto t = at::ones({numel}, at::kFloat);
    const int iters = iterations_for(bytes, quick);
    if (state.is_main_process()) {
      auto dst = at::empty_like(t);
      report(state, "memcpy", bytes, time_it(iters, [&] { dst.copy_(t); }, nullptr), 1.0);
    }
    report(state, "allreduce", bytes, time_it(iters, [&] { (void)acc::reduce(state, t, "sum"); }, &state),
           2.0 * (n - 1) / n);
    // gather: every process contributes `bytes / n` so the gathered result has `bytes`.
    auto part = at::ones({numel / static_cast<int64_t>(n)}, at::kFloat);
    report(state, "gather", bytes, time_it(iters, [&] { (void)acc::gather(state, part); }, &state), (n - 1) / n);
  }
  return 0;
}
