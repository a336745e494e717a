// Delivering a pass's batches; see dispatch.h.
#include "data/dispatch.h"

#include "detail/collectives.h"
#include "detail/check.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace accelerate::detail::data {
namespace {

// Reads one batch ahead, to know when the current one is the last.
class LookAheadSource final : public StepSource {
 public:
  explicit LookAheadSource(std::unique_ptr<BatchStream> stream) : stream_(std::move(stream)) {}
  std::optional<Step> next() override {
    if (!primed_) {
      primed_ = true;
      pending_ = stream_->next();
    }
    if (!pending_) return std::nullopt;
    Step step{std::move(*pending_)};
    pending_.reset();
    pending_ = stream_->next();
    step.last = !pending_;
    return step;
  }

 private:
  std::unique_ptr<BatchStream> stream_;
  std::optional<Example> pending_;
  bool primed_ = false;
};

int64_t batch_rows(const Example& batch) {
  if (batch.data.defined() && batch.data.dim() >= 1) return batch.data.size(0);
  if (batch.target.defined() && batch.target.dim() >= 1) return batch.target.size(0);
  for (const auto& [key, value] : batch.fields) {
    if (value.isTensor() && value.toTensor().dim() >= 1) return value.toTensor().size(0);
  }
  for (const auto& [key, value] : batch.fields) {
    if (value.isList()) return static_cast<int64_t>(value.toListRef().size());
  }
  C10_THROW_ERROR(ValueError, c10::str("[DataLoaderDispatcher] cannot tell the batch size: the batch holds no tensor with a first "
                    "dimension and no list"));
}

c10::IValue slice_value(const c10::IValue& value, int64_t start, int64_t end) {
  if (value.isTensor() && value.toTensor().dim() >= 1) return value.toTensor().slice(0, start, end);
  if (value.isList()) {
    auto list = value.toList();
    c10::impl::GenericList out(list.elementType());
    const auto n = static_cast<int64_t>(list.size());
    for (int64_t i = std::min(start, n); i < std::min(end, n); ++i) out.push_back(list.get(static_cast<size_t>(i)));
    return out;
  }
  return value;
}

Example slice_example(const Example& batch, int64_t start, int64_t end) {
  Example out;
  if (batch.data.defined()) out.data = batch.data.slice(0, start, end);
  if (batch.target.defined()) out.target = batch.target.slice(0, start, end);
  for (const auto& [key, value] : batch.fields) out.fields.emplace(key, slice_value(value, start, end));
  return out;
}

Example concatenate_examples(const std::vector<Example>& parts) {
  auto column = [&](at::Tensor Example::*member) -> at::Tensor {
    std::vector<at::Tensor> tensors;
    for (const auto& part : parts) {
      if ((part.*member).defined()) tensors.push_back(part.*member);
    }
    TORCH_CHECK_VALUE(tensors.empty() || tensors.size() == parts.size(),
                      "[DataLoaderDispatcher] every batch must hold the same tensors");
    return tensors.empty() ? at::Tensor() : at::cat(tensors);
  };
  Example out;
  out.data = column(&Example::data);
  out.target = column(&Example::target);
  for (const auto& [key, first] : parts.front().fields) {
    if (first.isTensor()) {
      std::vector<at::Tensor> tensors;
      for (const auto& part : parts) tensors.push_back(part.fields.at(key).toTensor());
      out.fields.emplace(key, at::cat(tensors));
    } else if (first.isList()) {
      c10::impl::GenericList list(first.toList().elementType());
      for (const auto& part : parts) {
        for (const auto& v : part.fields.at(key).toListRef()) list.push_back(v);
      }
      out.fields.emplace(key, list);
    } else {
      out.fields.emplace(key, first);
    }
  }
  return out;
}

// Note [Dispatching]
// The main process reads groups of batches from the unsharded loader (num_processes batches
// concatenated, or one batch with split_batches), one group ahead so it knows which is the last.
// A short last group is completed with the first num_processes samples of the first group, as
// upstream does after broadcasting. Each group travels to the other processes as one pickled
// value (flags, the per-process slice size, the tensors), and every process keeps its slice.
class DispatchSource final : public StepSource {
 public:
  DispatchSource(const DataLoaderImpl& impl, int64_t skip)
      : state_(*impl.state),
        num_processes_(state_.num_processes()),
        process_index_(state_.process_index()),
        group_(impl.split_batches ? 1 : num_processes_),
        drop_last_(impl.drop_last),
        slice_(impl.slice_fn) {
    if (!state_.is_main_process()) return;
    // Skipped groups are passed over without loading, except the first one, whose samples may
    // complete the last group.
    const bool keep_head = skip > 0 && !drop_last_;
    stream_ = open_stream(*impl.base, keep_head ? SkipPlan{group_, (skip - 1) * group_} : SkipPlan{0, skip * group_});
    if (keep_head) {
      if (auto head = next_group()) first_ = slice_example(*head, 0, num_processes_);
    }
  }

  std::optional<Step> next() override { return state_.is_main_process() ? send() : receive(); }

 private:
  std::optional<Example> next_group() {
    std::vector<Example> parts;
    for (int64_t i = 0; i < group_; ++i) {
      auto batch = stream_->next();
      if (!batch) break;
      parts.push_back(std::move(*batch));
    }
    if (parts.empty() || (drop_last_ && static_cast<int64_t>(parts.size()) < group_)) return std::nullopt;
    if (parts.size() == 1) return std::move(parts.front());
    try {
      return concatenate_examples(parts);
    } catch (const std::exception& e) {
      C10_THROW_ERROR(ValueError, c10::str("[DataLoaderDispatcher] cannot concatenate ", parts.size(),
                        " batches into one to "
                        "dispatch: without split_batches, dispatch_batches needs batches of the same shape beyond the "
                        "first dimension (",
                        error_text(e),
                        "); pass split_batches=true to split one batch "
                        "instead, or dispatch_batches=false to let every process read its own batches"));
    }
  }

  std::optional<Step> send() {
    if (!primed_) {
      primed_ = true;
      pending_ = next_group();
    }
    if (!pending_) {
      detail::broadcast_ivalue(state_, c10::ivalue::Tuple::create(std::vector<c10::IValue>{false}), 0,
                               "DataLoaderDispatcher");
      return std::nullopt;
    }
    Example group = std::move(*pending_);
    pending_.reset();
    if (!drop_last_ && !first_) first_ = slice_example(group, 0, num_processes_);
    pending_ = next_group();
    const bool last = !pending_;
    const int64_t observed = batch_rows(group);
    int64_t share = observed / num_processes_;
    if (!drop_last_ && last && observed % num_processes_ != 0) {
      group = concatenate_examples({group, *first_});
      share += 1;
    }
    std::vector<c10::IValue> keys;
    std::vector<c10::IValue> values;
    for (const auto& [key, value] : group.fields) {
      keys.emplace_back(key);
      values.push_back(value);
    }
    std::vector<c10::IValue> items{true, last, share, observed};
    items.push_back(group.data.defined() ? c10::IValue(group.data) : c10::IValue());
    items.push_back(group.target.defined() ? c10::IValue(group.target) : c10::IValue());
    items.push_back(c10::ivalue::Tuple::create(std::move(keys)));
    items.push_back(c10::ivalue::Tuple::create(std::move(values)));
    const auto message = c10::ivalue::Tuple::create(std::move(items));
    detail::broadcast_ivalue(state_, message, 0, "DataLoaderDispatcher");
    return mine(group, share, last, observed);
  }

  std::optional<Step> receive() {
    const auto message = detail::broadcast_ivalue(state_, c10::IValue(), 0, "DataLoaderDispatcher");
    const auto items = message.toTupleRef().elements().vec();
    if (!items[0].toBool()) return std::nullopt;
    Example group;
    if (!items[4].isNone()) group.data = items[4].toTensor();
    if (!items[5].isNone()) group.target = items[5].toTensor();
    const auto keys = items[6].toTupleRef().elements().vec();
    const auto values = items[7].toTupleRef().elements().vec();
    for (size_t i = 0; i < keys.size(); ++i) group.fields.emplace(keys[i].toStringRef(), values[i]);
    return mine(group, items[2].toInt(), items[1].toBool(), items[3].toInt());
  }

  Step mine(const Example& group, int64_t share, bool last, int64_t observed) const {
    const int64_t start = share * process_index_;
    Example batch = slice_ ? slice_(group, start, start + share, process_index_, num_processes_)
                           : slice_example(group, start, start + share);
    return Step{std::move(batch), last, last ? observed : -1};
  }

  PartialState state_;
  int num_processes_;
  int process_index_;
  int64_t group_;
  bool drop_last_;
  SliceFn slice_;
  std::unique_ptr<BatchStream> stream_;
  std::optional<Example> first_;
  std::optional<Example> pending_;
  bool primed_ = false;
};

}  // namespace

std::unique_ptr<StepSource> look_ahead(std::unique_ptr<BatchStream> stream) {
  return std::make_unique<LookAheadSource>(std::move(stream));
}

std::unique_ptr<StepSource> dispatch_from_main(const DataLoaderImpl& impl, int64_t skip) {
  return std::make_unique<DispatchSource>(impl, skip);
}

}  // namespace accelerate::detail::data
