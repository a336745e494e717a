// The `accelerate merge-weights` command (commands/merge.h).
#include "accelerate/commands/merge.h"

#include "accelerate/utils/modeling.h"
#include "accelerate/utils/safetensors.h"
#include "support/process.h"
#include "support/commands.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <sstream>

namespace accelerate::testing {
namespace merge_test {  // not anonymous: its names must not meet another file's in a unity batch

namespace fs = std::filesystem;
using commands::merge_weights;
using ::testing::HasSubstr;

// Six tensors of 256 bytes (and one of another dtype) cut into shards of at most 600 bytes.
StateDictMap model_state() {
  StateDictMap state;
  for (int i = 0; i < 6; ++i) state.insert("layers." + std::to_string(i) + ".weight", torch::randn({8, 8}));
  state.insert("layers.0.bias", torch::randn({8}).to(torch::kBFloat16));
  state.insert("steps", torch::tensor({7}, torch::kLong));
  return state;
}

// Writes a sharded checkpoint into `folder` and returns the model's tensors.
TensorMap write_sharded(const fs::path& folder) {
  const StateDictMap state = model_state();
  save_state_dict_sharded(state, folder.string(), "600");
  TensorMap tensors;
  for (const auto& item : state) tensors.emplace(item.key(), item.value());
  return tensors;
}

int count_shards(const fs::path& folder) {
  int shards = 0;
  for (const auto& entry : fs::directory_iterator(folder)) {
    shards += entry.path().extension() == ".safetensors" ? 1 : 0;
  }
  return shards;
}

void expect_same_tensors(const TensorMap& merged, const TensorMap& expected) {
  ASSERT_EQ(merged.size(), expected.size());
  for (const auto& [name, tensor] : expected) {
    ASSERT_EQ(merged.count(name), 1u) << name;
    EXPECT_EQ(merged.at(name).scalar_type(), tensor.scalar_type()) << name;
    EXPECT_TRUE(torch::equal(merged.at(name), tensor)) << name;
  }
}

CommandOutcome run_merge(const std::vector<std::string>& args) {
  return run_command(commands::merge_weights_main, args);
}

TEST(MergeWeights, TheMergedFileHoldsEveryTensorOfTheShards) {
  TempDir dir;
  const TensorMap expected = write_sharded(dir.path() / "sharded");
  ASSERT_GE(count_shards(dir.path() / "sharded"), 3);
  auto r = run({accelerate_bin(), "merge-weights", (dir.path() / "sharded").string(), (dir.path() / "out").string()});
  ASSERT_EQ(r->exit_code(), 0) << r->err;
  const std::string merged = (dir.path() / "out" / "model.safetensors").string();
  EXPECT_THAT(r->out, HasSubstr("Merged weights saved to " + merged));
  expect_same_tensors(load_file(merged), expected);
  EXPECT_EQ(SafetensorsFile(merged).metadata(), (SafetensorsMetadata{{"format", "pt"}}));
  EXPECT_EQ(fs::directory_iterator(dir.path() / "out")->path().filename(), "model.safetensors");  // nothing else
  EXPECT_TRUE(fs::exists(dir.path() / "sharded" / "model.safetensors.index.json"));               // the input stays
}

TEST(MergeWeights, AModuleLoadsTheMergedFileLikeTheShards) {
  TempDir dir;
  torch::nn::Sequential saved(torch::nn::Linear(8, 8), torch::nn::Linear(8, 8), torch::nn::Linear(8, 4));
  save_state_dict_sharded(get_state_dict(*saved), (dir.path() / "sharded").string(), "300");
  ASSERT_GE(count_shards(dir.path() / "sharded"), 2);
  merge_weights((dir.path() / "sharded").string(), (dir.path() / "out").string());
  torch::nn::Sequential loaded(torch::nn::Linear(8, 8), torch::nn::Linear(8, 8), torch::nn::Linear(8, 4));
  const auto result = load_checkpoint_in_model(*loaded, (dir.path() / "out").string(), {.strict = true});
  EXPECT_TRUE(result.missing_keys.empty());
  const auto expected = get_state_dict(*saved);
  for (const auto& item : get_state_dict(*loaded)) {
    EXPECT_TRUE(torch::equal(item.value(), expected[item.key()])) << item.key();
  }
}

TEST(MergeWeights, RemoveCheckpointDirDeletesTheInputAfterMerging) {
  TempDir dir;
  const TensorMap expected = write_sharded(dir.path() / "sharded");
  const CommandOutcome outcome =
      run_merge({(dir.path() / "sharded").string(), (dir.path() / "out").string(), "--remove_checkpoint_dir"});
  ASSERT_EQ(outcome.code, 0) << outcome.err;
  EXPECT_FALSE(fs::exists(dir.path() / "sharded"));
  expect_same_tensors(load_file((dir.path() / "out" / "model.safetensors").string()), expected);
}

TEST(MergeWeights, AMissingShardIsNamedAndNothingIsWritten) {
  TempDir dir;
  write_sharded(dir.path() / "sharded");
  fs::remove(dir.path() / "sharded" / "model-00002-of-00003.safetensors");
  const CommandOutcome outcome = run_merge({(dir.path() / "sharded").string(), (dir.path() / "out").string()});
  EXPECT_EQ(outcome.code, 1);
  EXPECT_THAT(outcome.err, HasSubstr("lists shards that do not exist: model-00002-of-00003.safetensors"));
  EXPECT_FALSE(fs::exists(dir.path() / "out"));
}

TEST(MergeWeights, AFolderWithoutAnIndexIsNotASharedCheckpoint) {
  TempDir dir;
  write_sharded(dir.path() / "sharded");
  fs::remove(dir.path() / "sharded" / "model.safetensors.index.json");
  EXPECT_THROWS_WITH(merge_weights((dir.path() / "sharded").string(), (dir.path() / "out").string()),
                     "holds no `.index.json` file, so it is not a sharded safetensors checkpoint");
  EXPECT_THROWS_WITH(merge_weights((dir.path() / "nowhere").string(), (dir.path() / "out").string()),
                     "is not a folder");
}

TEST(MergeWeights, TheOutputCannotBeTheInputFolder) {
  TempDir dir;
  write_sharded(dir.path() / "sharded");
  const std::string input = (dir.path() / "sharded").string();
  EXPECT_THROWS_WITH(merge_weights(input, input), "is the checkpoint folder itself");
  EXPECT_THROWS_WITH(merge_weights(input, input + "/./"), "is the checkpoint folder itself");
  EXPECT_THROWS_WITH(merge_weights(input, input + "/merged", {.remove_checkpoint_dir = true}),
                     "which --remove_checkpoint_dir would delete");
  EXPECT_FALSE(fs::exists(dir.path() / "sharded" / "model.safetensors"));
}

TEST(MergeWeights, AnIndexEntryItsShardDoesNotHoldIsAnError) {
  TempDir dir;
  write_sharded(dir.path() / "sharded");
  const fs::path index = dir.path() / "sharded" / "model.safetensors.index.json";
  auto json = nlohmann::json::parse(std::ifstream(index));
  json["weight_map"]["lm_head.weight"] = "model-00001-of-00003.safetensors";
  std::ofstream(index) << json.dump();
  EXPECT_THROWS_WITH(merge_weights((dir.path() / "sharded").string(), (dir.path() / "out").string()),
                     "maps tensor lm_head.weight to model-00001-of-00003.safetensors, which does not hold it");
}

TEST(MergeWeights, ATensorTheIndexDoesNotListIsAnError) {
  TempDir dir;
  write_sharded(dir.path() / "sharded");
  const fs::path index = dir.path() / "sharded" / "model.safetensors.index.json";
  auto json = nlohmann::json::parse(std::ifstream(index));
  json["weight_map"].erase("steps");
  std::ofstream(index) << json.dump();
  EXPECT_THROWS_WITH(merge_weights((dir.path() / "sharded").string(), (dir.path() / "out").string()),
                     "holds tensor steps, which the index");
}

TEST(MergeWeights, ATensorInTwoShardsIsAnError) {
  TempDir dir;
  write_sharded(dir.path() / "sharded");
  // A stray extra shard holding a tensor that another shard holds too.
  save_file({{"layers.0.weight", torch::zeros({8, 8})}}, (dir.path() / "sharded" / "extra.safetensors").string());
  const fs::path index = dir.path() / "sharded" / "model.safetensors.index.json";
  auto json = nlohmann::json::parse(std::ifstream(index));
  json["weight_map"]["extra"] = "extra.safetensors";
  std::ofstream(index) << json.dump();
  EXPECT_THROWS_WITH(merge_weights((dir.path() / "sharded").string(), (dir.path() / "out").string()),
                     "maps tensor layers.0.weight to model-00001-of-00003.safetensors, but it is in extra.safetensors");
}

TEST(MergeWeights, UnsafeSerializationWritesTorchSavesPytorchModelBin) {
  TempDir dir;
  const TensorMap expected = write_sharded(dir.path() / "sharded");
  const CommandOutcome outcome =
      run_merge({(dir.path() / "sharded").string(), (dir.path() / "out").string(), "--unsafe_serialization"});
  ASSERT_EQ(outcome.code, 0) << outcome.err;
  EXPECT_FALSE(fs::exists(dir.path() / "out" / "model.safetensors"));
  expect_same_tensors(load_state_dict((dir.path() / "out" / "pytorch_model.bin").string()), expected);
}

TEST(MergeWeights, HelpExitsZeroAndBadArgumentsExitTwo) {
  auto help = run({accelerate_bin(), "merge-weights", "--help"});
  EXPECT_EQ(help->exit_code(), 0);
  EXPECT_THAT(help->out, HasSubstr("--remove_checkpoint_dir"));
  EXPECT_THAT(help->out, HasSubstr("--unsafe_serialization"));
  EXPECT_THAT(help->out, HasSubstr("checkpoint_directory"));
  EXPECT_THAT(help->out, HasSubstr("output_path"));
  const CommandOutcome unknown = run_merge({"a", "b", "--safe"});
  EXPECT_EQ(unknown.code, 2);
  EXPECT_THAT(unknown.err, HasSubstr("--safe"));
  const CommandOutcome missing = run_merge({"a"});
  EXPECT_EQ(missing.code, 2);
  EXPECT_THAT(missing.err, HasSubstr("output_path"));
}

}  // namespace merge_test
}  // namespace accelerate::testing
