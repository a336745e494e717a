// `default_collate`: samples into one batch, field by field (upstream: torch.utils.data's
// default_collate, as Accelerate's loaders use it).
#include "accelerate/data_loader.h"

#include "detail/check.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <typeinfo>

namespace accelerate {

// ---- collate --------------------------------------------------------------------------------

namespace {

std::string join_keys(const std::map<std::string, c10::IValue>& fields) {
  std::string out = "{";
  const char* sep = "";
  for (const auto& [key, value] : fields) {
    out += sep + key;
    sep = ", ";
  }
  return out + "}";
}

at::Tensor stack_tensors(const std::vector<at::Tensor>& column, const std::string& what) {
  const auto& first = column.front();
  for (size_t i = 1; i < column.size(); ++i) {
    TORCH_CHECK_VALUE(column[i].sizes() == first.sizes(), "[default_collate] cannot stack ", what,
                      ": every sample must have the same shape, but sample 0 has ", first.sizes(), " and sample ", i,
                      " has ", column[i].sizes());
  }
  return at::stack(column);
}

// One collated field: tensors stacked, numbers and booleans as a 1-dim tensor, anything else as
// the list of the samples' values.
c10::IValue collate_field(const std::vector<c10::IValue>& values, const std::string& key) {
  auto all = [&](auto pred) { return std::all_of(values.begin(), values.end(), pred); };
  if (all([](const c10::IValue& v) { return v.isTensor(); })) {
    std::vector<at::Tensor> column;
    column.reserve(values.size());
    for (const auto& v : values) column.push_back(v.toTensor());
    return stack_tensors(column, "field '" + key + "'");
  }
  if (all([](const c10::IValue& v) { return v.isBool(); })) {
    auto out = at::empty({static_cast<int64_t>(values.size())}, at::kBool);
    auto* p = out.data_ptr<bool>();
    for (size_t i = 0; i < values.size(); ++i) p[i] = values[i].toBool();
    return out;
  }
  if (all([](const c10::IValue& v) { return v.isInt(); })) {
    std::vector<int64_t> column;
    for (const auto& v : values) column.push_back(v.toInt());
    return at::tensor(column, at::kLong);
  }
  if (all([](const c10::IValue& v) { return v.isInt() || v.isDouble(); })) {
    std::vector<double> column;
    for (const auto& v : values) column.push_back(v.isInt() ? static_cast<double>(v.toInt()) : v.toDouble());
    return at::tensor(column, at::kDouble);
  }
  const auto type = values.front().type();
  const bool same_type = all([&](const c10::IValue& v) { return *v.type() == *type; });
  c10::impl::GenericList list(same_type ? type : c10::AnyType::get());
  list.reserve(values.size());
  for (const auto& v : values) list.push_back(v);
  return list;
}

}  // namespace

Example default_collate(std::vector<Example> samples) {
  TORCH_CHECK_VALUE(!samples.empty(), "[default_collate] expected at least one sample, got an empty batch");
  const size_t n = samples.size();
  auto tensor_column = [&](at::Tensor Example::*member, const char* name) -> at::Tensor {
    const bool defined = (samples[0].*member).defined();
    std::vector<at::Tensor> column;
    column.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      const at::Tensor& t = samples[i].*member;
      TORCH_CHECK_VALUE(t.defined() == defined, "[default_collate] every sample must have ", name,
                        " or none must: sample 0 ", defined ? "has" : "has none", ", sample ", i,
                        t.defined() ? " has" : " has none");
      if (defined) column.push_back(t);
    }
    return defined ? stack_tensors(column, name) : at::Tensor();
  };
  Example out;
  out.data = tensor_column(&Example::data, "data");
  out.target = tensor_column(&Example::target, "target");
  const auto& first = samples[0].fields;
  for (size_t i = 1; i < n; ++i) {
    const auto& fields = samples[i].fields;
    const bool same =
        fields.size() == first.size() && std::equal(fields.begin(), fields.end(), first.begin(),
                                                    [](const auto& a, const auto& b) { return a.first == b.first; });
    TORCH_CHECK_VALUE(same, "[default_collate] every sample must have the same fields: sample 0 has ", join_keys(first),
                      ", sample ", i, " has ", join_keys(fields));
  }
  for (const auto& [key, unused] : first) {
    std::vector<c10::IValue> values;
    values.reserve(n);
    for (auto& sample : samples) values.push_back(std::move(sample.fields.at(key)));
    out.fields.emplace(key, collate_field(values, key));
  }
  return out;
}

}  // namespace accelerate
