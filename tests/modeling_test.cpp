// Model weights on disk: sizes, state-dict order, sharding (huggingface_hub's rules and names),
// save_model's files and index, and load_checkpoint_in_model from a file, an index or a folder
// with its refusals.
#include "accelerate/utils/modeling.h"
#include "detail/files.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <filesystem>

namespace accelerate::testing {
namespace modeling_test {  // not anonymous: its names must not meet another file's in a unity batch

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(ConvertFileSizeToInt, ReadsUpstreamsUnits) {
  EXPECT_EQ(convert_file_size_to_int("1MiB"), 1048576);
  EXPECT_EQ(convert_file_size_to_int("10GB"), 10'000'000'000);
  EXPECT_EQ(convert_file_size_to_int("1.5GiB"), 1610612736);
  EXPECT_EQ(convert_file_size_to_int("512KB"), 512'000);
  EXPECT_EQ(convert_file_size_to_int("2kib"), 2048);
  EXPECT_EQ(convert_file_size_to_int("8Mb"), 1'000'000);  // bits
  EXPECT_EQ(convert_file_size_to_int("12345"), 12345);
}

TEST(ConvertFileSizeToInt, RefusesWhatIsNotASize) {
  for (const char* bad : {"", "GB", "10XB", "-5GB", "1e3GB", "ten MB", "5 GB", "99999999999999999999"}) {
    EXPECT_THROWS_WITH(convert_file_size_to_int(bad), "is not in a valid format") << bad;
  }
}

torch::nn::Sequential small_net() {
  return torch::nn::Sequential(torch::nn::Linear(4, 3), torch::nn::BatchNorm1d(3), torch::nn::Linear(3, 2));
}

TEST(GetStateDict, FollowsPyTorchsOrderWithBuffers) {
  auto net = small_net();
  std::vector<std::string> keys;
  for (const auto& item : get_state_dict(*net)) keys.push_back(item.key());
  EXPECT_THAT(keys, ElementsAre("0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var",
                                "1.num_batches_tracked", "2.weight", "2.bias"));
}

StateDictMap sized(const std::vector<int64_t>& floats) {
  StateDictMap out;
  for (size_t i = 0; i < floats.size(); ++i) out.insert("t" + std::to_string(i), torch::zeros({floats[i]}));
  return out;
}

TEST(SplitStateDictIntoShards, ANonPositiveLimitOrAPatternWithoutItsSuffixIsRefused) {
  EXPECT_THROWS_WITH(split_state_dict_into_shards(sized({2}), 0),
                     "[split_state_dict_into_shards] max_shard_size must be positive, got 0");
  EXPECT_THROWS_WITH(split_state_dict_into_shards(sized({2}), 40, "model.safetensors"),
                     "filename_pattern \"model.safetensors\" must contain {suffix}");
}

TEST(SaveStateDictSharded, AWeightOnTheMetaDeviceIsRefusedBeforeAnythingIsWritten) {
  TempDir dir;
  StateDictMap state = sized({2});
  state.insert("lazy", torch::empty({3}, torch::kMeta));
  EXPECT_THROWS_WITH(save_state_dict_sharded(state, dir.str(), "10GB"),
                     "[save_model] you can't save the model since lazy is on the meta device");
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(SplitStateDictIntoShards, WalksInOrderAndGivesOversizedTensorsTheirOwnShard) {
  // huggingface_hub's example, in units of 4 bytes: [6, 6, 2, 6, 2, 2] with a limit of 10.
  auto split = split_state_dict_into_shards(sized({6, 6, 2, 6, 2, 2}), 40);
  ASSERT_EQ(split.filename_to_tensors.size(), 3u);
  EXPECT_EQ(split.filename_to_tensors[0].first, "model-00001-of-00003.safetensors");
  EXPECT_THAT(split.filename_to_tensors[0].second, ElementsAre("t0"));
  EXPECT_THAT(split.filename_to_tensors[1].second, ElementsAre("t1", "t2"));
  EXPECT_THAT(split.filename_to_tensors[2].second, ElementsAre("t3", "t4", "t5"));
  EXPECT_EQ(split.filename_to_tensors[2].first, "model-00003-of-00003.safetensors");
  EXPECT_EQ(split.total_size, 96);
  EXPECT_EQ(split.tensor_to_filename.at("t4"), "model-00003-of-00003.safetensors");

  // A tensor over the limit goes to a shard of its own; the current shard stays open.
  auto big = split_state_dict_into_shards(sized({2, 20, 2}), 40);
  ASSERT_EQ(big.filename_to_tensors.size(), 2u);
  EXPECT_THAT(big.filename_to_tensors[0].second, ElementsAre("t1"));
  EXPECT_THAT(big.filename_to_tensors[1].second, ElementsAre("t0", "t2"));

  auto one = split_state_dict_into_shards(sized({2, 2}), 40);
  EXPECT_FALSE(one.is_sharded());
  EXPECT_EQ(one.filename_to_tensors[0].first, "model.safetensors");
}

TEST(SaveModel, OneFileWhenItFitsAndShardsWithAnIndexWhenNot) {
  TempDir dir;
  torch::manual_seed(0);
  auto net = small_net();
  save_state_dict_sharded(get_state_dict(*net), dir.str());
  EXPECT_TRUE(fs::is_regular_file(dir.path() / "model.safetensors"));
  EXPECT_FALSE(fs::exists(dir.path() / "model.safetensors.index.json"));
  SafetensorsFile single((dir.path() / "model.safetensors").string());
  EXPECT_EQ(single.metadata().at("format"), "pt");
  EXPECT_EQ(single.keys().size(), 9u);

  // 48 bytes per shard: the 4x3 weight alone is 48 bytes.
  save_state_dict_sharded(get_state_dict(*net), dir.str(), "48");
  EXPECT_FALSE(fs::exists(dir.path() / "model.safetensors"));
  const auto index = nlohmann::json::parse(detail::read_file((dir.path() / "model.safetensors.index.json").string()));
  int64_t total = 0;
  for (const auto& item : get_state_dict(*net)) total += item.value().numel() * item.value().element_size();
  EXPECT_EQ(index.at("metadata").at("total_size").get<int64_t>(), total);
  EXPECT_EQ(index.at("weight_map").size(), 9u);
  const auto shards = index.at("weight_map").at("2.bias").get<std::string>();
  EXPECT_THAT(shards, ::testing::MatchesRegex("model-0000[0-9]-of-0000[0-9]\\.safetensors"));
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(dir.path())) files += e.path().extension() == ".safetensors";
  EXPECT_GT(files, 2u);

  auto copy = small_net();
  auto result = load_checkpoint_in_model(*copy, dir.str(), {.strict = true});
  EXPECT_TRUE(result.missing_keys.empty() && result.unexpected_keys.empty());
  for (const auto& item : get_state_dict(*net)) EXPECT_TRUE(torch::equal(item.value(), get_state_dict(*copy)[item.key()]));

  // Saving again as one file removes the shards and the index of the earlier save.
  save_state_dict_sharded(get_state_dict(*net), dir.str());
  files = 0;
  for (auto it = fs::directory_iterator(dir.path()); it != fs::directory_iterator(); ++it) files += 1;
  EXPECT_EQ(files, 1u);
}

TEST(SaveModel, RefusesAFileAsTheFolder) {
  TempDir dir;
  detail::write_file((dir.path() / "f").string(), "x");
  EXPECT_THROWS_WITH(save_state_dict_sharded(get_state_dict(*small_net()), (dir.path() / "f").string()),
                     "should be a directory, not a file");
}

// A module whose child shares the parent's weight under a second name (tied weights).
struct TiedChild : torch::nn::Module {
  explicit TiedChild(const torch::Tensor& shared) { register_parameter("w", shared); }
};
struct Tied : torch::nn::Module {
  Tied() {
    w = register_parameter("w", torch::randn({3, 3}));
    register_module("child", std::make_shared<TiedChild>(w));
    b = register_parameter("b", torch::randn({3}));
  }
  torch::Tensor w, b;
};

TEST(SaveModel, StoresTiedWeightsOnceAndLoadsThemBack) {
  TempDir dir;
  Tied net;
  std::vector<std::string> keys;
  for (const auto& item : get_state_dict(net)) keys.push_back(item.key());
  EXPECT_THAT(keys, ElementsAre("w", "b", "child.w"));
  save_state_dict_sharded(get_state_dict(net), dir.str());
  SafetensorsFile file((dir.path() / "model.safetensors").string());
  EXPECT_THAT(file.keys(), ElementsAre("b", "w"));

  Tied copy;
  auto result = load_checkpoint_in_model(copy, dir.str(), {.strict = true});
  EXPECT_TRUE(result.missing_keys.empty());
  EXPECT_TRUE(torch::equal(copy.w, net.w));
  EXPECT_TRUE(torch::equal(copy.named_parameters()["child.w"], net.w));
}

TEST(LoadCheckpointInModel, ReadsAFileAnIndexOrAFolder) {
  TempDir dir;
  torch::manual_seed(1);
  auto net = small_net();
  save_state_dict_sharded(get_state_dict(*net), (dir.path() / "one").string());
  save_state_dict_sharded(get_state_dict(*net), (dir.path() / "many").string(), "40");
  for (const auto& path : {dir.path() / "one/model.safetensors", dir.path() / "one",
                           dir.path() / "many/model.safetensors.index.json", dir.path() / "many"}) {
    auto copy = small_net();
    load_checkpoint_in_model(*copy, path.string(), {.strict = true});
    for (const auto& item : get_state_dict(*net)) {
      EXPECT_TRUE(torch::equal(item.value(), get_state_dict(*copy)[item.key()])) << path << " " << item.key();
    }
  }
}

TEST(LoadCheckpointInModel, ReportsMissingAndUnexpectedKeysAndRaisesWhenStrict) {
  TempDir dir;
  const auto file = (dir.path() / "w.safetensors").string();
  save_file({{"0.weight", torch::ones({3, 4})}, {"extra", torch::ones({1})}}, file);
  auto net = small_net();
  const auto before = get_state_dict(*net)["0.bias"].clone();
  EXPECT_THROWS_WITH(load_checkpoint_in_model(*net, file, {.strict = true}),
                     "missing keys [0.bias, 1.bias, 1.num_batches_tracked");
  EXPECT_THROWS_WITH(load_checkpoint_in_model(*net, file, {.strict = true}), "unexpected keys [extra]");
  EXPECT_FALSE(torch::equal(get_state_dict(*net)["0.weight"], torch::ones({3, 4})));  // nothing changed

  auto result = load_checkpoint_in_model(*net, file);
  EXPECT_THAT(result.unexpected_keys, ElementsAre("extra"));
  EXPECT_EQ(result.missing_keys.size(), 8u);
  EXPECT_TRUE(torch::equal(get_state_dict(*net)["0.weight"], torch::ones({3, 4})));
  EXPECT_TRUE(torch::equal(get_state_dict(*net)["0.bias"], before));
}

TEST(LoadCheckpointInModel, RefusesAShapeMismatchBeforeChangingAnything) {
  TempDir dir;
  const auto file = (dir.path() / "w.safetensors").string();
  save_file({{"0.bias", torch::ones({3})}, {"0.weight", torch::ones({4, 4})}}, file);
  auto net = small_net();
  EXPECT_THROWS_WITH(load_checkpoint_in_model(*net, file),
                     "size mismatch for 0.weight in " + file + ": the checkpoint has shape [4, 4], the module has [3, 4]");
  EXPECT_FALSE(torch::equal(get_state_dict(*net)["0.bias"], torch::ones({3})));
}

TEST(LoadCheckpointInModel, ConvertsToTheRequestedDtype) {
  TempDir dir;
  auto net = small_net();
  save_state_dict_sharded(get_state_dict(*net), dir.str());
  auto copy = small_net();
  load_checkpoint_in_model(*copy, dir.str(), {.dtype = at::kBFloat16});
  auto state = get_state_dict(*copy);
  EXPECT_EQ(state["0.weight"].scalar_type(), at::kBFloat16);
  EXPECT_EQ(state["1.num_batches_tracked"].scalar_type(), at::kLong);  // not floating point: unchanged
  EXPECT_TRUE(torch::equal(state["0.weight"], get_state_dict(*net)["0.weight"].to(at::kBFloat16)));
}

TEST(LoadCheckpointInModel, RefusesIndexEntriesOutsideItsFolder) {
  TempDir dir;
  fs::create_directories(dir.path() / "ckpt");
  save_file({{"0.weight", torch::ones({3, 4})}}, (dir.path() / "outside.safetensors").string());
  for (const std::string& target : std::vector<std::string>{
           "../outside.safetensors", (dir.path() / "outside.safetensors").string(), "sub/../../outside.safetensors"}) {
    nlohmann::json index = {{"metadata", {{"total_size", 48}}}, {"weight_map", {{"0.weight", target}}}};
    detail::write_file((dir.path() / "ckpt/model.safetensors.index.json").string(), index.dump());
    auto net = small_net();
    EXPECT_THROWS_WITH(load_checkpoint_in_model(*net, (dir.path() / "ckpt").string()),
                       "which is outside the index's folder") << target;
  }
}

TEST(LoadCheckpointInModel, NamesWhatIsWrongWithTheCheckpointPath) {
  TempDir dir;
  auto net = small_net();
  EXPECT_THROWS_WITH(load_checkpoint_in_model(*net, (dir.path() / "nothing").string()), "does not exist");
  EXPECT_THROWS_WITH(load_checkpoint_in_model(*net, dir.str()),
                     "holds neither pytorch_model.bin nor model.safetensors nor a `.index.json` file");
  detail::write_file((dir.path() / "a.index.json").string(), "{}");
  detail::write_file((dir.path() / "b.index.json").string(), "{}");
  EXPECT_THROWS_WITH(load_checkpoint_in_model(*net, dir.str()), "contains more than one `.index.json` file");
  detail::write_file((dir.path() / "bad.json").string(), "{not json");
  EXPECT_THROWS_WITH(load_checkpoint_in_model(*net, (dir.path() / "bad.json").string()), "is not valid JSON");
  detail::write_file((dir.path() / "list.json").string(), "[1, 2]");
  EXPECT_THROWS_WITH(load_checkpoint_in_model(*net, (dir.path() / "list.json").string()),
                     "should map tensor names to files");
  detail::write_file((dir.path() / "gone.json").string(), R"({"weight_map": {"0.weight": "missing.safetensors"}})");
  EXPECT_THROWS_WITH(load_checkpoint_in_model(*net, (dir.path() / "gone.json").string()),
                     "missing.safetensors does not exist");
  TempDir pickled;
  detail::write_file((pickled.path() / "pytorch_model.bin").string(), "PK");
  // A pickled file is read as load_state_dict reads it, and refused alike.
  EXPECT_THROWS_WITH(load_checkpoint_in_model(*net, pickled.str()), "is not a zip archive written by torch.save");
  EXPECT_THROWS_WITH(load_state_dict((pickled.path() / "pytorch_model.bin").string()),
                     "is not a zip archive written by torch.save");
}

TEST(GetModuleChildrenBottomUp, ChildrenInOrderBeforeTheirParentAndTheModelLast) {
  auto a = std::make_shared<torch::nn::Module>();
  auto a1 = a->register_module("a1", torch::nn::Linear(2, 2));
  auto a2 = a->register_module("a2", torch::nn::Linear(2, 2));
  auto b = std::make_shared<torch::nn::Module>();
  auto b1 = b->register_module("b1", torch::nn::Linear(2, 2));
  auto root = std::make_shared<torch::nn::Module>();
  root->register_module("A", a);
  root->register_module("B", b);
  root->register_module("shared", a1);  // a module under two parents appears under each
  const auto named = get_named_module_children_bottom_up(root);
  std::vector<std::string> names;
  for (const auto& [name, module] : named) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"A.a1", "A.a2", "A", "B.b1", "B", "shared", ""}));
  const auto modules = get_module_children_bottom_up(root);
  ASSERT_EQ(modules.size(), 7u);
  EXPECT_EQ(modules[0].get(), static_cast<torch::nn::Module*>(a1.get()));
  EXPECT_EQ(modules[2].get(), a.get());
  EXPECT_EQ(modules[5].get(), static_cast<torch::nn::Module*>(a1.get()));
  EXPECT_EQ(modules.back().get(), root.get());
  EXPECT_THROWS_WITH(get_module_children_bottom_up(nullptr), "expected a module, got null");
}

}  // namespace modeling_test
}  // namespace accelerate::testing
