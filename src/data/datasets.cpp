// The datasets the library offers: `TensorDataset` and the datasets made of functions.
#include "accelerate/data_loader.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace accelerate {

// ---- datasets -------------------------------------------------------------------------------

TensorDataset::TensorDataset(at::Tensor data, at::Tensor target) : data_(std::move(data)), target_(std::move(target)) {
  TORCH_CHECK_VALUE(data_.defined() && data_.dim() >= 1,
                    "[TensorDataset] expected a data tensor with a first dimension, got ",
                    data_.defined() ? "a 0-dim tensor" : "an undefined tensor");
  if (target_.defined()) {
    TORCH_CHECK_VALUE(target_.dim() >= 1 && target_.size(0) == data_.size(0),
                      "[TensorDataset] data and target must have the same first dimension, got ", data_.size(0),
                      " and ", target_.dim() >= 1 ? std::to_string(target_.size(0)) : std::string("a 0-dim target"));
  }
}

int64_t TensorDataset::size() const { return data_.size(0); }

Example TensorDataset::get(int64_t index) {
  TORCH_CHECK_INDEX(index >= 0 && index < size(), "[TensorDataset] index ", index, " is outside [0, ", size(), ")");
  return Example{data_.select(0, index), target_.defined() ? target_.select(0, index) : at::Tensor(), {}};
}

std::optional<Example> TensorDataset::get_batch(const std::vector<int64_t>& indices) {
  const auto index = at::tensor(indices, at::kLong);
  return Example{data_.index_select(0, index), target_.defined() ? target_.index_select(0, index) : at::Tensor(), {}};
}

namespace {

class FunctionDataset final : public Dataset {
 public:
  FunctionDataset(int64_t size, std::function<Example(int64_t)> get) : size_(size), get_(std::move(get)) {}
  int64_t size() const override { return size_; }
  Example get(int64_t index) override { return get_(index); }

 private:
  int64_t size_;
  std::function<Example(int64_t)> get_;
};

class FunctionIterableDataset final : public IterableDataset {
 public:
  FunctionIterableDataset(std::function<ExampleGenerator()> iter, std::optional<int64_t> size)
      : iter_(std::move(iter)), size_(size) {}
  ExampleGenerator iter() override { return iter_(); }
  std::optional<int64_t> size() const override { return size_; }

 private:
  std::function<ExampleGenerator()> iter_;
  std::optional<int64_t> size_;
};

}  // namespace

std::shared_ptr<Dataset> make_dataset(int64_t size, std::function<Example(int64_t)> get) {
  TORCH_CHECK_VALUE(size >= 0, "[make_dataset] size must be >= 0, got ", size);
  TORCH_CHECK_VALUE(static_cast<bool>(get), "[make_dataset] expected a function returning sample i, got an empty one");
  return std::make_shared<FunctionDataset>(size, std::move(get));
}

std::shared_ptr<IterableDataset> make_iterable_dataset(std::function<ExampleGenerator()> iter,
                                                       std::optional<int64_t> size) {
  TORCH_CHECK_VALUE(static_cast<bool>(iter),
                    "[make_iterable_dataset] expected a function starting a pass, got an empty one");
  TORCH_CHECK_VALUE(!size || *size >= 0, "[make_iterable_dataset] size must be >= 0, got ", size.value_or(0));
  return std::make_shared<FunctionIterableDataset>(std::move(iter), size);
}

void data_detail::throw_unsized_torch_dataset() {
  C10_THROW_ERROR(ValueError, c10::str("[make_dataset] expected a LibTorch dataset with a known size, got one whose size() is "
                    "empty; read it through an IterableDataset instead"));
  TORCH_INTERNAL_ASSERT(false);
}

}  // namespace accelerate
