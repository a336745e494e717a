// Debian's python3-safetensors (Debian 13 and later; this file is compiled where the build found
// it) opens every safetensors file the project writes: save_model's single file, its shards and
// index, merge-weights' output, and save_state's checkpoint files. Its tensors (dtype, shape,
// values) and metadata equal the project's own reading.
#if ACCELERATE_TEST_PYTHON_SAFETENSORS
#include "accelerate/accelerate.h"
#include "accelerate/commands/merge.h"
#include "support/accelerators.h"
#include "support/process.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <filesystem>

namespace accelerate::testing {
namespace python_safetensors_test {  // not anonymous: its names must not meet another file's in a unity batch

namespace fs = std::filesystem;

std::string torch_dtype(c10::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kHalf: return "torch.float16";
    case at::kDouble: return "torch.float64";
    case at::kLong: return "torch.int64";
    case at::kByte: return "torch.uint8";
    default: return "other";
  }
}

// Every safetensors file under `folder` as Python reads it equals the project's reading.
void expect_python_reads_the_same(const fs::path& folder, size_t expected_files) {
  auto r = run({"/usr/bin/python3", built("tests/python/python_safetensors_check.py"), folder.string()}, 120);
  ASSERT_EQ(r->exit_code(), 0) << r->err;
  const auto found = nlohmann::json::parse(r->out);
  size_t files = 0;
  for (const auto& [relative, content] : found.items()) {
    if (!content.contains("tensors")) continue;
    ++files;
    SCOPED_TRACE(relative);
    SafetensorsFile file((folder / relative).string());
    EXPECT_EQ(content["metadata"].is_null() ? SafetensorsMetadata{} : content["metadata"].get<SafetensorsMetadata>(),
              file.metadata());
    ASSERT_EQ(content["tensors"].size(), file.keys().size());
    for (const auto& key : file.keys()) {
      const auto& t = content["tensors"].at(key);
      const auto ours = file.get_tensor(key);
      EXPECT_EQ(t["dtype"], torch_dtype(ours.scalar_type())) << key;
      EXPECT_EQ(t["shape"].get<std::vector<int64_t>>(), ours.sizes().vec()) << key;
      const auto values = ours.to(at::kDouble).flatten().contiguous();
      ASSERT_EQ(t["values"].size(), static_cast<size_t>(values.numel())) << key;
      for (int64_t i = 0; i < values.numel(); ++i) {
        EXPECT_EQ(t["values"][i].get<double>(), values.data_ptr<double>()[i]) << key << "[" << i << "]";
      }
    }
  }
  EXPECT_EQ(files, expected_files);
}

StateDictMap weights() {
  StateDictMap state;
  for (int i = 0; i < 4; ++i) state.insert("layers." + std::to_string(i) + ".weight", torch::randn({8, 8}));
  state.insert("layers.0.bias", torch::randn({8}).to(torch::kBFloat16));
  state.insert("norm.weight", torch::randn({8}).to(torch::kHalf));
  state.insert("steps", torch::tensor({7}, torch::kLong));
  return state;
}

TEST(PythonSafetensors, OpensSaveModelsFileItsShardsAndIndexAndMergeWeightsOutput) {
  TempDir dir;
  const auto state = weights();
  save_state_dict_sharded(state, (dir.path() / "whole").string());
  save_state_dict_sharded(state, (dir.path() / "sharded").string(), "600");
  commands::merge_weights((dir.path() / "sharded").string(), (dir.path() / "merged").string());
  expect_python_reads_the_same(dir.path() / "whole", 1);
  expect_python_reads_the_same(dir.path() / "merged", 1);
  size_t shards = 0;
  for (const auto& e : fs::directory_iterator(dir.path() / "sharded")) shards += e.path().extension() == ".safetensors";
  ASSERT_GT(shards, 1u);
  expect_python_reads_the_same(dir.path() / "sharded", shards);
}

TEST(PythonSafetensors, OpensEveryFileOfACheckpoint) {
  TempDir dir;
  run_accelerators(1, [&](const Accelerator& acc, int) {
    torch::nn::Linear net(3, 2);
    auto adam = std::make_shared<torch::optim::Adam>(net->parameters(), 0.01);
    auto [model, opt] = acc.prepare(net, adam);
    acc.register_for_checkpointing(net);
    opt.zero_grad();
    acc.backward(model(torch::randn({4, 3})).sum());
    opt.step();
    acc.save_state(dir.str() + "/ckpt");
  });
  // model, optimizer, the registered module, the random states
  expect_python_reads_the_same(dir.path() / "ckpt", 4);
}

}  // namespace python_safetensors_test
}  // namespace accelerate::testing
#endif
