// Loading a pass's batches in order, on workers; see workers.h.
#include "data/workers.h"

#include "detail/check.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <thread>

namespace accelerate::detail::data {
namespace {

// Note [Ordered prefetching]
// Workers take tasks in order under one lock (pulling the next batch of indices or samples is
// sequential and cheap), then load and collate outside it. Results are delivered strictly in
// task order; at most num_workers × prefetch_factor tasks run ahead of the consumer. A task's
// error is stored in its place and rethrown when the consumer reaches it.
class OrderedPrefetcher final : public BatchStream {
 public:
  OrderedPrefetcher(TaskSource source, int num_workers, int prefetch_factor)
      : source_(std::move(source)), max_ahead_(static_cast<int64_t>(num_workers) * prefetch_factor) {
    try {
      for (int i = 0; i < num_workers; ++i) workers_.emplace_back([this] { work(); });
    } catch (...) {
      stop();
      throw;
    }
  }
  ~OrderedPrefetcher() override { stop(); }
  OrderedPrefetcher(const OrderedPrefetcher&) = delete;
  OrderedPrefetcher& operator=(const OrderedPrefetcher&) = delete;

  std::optional<Example> next() override {
    if (workers_.empty()) {
      if (exhausted_) return std::nullopt;
      auto task = source_();
      if (!task) {
        exhausted_ = true;
        return std::nullopt;
      }
      return (*task)();
    }
    std::unique_lock<std::mutex> lock(mutex_);
    result_ready_.wait(lock, [&] { return results_.count(delivered_) > 0 || (exhausted_ && delivered_ >= issued_); });
    auto it = results_.find(delivered_);
    if (it == results_.end()) return std::nullopt;
    Result result = std::move(it->second);
    results_.erase(it);
    ++delivered_;
    lock.unlock();
    room_.notify_all();
    if (result.error) std::rethrow_exception(result.error);
    return std::move(result.batch);
  }

 private:
  struct Result {
    Example batch;
    std::exception_ptr error;
  };

  void work() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      room_.wait(lock, [&] { return stop_ || exhausted_ || issued_ < delivered_ + max_ahead_; });
      if (stop_ || exhausted_) return;
      const int64_t seq = issued_;
      std::optional<Task> task;
      std::exception_ptr error;
      try {
        task = source_();
      } catch (...) {
        error = std::current_exception();
      }
      if (!task) {
        exhausted_ = true;
        if (error) {
          results_.emplace(seq, Result{{}, error});
          issued_ = seq + 1;
        }
        result_ready_.notify_all();
        room_.notify_all();
        return;
      }
      issued_ = seq + 1;
      lock.unlock();
      Result result;
      try {
        result.batch = (*task)();
      } catch (...) {
        result.error = std::current_exception();
      }
      task.reset();
      lock.lock();
      results_.emplace(seq, std::move(result));
      result_ready_.notify_all();
    }
  }

  void stop() noexcept {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    room_.notify_all();
    result_ready_.notify_all();
    for (auto& worker : workers_) {
      if (worker.joinable()) worker.join();
    }
  }

  TaskSource source_;
  const int64_t max_ahead_;
  std::mutex mutex_;
  std::condition_variable room_;
  std::condition_variable result_ready_;
  int64_t issued_ = 0;
  int64_t delivered_ = 0;
  bool exhausted_ = false;
  bool stop_ = false;
  std::map<int64_t, Result> results_;
  std::vector<std::thread> workers_;
};

Example load_batch(Dataset& dataset, const std::vector<int64_t>& indices, const CollateFn& collate, bool batched_read) {
  const int64_t size = dataset.size();
  for (const int64_t index : indices) {
    TORCH_CHECK_INDEX(index >= 0 && index < size, "[DataLoader] the sampler yielded index ", index,
                      ", outside the dataset's ", size, " samples [0, ", size, ")");
  }
  if (batched_read && !indices.empty()) {
    std::optional<Example> batch;
    try {
      batch = dataset.get_batch(indices);
    } catch (const std::exception& e) {
      C10_THROW_ERROR(Error, c10::str("[DataLoader] loading a batch of ", indices.size(), " samples from index ",
                  indices.empty() ? -1 : indices.front(), " failed: dataset.get_batch threw: ", error_text(e)));
    }
    if (batch) return std::move(*batch);
  }
  std::vector<Example> samples;
  samples.reserve(indices.size());
  for (const int64_t index : indices) {
    try {
      samples.push_back(dataset.get(index));
    } catch (const std::exception& e) {
      C10_THROW_ERROR(Error, c10::str("[DataLoader] loading sample ", index, " failed: dataset.get(", index,
                  ") threw: ", error_text(e)));
    }
  }
  return collate(std::move(samples));
}

TaskSource map_tasks(std::shared_ptr<Dataset> dataset, IndexBatchGenerator batches, CollateFn collate,
                     bool batched_read, SkipPlan plan) {
  return [dataset = std::move(dataset), batches = std::move(batches), collate = std::move(collate), batched_read, plan,
          emitted = int64_t{0}]() mutable -> std::optional<Task> {
    if (emitted >= plan.keep) {
      for (; plan.skip > 0; --plan.skip) {
        if (!batches()) return std::nullopt;
      }
    }
    auto indices = batches();
    if (!indices) return std::nullopt;
    ++emitted;
    return Task([dataset, collate, batched_read, indices = std::move(*indices)] {
      return load_batch(*dataset, indices, collate, batched_read);
    });
  };
}

TaskSource iterable_tasks(ExampleGenerator samples, int64_t batch_size, bool drop_last, CollateFn collate,
                          SkipPlan plan) {
  return [samples = std::move(samples), batch_size, drop_last, collate = std::move(collate), plan, read = int64_t{0},
          emitted = int64_t{0}]() mutable -> std::optional<Task> {
    auto take = [&]() -> std::optional<std::vector<Example>> {
      std::vector<Example> batch;
      batch.reserve(static_cast<size_t>(batch_size));
      while (static_cast<int64_t>(batch.size()) < batch_size) {
        std::optional<Example> sample;
        try {
          sample = samples();
        } catch (const std::exception& e) {
          C10_THROW_ERROR(Error, c10::str("[DataLoader] reading sample ", read,
                      " of the iterable dataset failed: ", error_text(e)));
        }
        if (!sample) break;
        ++read;
        batch.push_back(std::move(*sample));
      }
      if (batch.empty() || (drop_last && static_cast<int64_t>(batch.size()) < batch_size)) return std::nullopt;
      return batch;
    };
    if (emitted >= plan.keep) {
      for (; plan.skip > 0; --plan.skip) {
        if (!take()) return std::nullopt;
      }
    }
    auto batch = take();
    if (!batch) return std::nullopt;
    ++emitted;
    return Task([collate, batch = std::move(*batch)]() mutable { return collate(std::move(batch)); });
  };
}

}  // namespace

std::unique_ptr<BatchStream> open_stream(const DataLoaderImpl& impl, SkipPlan plan) {
  TaskSource source =
      impl.iterable ? iterable_tasks(impl.iterable->iter(), *impl.batch_size, impl.drop_last, impl.collate, plan)
                    : map_tasks(impl.dataset, impl.batch_sampler->iter(), impl.collate, impl.default_collate, plan);
  return std::make_unique<OrderedPrefetcher>(std::move(source), impl.num_workers, impl.prefetch_factor);
}

}  // namespace accelerate::detail::data
