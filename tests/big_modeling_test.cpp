// Big-model inference: sizes, device maps (upstream's oracles from test_modeling_utils), the
// offload folder format, hooks, empty initialisation and dispatch on CPU + disk.
#include "accelerate/big_modeling.h"

#include "checkpoint/python_layout.h"
#include "detail/torch_compat.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <atomic>
#include <filesystem>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <fstream>

namespace acc = accelerate;
namespace fs = std::filesystem;
using acc::testing::TempDir;

namespace {

// Upstream's ModelForTest: 236 bytes (linear1 64, batchnorm 72, linear2 100).
struct ModelForTestImpl : torch::nn::Module {
  ModelForTestImpl() {
    linear1 = register_module("linear1", torch::nn::Linear(3, 4));
    batchnorm = register_module("batchnorm", torch::nn::BatchNorm1d(4));
    linear2 = register_module("linear2", torch::nn::Linear(4, 5));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = acc::forward(linear1, x);
    x = acc::forward(batchnorm, x);
    return acc::forward(linear2, x);
  }
  torch::nn::Linear linear1{nullptr};
  torch::nn::BatchNorm1d batchnorm{nullptr};
  torch::nn::Linear linear2{nullptr};
};
TORCH_MODULE(ModelForTest);

// Ties `owner`'s parameter `leaf` to `tensor` the way a LibTorch module does it: the same tensor
// object registered under a second name.
struct Retie : torch::nn::Module {
  static void tie(torch::nn::Module& owner, const std::string& leaf, const torch::Tensor& tensor) {
    static_cast<Retie&>(owner).parameters_.erase(leaf);
    static_cast<Retie&>(owner).register_parameter(leaf, tensor);
  }
};

acc::DeviceMap map(std::initializer_list<std::pair<const std::string, acc::MapDevice>> entries) { return entries; }

std::string device_map_string(const acc::DeviceMap& m) {
  std::string out;
  for (const auto& [k, v] : m) out += k + ":" + v.str() + " ";
  return out;
}

}  // namespace

TEST(DeviceMap, MapDeviceParsesAndOrdersAsUpstream) {
  EXPECT_EQ(acc::MapDevice("cuda:1"), acc::MapDevice(1));
  EXPECT_TRUE(acc::MapDevice("cpu").is_cpu());
  EXPECT_TRUE(acc::MapDevice(0) < acc::MapDevice(1));
  EXPECT_TRUE(acc::MapDevice(5) < acc::MapDevice("cpu"));
  EXPECT_TRUE(acc::MapDevice("cpu") < acc::MapDevice("disk"));
  EXPECT_THROWS_WITH(acc::MapDevice("tpu"), "device 'tpu' is not recognized");
  EXPECT_THROWS_WITH(acc::MapDevice("disk").device(), "\"disk\" is a storage place");
  EXPECT_EQ(acc::MemorySize("10GiB").bytes, int64_t{10} << 30);
  EXPECT_EQ(acc::MemorySize("200MB").bytes, 200'000'000);
}

TEST(DeviceMap, ComputeModuleSizes) {
  ModelForTest model;
  auto sizes = acc::compute_module_sizes(*model);
  EXPECT_EQ(sizes.at(""), 236);
  EXPECT_EQ(sizes.at("linear1"), 64);
  EXPECT_EQ(sizes.at("linear1.weight"), 48);
  EXPECT_EQ(sizes.at("batchnorm"), 72);
  EXPECT_EQ(sizes.at("linear2"), 100);
  // In half precision floats shrink, the int64 batch counter does not.
  auto half = acc::compute_module_sizes(*model, torch::kHalf);
  EXPECT_EQ(half.at("linear1"), 32);
  EXPECT_EQ(half.at("batchnorm"), 40);
  EXPECT_EQ(half.at(""), 122);
  // A special dtype overrides the default for one tensor.
  auto special = acc::compute_module_sizes(*model, torch::kHalf, {{"linear2.weight", torch::kDouble}});
  EXPECT_EQ(special.at("linear2"), 20 * 8 + 5 * 2);
  EXPECT_EQ(acc::compute_module_sizes(*model, std::nullopt, {}, true).at(""), 4 * 4 + 4 * 4 + 8);
}

TEST(DeviceMap, MaximumSizesAndLargestLayer) {
  ModelForTest model;
  auto sizes = acc::calculate_maximum_sizes(*model);
  EXPECT_EQ(sizes.total_size, 236);
  EXPECT_EQ(sizes.largest_layer_size, 100);
  EXPECT_EQ(sizes.largest_layer_names, std::vector<std::string>{"linear2"});
  torch::nn::Sequential seq{ModelForTest(), ModelForTest()};
  auto whole = acc::calculate_maximum_sizes(*seq, {"ModelForTest"});
  EXPECT_EQ(whole.largest_layer_size, 236);
  EXPECT_EQ(whole.largest_layer_names, (std::vector<std::string>{"0", "1"}));
  EXPECT_EQ(acc::module_class_name(*ModelForTest()), "ModelForTest");
  EXPECT_EQ(acc::module_class_name(*torch::nn::Linear(1, 1)), "Linear");
}

namespace big_modeling_test {  // not anonymous: its names must not meet another file's in a unity batch

// Two 8x8 linear layers (with biases) that must stay on one device together.
struct ResidualBlockImpl : torch::nn::Module {
  ResidualBlockImpl()
      : fc1(register_module("fc1", torch::nn::Linear(8, 8))), fc2(register_module("fc2", torch::nn::Linear(8, 8))) {}
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(ResidualBlock);

// embed (10 -> 6), a residual block, head (6 -> 8), and a tensor of its own.
struct BlockModelImpl : torch::nn::Module {
  BlockModelImpl()
      : embed(register_module("embed", torch::nn::Linear(10, 6))),
        block(register_module("block", ResidualBlock())),
        head(register_module("head", torch::nn::Linear(6, 8))),
        scale(register_parameter("scale", torch::ones({5}))) {}
  torch::nn::Linear embed;
  ResidualBlock block;
  torch::nn::Linear head;
  at::Tensor scale;
};
TORCH_MODULE(BlockModel);

// Bytes of a float32 linear layer, from its shape alone.
constexpr int64_t linear_bytes(int64_t in, int64_t out) { return (in * out + out) * 4; }

TEST(GetMaxLayerSize, FindsTheLargestLayerAndEveryNameOfThatSizeKeepingNoSplitClassesWhole) {
  BlockModel model;
  // Sizes from the shapes: embed 264, block.fc1 and block.fc2 288 each, head 224, scale 20.
  const int64_t total = linear_bytes(10, 6) + 2 * linear_bytes(8, 8) + linear_bytes(6, 8) + 5 * 4;
  const std::map<std::string, int64_t> sizes{{"", total},
                                              {"embed", linear_bytes(10, 6)},
                                              {"block", 2 * linear_bytes(8, 8)},
                                              {"block.fc1", linear_bytes(8, 8)},
                                              {"block.fc2", linear_bytes(8, 8)},
                                              {"head", linear_bytes(6, 8)},
                                              {"scale", 5 * 4}};
  // The library's own sizes agree with the shapes (the walk below reads the map it is given).
  const auto computed = acc::compute_module_sizes(*model);
  for (const auto& [name, size] : sizes) EXPECT_EQ(computed.at(name), size) << name;
  const std::vector<acc::NamedModuleOrTensor> top{{"embed", model->embed.ptr(), at::Tensor()},
                                                  {"block", model->block.ptr(), at::Tensor()},
                                                  {"head", model->head.ptr(), at::Tensor()},
                                                  {"scale", nullptr, model->scale}};

  // The block is opened up: its two layers tie for the largest, in the order of the walk.
  auto [size, names] = acc::get_max_layer_size(top, sizes, {});
  EXPECT_EQ(size, linear_bytes(8, 8));
  EXPECT_EQ(names, (std::vector<std::string>{"block.fc1", "block.fc2"}));
  // Kept whole, the block is the largest layer alone.
  std::tie(size, names) = acc::get_max_layer_size(top, sizes, {"ResidualBlock"});
  EXPECT_EQ(size, 2 * linear_bytes(8, 8));
  EXPECT_EQ(names, std::vector<std::string>{"block"});
  // Without the block, embed is the largest; a direct tensor counts as a layer of its own.
  std::tie(size, names) = acc::get_max_layer_size({top[0], top[2], top[3]}, sizes, {"ResidualBlock"});
  EXPECT_EQ(size, linear_bytes(10, 6));
  EXPECT_EQ(names, std::vector<std::string>{"embed"});
  std::tie(size, names) = acc::get_max_layer_size({top[3]}, sizes, {});
  EXPECT_EQ(size, 20);
  EXPECT_EQ(names, std::vector<std::string>{"scale"});
  // The whole model as one entry is opened up the same way.
  std::tie(size, names) = acc::get_max_layer_size({{"", model.ptr(), at::Tensor()}}, sizes, {"ResidualBlock"});
  EXPECT_EQ(size, 2 * linear_bytes(8, 8));
  EXPECT_EQ(names, std::vector<std::string>{"block"});
}

// Retied names hold one storage: the same address, and a step on one is a step on the other.
void expect_tied(torch::nn::Module& model, const std::string& a, const std::string& b) {
  const auto ta = acc::get_module_tensor(model, a), tb = acc::get_module_tensor(model, b);
  ASSERT_FALSE(ta.is_meta()) << a;
  ASSERT_FALSE(tb.is_meta()) << b;
  EXPECT_EQ(ta.data_ptr(), tb.data_ptr()) << a << " and " << b << " do not share their data";
}

TEST(RetieParameters, NamesWhoseTieWasBrokenShareOneTensorAgainAndTrainingOneTrainsTheOther) {
  torch::manual_seed(0);
  torch::nn::Sequential original(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4));
  Retie::tie(*original[1], "weight", original[0]->as<torch::nn::Linear>()->weight);
  const auto groups = acc::find_tied_parameters(*original);
  ASSERT_EQ(groups, (std::vector<std::vector<std::string>>{{"0.weight", "1.weight"}}));

  // Cloning copies each name's tensor on its own: the tie is gone, as after loading.
  auto model = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(original->clone());
  ASSERT_TRUE(model != nullptr);
  const auto first = model->ptr(0)->as<torch::nn::Linear>();
  const auto second = model->ptr(1)->as<torch::nn::Linear>();
  ASSERT_NE(first->weight.data_ptr(), second->weight.data_ptr());
  ASSERT_TRUE(acc::find_tied_parameters(*model).empty());
  second->weight.detach().add_(1);  // now they differ

  acc::retie_parameters(*model, groups);
  ASSERT_NO_FATAL_FAILURE(expect_tied(*model, "0.weight", "1.weight"));
  EXPECT_TRUE(torch::equal(second->weight, first->weight)) << "the first name's data is the one kept";
  EXPECT_NE(first->bias.data_ptr(), second->bias.data_ptr()) << "untied names stay apart";

  // An optimizer of the first layer only: its step moves the second layer's weight too.
  torch::optim::SGD sgd(first->parameters(), 0.1);
  const auto before = first->weight.detach().clone();
  first->forward(torch::randn({3, 4})).pow(2).sum().backward();
  sgd.step();
  EXPECT_FALSE(torch::equal(first->weight.detach(), before)) << "the step changed nothing";
  EXPECT_TRUE(torch::equal(second->weight.detach(), first->weight.detach()))
      << "training the first layer left the second's weight behind";
}

TEST(RetieParameters, TheFirstNameNotOnTheMetaDeviceGivesTheData) {
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4));
  const auto second = model[1]->as<torch::nn::Linear>();
  const auto kept = second->weight.detach().clone();
  // A load that left the first name empty: only the second name's weight was in the file.
  acc::set_module_tensor_to_device(*model, "0.weight", torch::kMeta);
  acc::retie_parameters(*model, {{"0.weight", "1.weight"}});
  ASSERT_NO_FATAL_FAILURE(expect_tied(*model, "0.weight", "1.weight"));
  EXPECT_TRUE(torch::equal(model[0]->as<torch::nn::Linear>()->weight, kept));
  // A group with every name on the meta device has nothing to give: it is left as it is.
  acc::set_module_tensor_to_device(*model, "0.bias", torch::kMeta);
  acc::set_module_tensor_to_device(*model, "1.bias", torch::kMeta);
  acc::retie_parameters(*model, {{"0.bias", "1.bias"}});
  EXPECT_TRUE(model[0]->as<torch::nn::Linear>()->bias.is_meta());
  EXPECT_TRUE(model[1]->as<torch::nn::Linear>()->bias.is_meta());
}

}  // namespace big_modeling_test

TEST(DeviceMap, InferAutoDeviceMapUpstreamOracles) {
  ModelForTest model;
  // Only linear1 fits on device 0, which keeps room for the largest layer (100 bytes).
  EXPECT_EQ(acc::infer_auto_device_map(*model, {.max_memory = acc::MaxMemory{{0, 200}, {1, 200}}}),
            map({{"linear1", 0}, {"batchnorm", 1}, {"linear2", 1}}));
  // Device 1 need not keep room: batchnorm + linear2 (172) fit exactly.
  EXPECT_EQ(acc::infer_auto_device_map(*model, {.max_memory = acc::MaxMemory{{0, 200}, {1, 172}, {2, 200}}}),
            map({{"linear1", 0}, {"batchnorm", 1}, {"linear2", 1}}));
  // With linear1's weight tied to linear2's, the model is smaller and fits on device 0.
  Retie::tie(*model->linear1, "weight", model->linear2->weight);
  EXPECT_EQ(acc::infer_auto_device_map(*model, {.max_memory = acc::MaxMemory{{0, 200}, {1, 200}}}), map({{"", 0}}));

  // A bigger model is split at the layer level…
  torch::nn::Sequential seq{ModelForTest(), ModelForTest(), ModelForTest()};
  EXPECT_EQ(acc::infer_auto_device_map(*seq, {.max_memory = acc::MaxMemory{{0, 500}, {1, 500}}}),
            map({{"0", 0}, {"1.linear1", 0}, {"1.batchnorm", 0}, {"1.linear2", 1}, {"2", 1}}));
  // …or at the level of the classes that must not be split.
  EXPECT_EQ(acc::infer_auto_device_map(
                *seq, {.max_memory = acc::MaxMemory{{0, 500}, {1, 500}}, .no_split_module_classes = {"ModelForTest"}}),
            map({{"0", 0}, {"1", 1}, {"2", 1}}));
  // Without cleaning, every placed entry is listed.
  auto raw =
      acc::infer_auto_device_map(*seq, {.max_memory = acc::MaxMemory{{0, 500}, {1, 500}}, .clean_result = false});
  EXPECT_EQ(raw.at("1.linear2"), acc::MapDevice(1));
  EXPECT_EQ(raw.count("2"), 1u);
  // CPU then disk when GPUs are missing: the CPU keeps room for the largest layer.
  EXPECT_EQ(acc::infer_auto_device_map(*ModelForTest(), {.max_memory = acc::MaxMemory{{"cpu", 180}}}),
            map({{"linear1", "cpu"}, {"batchnorm", "disk"}, {"linear2", "disk"}}));
}

TEST(DeviceMap, FallbackAllocationFindsASmallerModule) {
  torch::nn::Sequential inner;
  inner->push_back("linear1", torch::nn::Linear(10, 4));
  inner->push_back("linear2", torch::nn::Linear(4, 4));
  inner->push_back("linear3", torch::nn::Linear(4, 8));
  auto model = std::make_shared<torch::nn::Module>();
  model->register_module("module", inner);
  auto without = acc::infer_auto_device_map(*model, {.max_memory = acc::MaxMemory{{0, 256}}});
  for (const auto& [name, device] : without) EXPECT_NE(device, acc::MapDevice(0)) << name;
  EXPECT_EQ(acc::infer_auto_device_map(*model, {.max_memory = acc::MaxMemory{{0, 256}}, .fallback_allocation = true}),
            map({{"module.linear1", "disk"}, {"module.linear2", 0}, {"module.linear3", "disk"}}));
}

TEST(DeviceMap, BuffersOfOffloadedLayersThatFitNoGpuAreWarnedAbout) {
  ModelForTest model;
  model->linear1->register_buffer("test_buffer1", torch::zeros({10, 2}));
  model->batchnorm->register_buffer("test_buffer2", torch::zeros({10, 3}));
  model->linear2->register_buffer("test_buffer3", torch::zeros({10, 3}));
  {
    acc::testing::CapturedLines warnings;
    EXPECT_EQ(acc::infer_auto_device_map(*model, {.max_memory = acc::MaxMemory{{0, 400}, {"cpu", "1GB"}}}),
              map({{"linear1", 0}, {"batchnorm", "cpu"}, {"linear2", "cpu"}}));
    EXPECT_TRUE(warnings.saw("bytes of buffer for offloaded layers"));
  }
  acc::testing::CapturedLines warnings;
  EXPECT_EQ(acc::infer_auto_device_map(
                *model, {.max_memory = acc::MaxMemory{{0, 400}, {"cpu", "1GB"}}, .offload_buffers = true}),
            map({{"linear1", 0}, {"batchnorm", "cpu"}, {"linear2", "cpu"}}));
  EXPECT_FALSE(warnings.saw("bytes of buffer for offloaded layers"));
}

TEST(DeviceMap, MaxMemoryDefaultsToTheAvailableRam) {
  auto memory = acc::get_max_memory();
  ASSERT_EQ(memory.size(), 1u);
  EXPECT_GT(memory.at("cpu").bytes, int64_t{1} << 20);
  EXPECT_THROWS_WITH(acc::get_max_memory(acc::MaxMemory{{"cpu", -1}}), "the budget of cpu is negative");
}

TEST(DeviceMap, TiedWeightsStayTogether) {
  torch::nn::Sequential seq;
  ModelForTest l1, l2, l3;
  seq->push_back("layer1", l1);
  seq->push_back("layer2", l2);
  seq->push_back("layer3", l3);
  Retie::tie(*l3->linear2, "weight", l1->linear2->weight);
  EXPECT_EQ(acc::find_tied_parameters(*seq),
            (std::vector<std::vector<std::string>>{{"layer1.linear2.weight", "layer3.linear2.weight"}}));
  EXPECT_EQ(acc::infer_auto_device_map(*seq, {.max_memory = acc::MaxMemory{{0, 400}, {1, 500}}}),
            map({{"layer1", 0}, {"layer3.linear2", 0}, {"layer2", 1}, {"layer3.linear1", 1}, {"layer3.batchnorm", 1}}))
      << device_map_string(acc::infer_auto_device_map(*seq, {.max_memory = acc::MaxMemory{{0, 400}, {1, 500}}}));
  // Three weights tied together.
  Retie::tie(*l2->linear2, "weight", l1->linear2->weight);
  EXPECT_EQ(acc::infer_auto_device_map(*seq, {.max_memory = acc::MaxMemory{{0, 400}, {1, 500}}}),
            map({{"layer1", 0},
                 {"layer2.linear2", 0},
                 {"layer3.linear2", 0},
                 {"layer2.linear1", 1},
                 {"layer2.batchnorm", 1},
                 {"layer3.linear1", 1},
                 {"layer3.batchnorm", 1}}));
}

TEST(DeviceMap, BalancedMemoryUpstreamOracles) {
  ModelForTest model;
  auto balanced = [&](acc::MaxMemory m, bool low_zero = false) {
    std::map<std::string, int64_t> out;
    for (const auto& [d, s] : acc::get_balanced_memory(*model, {.max_memory = m, .low_zero = low_zero})) {
      out[d.str()] = s.bytes;
    }
    return out;
  };
  using M = std::map<std::string, int64_t>;
  EXPECT_EQ(balanced({{0, 200}, {1, 200}}), (M{{"0", 200}, {"1", 200}}));
  EXPECT_EQ(balanced({{0, 200}, {2, 200}}), (M{{"0", 200}, {"2", 200}}));
  EXPECT_EQ(balanced({{0, 300}, {1, 300}}), (M{{"0", 215}, {"1", 300}}));
  EXPECT_EQ(balanced({{0, 300}, {1, 500}}), (M{{"0", 215}, {"1", 500}}));
  EXPECT_EQ(balanced({{0, 300}, {"cpu", 1000}}), (M{{"0", 300}, {"cpu", 1000}}));
  EXPECT_EQ(balanced({{0, 0}, {1, 300}, {2, 300}}), (M{{"0", 0}, {"1", 215}, {"2", 300}}));
  EXPECT_EQ(balanced({{0, 0}, {"cpu", 100}}), (M{{"0", 0}, {"cpu", 100}}));
  // low_zero: GPU 0 keeps only what the others cannot hold.
  EXPECT_EQ(balanced({{0, 300}, {1, 100}}, true), (M{{"0", 136}, {"1", 100}}));
}

TEST(DeviceMap, CleanDeviceMapUpstreamOracles) {
  auto a = map({{"a", 0}, {"b", 0}, {"c", 0}});
  EXPECT_EQ(acc::clean_device_map(a), map({{"", 0}}));
  auto b = map({{"a.x", 0}, {"a.y", 0}, {"b.x", 1}, {"b.y", 1}, {"c", 1}});
  EXPECT_EQ(acc::clean_device_map(b), map({{"a", 0}, {"b", 1}, {"c", 1}}));
  auto c = map({{"a.x", 0}, {"a.y", 0}, {"b.x.0", 1}, {"b.x.1", 1}, {"b.y.0", 2}, {"b.y.1", 2}, {"c", 2}});
  EXPECT_EQ(acc::clean_device_map(c), map({{"a", 0}, {"b.x", 1}, {"b.y", 2}, {"c", 2}}));
}

TEST(DeviceMap, CheckDeviceMapNamesWhatIsMissing) {
  ModelForTest model;
  acc::check_device_map(*model, map({{"", 0}}));
  acc::check_device_map(*model, map({{"linear1", 0}, {"batchnorm", 1}, {"linear2", "cpu"}}));
  EXPECT_THROWS_WITH(acc::check_device_map(*model, map({{"linear1", 0}, {"batchnorm", 1}})),
                     "does not give any device for the following parameters: linear2.weight, linear2.bias");
  EXPECT_THROWS_WITH(acc::check_device_map(*model, map({{"linear1", 0}, {"linear2", 1}})), "batchnorm.running_mean");
}

TEST(DeviceMap, SetModuleTensorToDevice) {
  torch::nn::Linear lin(3, 4);
  auto handle = lin->weight;  // another handle to the same parameter
  acc::set_module_tensor_to_device(*lin, "weight", torch::kMeta);
  EXPECT_TRUE(handle.is_meta());
  EXPECT_TRUE(lin->weight.is_meta());
  EXPECT_TRUE(lin->weight.requires_grad());
  EXPECT_THROWS_WITH(acc::set_module_tensor_to_device(*lin, "weight", torch::kCPU),
                     "weight is on the meta device, we need a `value`");
  EXPECT_THROWS_WITH(acc::set_module_tensor_to_device(*lin, "weight", torch::kCPU, torch::ones({4, 4})),
                     "Trying to set a tensor of shape [4, 4] in \"weight\" (which has shape [4, 3])");
  acc::set_module_tensor_to_device(*lin, "weight", torch::kCPU, torch::ones({4, 3}, torch::kDouble));
  EXPECT_EQ(handle.scalar_type(), torch::kFloat);  // keeps the tensor's dtype
  EXPECT_TRUE(torch::equal(lin->forward(torch::ones({1, 3})) - lin->bias, torch::full({1, 4}, 3.0)));
  acc::set_module_tensor_to_device(*lin, "weight", torch::kCPU, torch::ones({4, 3}), torch::kBFloat16);
  EXPECT_EQ(lin->weight.scalar_type(), torch::kBFloat16);
  EXPECT_THROWS_WITH(acc::set_module_tensor_to_device(*lin, "nothing", torch::kCPU),
                     "no parameter or buffer 'nothing'");
  torch::nn::Sequential seq(torch::nn::Linear(2, 2));
  EXPECT_THROWS_WITH(acc::set_module_tensor_to_device(*seq, "5.weight", torch::kCPU), "no submodule '5'");
}

TEST(BigModeling, InitEmptyWeightsAllocatesNothing) {
  // 4 GB of parameters would not go unnoticed.
  auto model = acc::init_empty_weights(
      [] { return torch::nn::Sequential(torch::nn::Linear(100000, 10000), torch::nn::BatchNorm1d(10000)); });
  for (const auto& [name, t] : acc::named_module_tensors(*model, true, true)) EXPECT_TRUE(t.is_meta()) << name;
  EXPECT_EQ(acc::compute_module_sizes(*model).at(""), (100000LL * 10000 + 10000) * 4 + 4 * 10000 * 4 + 8);
  // The thread computes normally afterwards.
  EXPECT_EQ(torch::ones({2}).sum().item<float>(), 2.0f);
  EXPECT_FALSE(torch::zeros({3}).is_meta());
  // A failing factory leaves the thread normal too.
  EXPECT_THROW(acc::init_empty_weights([]() -> torch::nn::Linear { throw std::runtime_error("boom"); }),
               std::runtime_error);
  EXPECT_EQ(torch::ones({2}).sum().item<float>(), 2.0f);
  auto on_cpu = acc::init_on_device(torch::kCPU, [] { return torch::nn::Linear(2, 2); });
  EXPECT_FALSE(on_cpu->weight.is_meta());
}

TEST(Offload, RoundTripsEveryDtypeWithUpstreamIndex) {
  TempDir dir;
  acc::TensorMap tensors{{"a.f32", torch::randn({3, 4})},
                         {"b.f16", torch::randn({5}).to(torch::kHalf)},
                         {"c.bf16", torch::randn({2, 2}).to(torch::kBFloat16)},
                         {"d.i64", torch::arange(6).reshape({2, 3})},
                         {"e.scalar", torch::tensor(3.5)}};
  acc::offload_state_dict(dir.str(), tensors);
  nlohmann::json index;
  std::ifstream(dir.path() / "index.json") >> index;
  EXPECT_EQ(index["a.f32"], (nlohmann::json{{"dtype", "float32"}, {"shape", {3, 4}}}));
  EXPECT_EQ(index["b.f16"]["dtype"], "float16");
  EXPECT_EQ(index["c.bf16"]["dtype"], "bfloat16");
  EXPECT_EQ(index["d.i64"]["dtype"], "int64");
  EXPECT_EQ(index["e.scalar"]["shape"], nlohmann::json::array());
  EXPECT_EQ(fs::file_size(dir.path() / "a.f32.dat"), 48u);
  EXPECT_EQ(fs::file_size(dir.path() / "e.scalar.dat"), 4u);
  auto loaded = acc::load_offload_index(dir.str());
  for (const auto& [name, t] : tensors) {
    auto back = acc::load_offloaded_weight((dir.path() / (name + ".dat")).string(), loaded.at(name));
    EXPECT_EQ(back.scalar_type(), t.scalar_type()) << name;
    EXPECT_TRUE(torch::equal(back, t)) << name;
  }
  // Writing into a loaded weight never changes the file.
  auto w = acc::load_offloaded_weight((dir.path() / "a.f32.dat").string(), loaded.at("a.f32"));
  w.fill_(7);
  EXPECT_TRUE(torch::equal(acc::OffloadedWeightsLoader({}, dir.str()).get("a.f32"), tensors.at("a.f32")));
  // A second offload merges into the index.
  acc::offload_state_dict(dir.str(), {{"f.more", torch::ones({1})}});
  EXPECT_EQ(acc::load_offload_index(dir.str()).size(), 6u);
}

TEST(Offload, DamagedFolderIsReportedByName) {
  TempDir dir;
  acc::offload_state_dict(dir.str(), {{"w", torch::ones({4, 4})}});
  fs::resize_file(dir.path() / "w.dat", 10);
  EXPECT_THROWS_WITH(acc::OffloadedWeightsLoader({}, dir.str()).get("w"), "w.dat holds 10 bytes but its index entry");
  std::ofstream(dir.path() / "index.json") << "{\"w\": {\"dtype\": \"float32\"}}";
  EXPECT_THROWS_WITH(acc::load_offload_index(dir.str()), "needs \"dtype\" and \"shape\"");
  std::ofstream(dir.path() / "index.json") << "{\"../x\": {\"dtype\": \"float32\", \"shape\": [1]}}";
  EXPECT_THROWS_WITH(acc::load_offload_index(dir.str()), "'../x' is not a valid weight name");
  std::ofstream(dir.path() / "index.json") << "not json";
  EXPECT_THROWS_WITH(acc::load_offload_index(dir.str()), "is not valid JSON");
  const std::string index = (dir.path() / "index.json").string();
  std::ofstream(index) << "[1, 2]";
  EXPECT_THROWS_WITH(acc::load_offload_index(dir.str()), index + " must hold a JSON object of weight entries");
  std::ofstream(index) << "{\"w\": {\"dtype\": 3, \"shape\": [1]}}";
  EXPECT_THROWS_WITH(acc::load_offload_index(dir.str()), index + ": the entry of 'w' is malformed");
  std::ofstream(index) << "{\"w\": {\"dtype\": \"float32\", \"shape\": [4, -1]}}";
  EXPECT_THROWS_WITH(acc::load_offload_index(dir.str()), index + ": negative size in 'w'");
  std::ofstream(index) << "{\"w\": {\"dtype\": \"float3\", \"shape\": [4]}}";
  EXPECT_THROWS_WITH(acc::load_offload_index(dir.str()), index + ": unknown dtype 'float3'");
  EXPECT_THROWS_WITH(acc::OffloadedWeightsLoader({}, dir.str() + "/missing"), "index.json does not exist");
  EXPECT_THROWS_WITH(acc::OffloadedWeightsLoader({}), "Need either a `state_dict`");
  EXPECT_THROWS_WITH(acc::OffloadedWeightsLoader({{"a", torch::ones(1)}}).get("b"), "no offloaded weight named 'b'");
}

namespace big_modeling_test {

// A copy of every parameter and buffer of `model`, by name.
std::map<std::string, at::Tensor> tensors_of(const torch::nn::Module& model) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, t] : acc::named_module_tensors(model, true, true)) out.emplace(name, t.detach().clone());
  return out;
}

TEST(LoadOffloadedWeights, AModelGetsBackTheWeightsItsOffloadFolderHolds) {
  TempDir dir;
  torch::manual_seed(0);
  ModelForTest source;
  source->batchnorm->running_mean.normal_();
  source->batchnorm->num_batches_tracked.fill_(7);
  acc::TensorMap weights;
  for (const auto& item : acc::get_state_dict(*source)) weights.emplace(item.key(), item.value());
  acc::offload_state_dict(dir.str(), weights);

  // Into a model of other values, whose handles see the loaded data (it changes in place)…
  torch::manual_seed(1);
  ModelForTest model;
  const auto weight_handle = model->linear1->weight;
  ASSERT_FALSE(torch::equal(weight_handle, source->linear1->weight));
  acc::load_offloaded_weights(*model, acc::load_offload_index(dir.str()), dir.str());
  const auto expected = tensors_of(*source);
  const auto loaded = tensors_of(*model);
  ASSERT_EQ(loaded.size(), expected.size());
  for (const auto& [name, t] : loaded) {
    EXPECT_TRUE(t.is_cpu()) << name;
    EXPECT_EQ(t.scalar_type(), expected.at(name).scalar_type()) << name;
    EXPECT_TRUE(torch::equal(t, expected.at(name))) << name;
  }
  EXPECT_TRUE(torch::equal(weight_handle, source->linear1->weight));
  EXPECT_TRUE(torch::equal(model->forward(torch::ones({2, 3})), source->forward(torch::ones({2, 3}))));

  // …and into an empty one, which it materialises.
  auto empty = acc::init_empty_weights([] { return ModelForTest(); });
  acc::load_offloaded_weights(*empty, acc::load_offload_index(dir.str()), dir.str());
  for (const auto& [name, t] : tensors_of(*empty)) {
    ASSERT_FALSE(t.is_meta()) << name << " stayed on the meta device";
    EXPECT_TRUE(torch::equal(t, expected.at(name))) << name;
  }
  // An empty index loads nothing.
  acc::load_offloaded_weights(*empty, {}, dir.str() + "/missing");
}

TEST(LoadOffloadedWeights, AMissingOrDamagedIndexOrWeightFileIsReportedByName) {
  TempDir dir;
  ModelForTest source, model;
  acc::TensorMap weights;
  for (const auto& item : acc::get_state_dict(*source)) weights.emplace(item.key(), item.value());
  acc::offload_state_dict(dir.str(), weights);
  const auto index = acc::load_offload_index(dir.str());
  const std::string index_file = (dir.path() / "index.json").string();
  const std::string weight_file = (dir.path() / "linear2.weight.dat").string();

  // A weight file cut short, or gone.
  fs::resize_file(weight_file, 12);
  EXPECT_THROWS_WITH(acc::load_offloaded_weights(*model, index, dir.str()),
                     weight_file + " holds 12 bytes but its index entry (float32, shape [5, 4]) needs 80");
  fs::remove(weight_file);
  EXPECT_THROWS_WITH(acc::load_offloaded_weights(*model, index, dir.str()), "cannot open " + weight_file);
  // The folder of another model: a name this one does not have.
  fs::copy_file(dir.path() / "linear1.weight.dat", dir.path() / "decoder.weight.dat");
  EXPECT_THROWS_WITH(acc::load_offloaded_weights(*model, {{"decoder.weight", index.at("linear1.weight")}}, dir.str()),
                     "no submodule 'decoder'");
  // The index itself: damaged, or missing.
  std::ofstream(index_file) << "{\"linear1.weight\": ";
  EXPECT_THROWS_WITH(acc::load_offload_index(dir.str()), index_file + " is not valid JSON");
  fs::remove(index_file);
  EXPECT_THROWS_WITH(acc::load_offload_index(dir.str()), index_file + " does not exist");
}

}  // namespace big_modeling_test

namespace {

torch::nn::Sequential make_mlp() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 16),
                               torch::nn::BatchNorm1d(16), torch::nn::Linear(16, 4));
}

}  // namespace

TEST(Hooks, CpuAndDiskOffloadGiveThePlainOutputs) {
  auto plain = make_mlp();
  plain->eval();
  auto x = torch::randn({5, 8});
  auto expected = plain->forward(x);

  auto cpu = make_mlp();
  cpu->eval();
  acc::cpu_offload(*cpu);
  EXPECT_TRUE(cpu[0]->as<torch::nn::Linear>()->weight.is_meta());
  EXPECT_TRUE(torch::allclose(acc::forward(cpu, x), expected));
  EXPECT_TRUE(cpu[2]->as<torch::nn::Linear>()->weight.is_meta());  // released after the call

  TempDir dir;
  auto disk = make_mlp();
  disk->eval();
  acc::disk_offload(*disk, dir.str());
  EXPECT_TRUE(fs::exists(dir.path() / "index.json"));
  EXPECT_TRUE(fs::exists(dir.path() / "2.weight.dat"));
  EXPECT_TRUE(torch::allclose(acc::forward(disk, x), expected));
  EXPECT_TRUE(disk[4]->as<torch::nn::Linear>()->weight.is_meta());
  // Removing the hooks puts the weights back.
  acc::remove_hook_from_module(*disk, true);
  EXPECT_FALSE(disk[4]->as<torch::nn::Linear>()->weight.is_meta());
  EXPECT_TRUE(torch::allclose(disk->forward(x), expected));
  EXPECT_EQ(acc::get_hook(*disk[0]), nullptr);
}

// The prefetcher of an offloaded model: its hook's options hold it.
std::shared_ptr<acc::OffloadPrefetcher> prefetcher_of(torch::nn::Module& module) {
  auto hook = std::dynamic_pointer_cast<acc::AlignDevicesHook>(acc::get_hook(module));
  return hook ? hook->options().prefetcher : nullptr;
}

TEST(Hooks, OffloadedModulesGetTheirWeightsReadAheadAndTheSameOutputs) {
  auto plain = make_mlp();
  plain->eval();
  auto x = torch::randn({5, 8});
  auto expected = plain->forward(x);
  TempDir dir;
  auto disk = make_mlp();
  disk->eval();
  acc::disk_offload(*disk, dir.str());
  auto prefetcher = prefetcher_of(*disk[0]);
  ASSERT_NE(prefetcher, nullptr);
  EXPECT_EQ(prefetcher_of(*disk[2]), prefetcher) << "the offloaded modules of one model share one prefetcher";
  for (int pass = 0; pass < 4; ++pass) {
    EXPECT_TRUE(torch::allclose(acc::forward(disk, x), expected)) << "pass " << pass;
    EXPECT_TRUE(disk[4]->as<torch::nn::Linear>()->weight.is_meta());
  }
  // Four offloaded modules (three Linear, one BatchNorm): the first pass learns their order, the
  // second reads ahead from its second module on, the later ones for every module (the first
  // one's read starts while the last module of the pass before computes).
  EXPECT_EQ(prefetcher->hits(), 3 + 4 + 4);
  // Removing the hooks ends the prefetcher (and its thread): nothing else holds it.
  const std::weak_ptr<acc::OffloadPrefetcher> watch = prefetcher;
  prefetcher.reset();
  acc::remove_hook_from_module(*disk, true);
  EXPECT_TRUE(watch.expired());
  EXPECT_TRUE(torch::allclose(disk->forward(x), expected));

  // cpu_offload and dispatch_model read ahead too.
  auto cpu = make_mlp();
  cpu->eval();
  acc::cpu_offload(*cpu);
  for (int pass = 0; pass < 3; ++pass) EXPECT_TRUE(torch::allclose(acc::forward(cpu, x), expected));
  ASSERT_NE(prefetcher_of(*cpu[0]), nullptr);
  EXPECT_GT(prefetcher_of(*cpu[0])->hits(), 0);
}

TEST(OffloadPrefetcher, LearnsTheOrderThenReadsTheNextModuleOnAnotherThread) {
  int keys[3];
  std::mutex mutex;
  std::vector<std::pair<int, std::thread::id>> reads;  // (module, thread) of every read
  acc::OffloadPrefetcher prefetcher;  // after what its reads use: it stops first
  const auto loader = [&](int module) {
    return [&, module] {
      std::lock_guard<std::mutex> lock(mutex);
      reads.emplace_back(module, std::this_thread::get_id());
      return std::vector<at::Tensor>{at::full({2}, module)};
    };
  };
  const auto pass = [&] {
    std::vector<bool> ahead;
    for (int m = 0; m < 3; ++m) {
      auto got = prefetcher.arrive(&keys[m], loader(m));
      ahead.push_back(got.has_value());
      if (got) {
        EXPECT_TRUE(at::equal(got->at(0), at::full({2}, m))) << "module " << m << " got another's weights";
      }
    }
    return ahead;
  };
  EXPECT_EQ(pass(), (std::vector<bool>{false, false, false}));  // learning
  EXPECT_EQ(pass(), (std::vector<bool>{false, true, true}));    // the order is known once module 0 comes back
  EXPECT_EQ(pass(), (std::vector<bool>{true, true, true}));     // module 0 was read during module 2
  EXPECT_EQ(prefetcher.hits(), 5);
  std::lock_guard<std::mutex> lock(mutex);
  // Five used, plus module 0's for a next pass when it started before the prefetcher stopped:
  // never more than one module ahead.
  EXPECT_GE(reads.size(), 5u);
  EXPECT_LE(reads.size(), 6u);
  for (const auto& [module, thread] : reads) EXPECT_NE(thread, std::this_thread::get_id()) << module;
}

TEST(OffloadPrefetcher, AModuleOutOfOrderOrAFailedReadFallsBackToItsOwnRead) {
  int keys[4];
  std::atomic<bool> fail{false};
  acc::OffloadPrefetcher prefetcher;  // after what its reads use: it stops first
  const auto loader = [&](int module) {
    return [&, module] {
      if (fail) throw std::runtime_error("disk gone");
      return std::vector<at::Tensor>{at::full({1}, module)};
    };
  };
  for (int round = 0; round < 2; ++round) {
    for (int m = 0; m < 3; ++m) (void)prefetcher.arrive(&keys[m], loader(m));
  }
  // Module 2 runs where module 1 was expected: it gets nothing read ahead (never module 1's weights).
  (void)prefetcher.arrive(&keys[0], loader(0));
  EXPECT_FALSE(prefetcher.arrive(&keys[2], loader(2)).has_value());
  // A module never seen restarts the learning; the known order no longer applies.
  EXPECT_FALSE(prefetcher.arrive(&keys[3], loader(3)).has_value());
  EXPECT_FALSE(prefetcher.arrive(&keys[0], loader(0)).has_value());
  EXPECT_FALSE(prefetcher.arrive(&keys[1], loader(1)).has_value());
  EXPECT_FALSE(prefetcher.arrive(&keys[3], loader(3)).has_value());
  (void)prefetcher.arrive(&keys[0], loader(0));  // learned: 3 -> 0 -> 1
  auto one = prefetcher.arrive(&keys[1], loader(1));
  ASSERT_TRUE(one.has_value());
  EXPECT_TRUE(at::equal(one->at(0), at::full({1}, 1)));
  // A read that fails in the background is not handed out: the hook reads (and raises) itself.
  fail = true;
  (void)prefetcher.arrive(&keys[3], loader(3));
  EXPECT_FALSE(prefetcher.arrive(&keys[0], loader(0)).has_value());
}

TEST(Hooks, CustomModulesReachChildHooksThroughForward) {
  torch::manual_seed(1);
  ModelForTest plain;
  plain->eval();
  auto x = torch::randn({3, 3});
  auto expected = plain->forward(x);
  TempDir dir;
  acc::disk_offload(*plain, dir.str());
  EXPECT_TRUE(torch::allclose(acc::forward(plain, x), expected));
  // A child called directly computes on the meta device; the outer hook says so.
  struct DirectImpl : torch::nn::Module {
    DirectImpl() { lin = register_module("lin", torch::nn::Linear(2, 2)); }
    torch::Tensor forward(torch::Tensor x) { return lin(x); }
    torch::nn::Linear lin{nullptr};
  };
  auto direct = std::make_shared<DirectImpl>();
  acc::cpu_offload(*direct);
  EXPECT_THROWS_WITH(acc::forward(direct, torch::ones({1, 2})), "ran without its hook");
  // Listing its class preloads its whole subtree instead.
  auto preloaded = std::make_shared<DirectImpl>();
  auto reference = preloaded->forward(torch::ones({1, 2}));
  acc::cpu_offload(*preloaded, std::nullopt, false, std::nullopt, {"Direct"});
  EXPECT_TRUE(torch::allclose(acc::forward(preloaded, torch::ones({1, 2})), reference));
}

TEST(Hooks, SequentialHookRunsInOrderAndRemoveDetaches) {
  struct Recorder : acc::ModelHook {
    Recorder(std::vector<std::string>& log, std::string name) : log(log), name(std::move(name)) {}
    void init_hook(torch::nn::Module&) override { log.push_back(name + ".init"); }
    void pre_forward(torch::nn::Module&, std::vector<at::Tensor>& in) override {
      log.push_back(name + ".pre");
      in[0] = in[0] * 2;
    }
    void post_forward(torch::nn::Module&, std::vector<at::Tensor>& out) override {
      log.push_back(name + ".post");
      out[0] = out[0] + 1;
    }
    void detach_hook(torch::nn::Module&) override { log.push_back(name + ".detach"); }
    std::vector<std::string>& log;
    std::string name;
  };
  std::vector<std::string> log;
  torch::nn::Identity id;
  acc::add_hook_to_module(*id, std::make_shared<Recorder>(log, "a"));
  acc::add_hook_to_module(*id, std::make_shared<Recorder>(log, "b"), /*append=*/true);
  auto y = acc::forward(id, torch::ones({1}));
  EXPECT_EQ(y.item<float>(), 4 + 1 + 1);  // doubled twice, then plus one twice
  acc::remove_hook_from_module(*id);
  // Appending re-runs the first hook's init inside the new sequence, as upstream.
  EXPECT_EQ(log, (std::vector<std::string>{"a.init", "a.detach", "a.init", "b.init", "a.pre", "b.pre", "a.post",
                                           "b.post", "a.detach", "b.detach"}));
  EXPECT_EQ(acc::forward(id, torch::ones({1})).item<float>(), 1.0f);
  EXPECT_THROWS_WITH(acc::add_hook_to_module(*id, nullptr), "the hook is null");
}

TEST(BigModeling, LoadCheckpointAndDispatchOnCpuAndDisk) {
  auto plain = make_mlp();
  plain->eval();
  auto x = torch::randn({4, 8});
  auto expected = plain->forward(x);
  TempDir ckpt, offload;
  acc::save_state_dict_sharded(acc::get_state_dict(*plain), ckpt.str(), "700");

  auto model = acc::init_empty_weights(make_mlp);
  model->eval();
  // 8x16+16 = 576 bytes, 16x16+16 = 1088, batchnorm 264, 16x4+4 = 272: the CPU (with room kept
  // for the largest layer) takes the first Linear only.
  acc::load_checkpoint_and_dispatch(*model, ckpt.str(),
                                    {.device_map = std::string("auto"),
                                     .max_memory = acc::MaxMemory{{"cpu", 1700}},
                                     .offload_folder = offload.str()});
  EXPECT_FALSE(model[0]->as<torch::nn::Linear>()->weight.is_meta());
  EXPECT_TRUE(model[2]->as<torch::nn::Linear>()->weight.is_meta());
  auto index = acc::load_offload_index(offload.str());
  EXPECT_EQ(index.count("2.weight"), 1u);
  EXPECT_FALSE(index.at("2.weight").safetensors_file.empty());  // points into the checkpoint
  EXPECT_EQ(index.count("0.weight"), 0u);
  EXPECT_TRUE(torch::allclose(acc::forward(model, x), expected, 1e-5, 1e-6));

  // An explicit map in bf16.
  auto half = acc::init_empty_weights(make_mlp);
  half->eval();
  TempDir offload2;
  acc::load_checkpoint_and_dispatch(
      *half, ckpt.str(),
      {.device_map = map({{"0", "cpu"}, {"1", "cpu"}, {"2", "disk"}, {"3", "cpu"}, {"4", "disk"}}),
       .offload_folder = offload2.str(),
       .dtype = torch::kBFloat16});
  EXPECT_EQ(half[0]->as<torch::nn::Linear>()->weight.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(acc::load_offload_index(offload2.str()).at("4.weight").dtype, "bfloat16");
  auto out = acc::forward(half, x.to(torch::kBFloat16));
  EXPECT_TRUE(torch::allclose(out.to(torch::kFloat), expected, 0.05, 0.05));

  // Without a device map an empty model is materialised on the CPU.
  auto whole = acc::init_empty_weights(make_mlp);
  whole->eval();
  acc::load_checkpoint_and_dispatch(*whole, ckpt.str());
  for (const auto& [name, t] : acc::named_module_tensors(*whole, true, true)) EXPECT_FALSE(t.is_meta()) << name;
  EXPECT_TRUE(torch::allclose(whole->forward(x), expected, 1e-5, 1e-6));

  auto bad = acc::init_empty_weights(make_mlp);
  EXPECT_THROWS_WITH(acc::load_checkpoint_and_dispatch(*bad, ckpt.str(), {.device_map = std::string("fastest")}),
                     "please choose 'auto', 'balanced', 'balanced_low_0' or 'sequential'");
  EXPECT_THROWS_WITH(acc::load_checkpoint_and_dispatch(*bad, ckpt.str(), {.device_map = map({{"", "disk"}})}),
                     "please pass along an `offload_folder`");
  auto plain2 = make_mlp();
  EXPECT_THROWS_WITH(
      acc::dispatch_model(*plain2, map({{"0", "cpu"}, {"1", "cpu"}, {"2", "disk"}, {"3", "cpu"}, {"4", "cpu"}})),
      "We need an `offload_dir` to dispatch this model according to this `device_map`, the following "
      "submodules need to be offloaded: 2.");
}

// Pickled weights (torch.save's pytorch_model.bin, its sharded index), as most checkpoints of
// Python's world hold them: load_checkpoint_in_model and load_checkpoint_and_dispatch read them as
// they read safetensors, and keep_in_fp32_modules keeps upstream's rule.
TEST(BigModeling, PickledWeightsLoadLikeSafetensorsAndKeepInFp32ModulesKeepsUpstreamsRule) {
  auto plain = make_mlp();
  plain->eval();
  auto x = torch::randn({4, 8});
  auto expected = plain->forward(x);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& item : acc::get_state_dict(*plain)) tensors.emplace_back(item.key(), item.value());
  TempDir whole, sharded, offload;
  acc::detail::checkpoint::python_layout::write_pickled_model(tensors, (whole.path() / "pytorch_model.bin").string());
  // Two shards and the index transformers writes for them.
  nlohmann::json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", nlohmann::json::object()}};
  std::vector<std::pair<std::string, at::Tensor>> first(tensors.begin(), tensors.begin() + 4), second(tensors.begin() + 4, tensors.end());
  acc::detail::checkpoint::python_layout::write_pickled_model(first, (sharded.path() / "pytorch_model-00001-of-00002.bin").string());
  acc::detail::checkpoint::python_layout::write_pickled_model(second, (sharded.path() / "pytorch_model-00002-of-00002.bin").string());
  for (const auto& [name, t] : first) index["weight_map"][name] = "pytorch_model-00001-of-00002.bin";
  for (const auto& [name, t] : second) index["weight_map"][name] = "pytorch_model-00002-of-00002.bin";
  std::ofstream(sharded.path() / "pytorch_model.bin.index.json") << index.dump();

  for (const auto& checkpoint : {whole.str(), (whole.path() / "pytorch_model.bin").string(), sharded.str(),
                                 (sharded.path() / "pytorch_model.bin.index.json").string()}) {
    auto model = make_mlp();
    for (auto& p : model->parameters()) p.data().zero_();
    model->eval();
    const auto result = acc::load_checkpoint_in_model(*model, checkpoint, {.strict = true});
    EXPECT_TRUE(result.missing_keys.empty() && result.unexpected_keys.empty()) << checkpoint;
    EXPECT_TRUE(torch::allclose(model->forward(x), expected, 1e-6, 1e-6)) << checkpoint;
  }
  // float16 but for the modules kept in float32: "4" names 4.weight and 4.bias; "2.weigh" names
  // nothing (a name must be the module's or contain "<module>.").
  auto half = make_mlp();
  acc::load_checkpoint_in_model(*half, sharded.str(), {.dtype = torch::kHalf, .keep_in_fp32_modules = {"4", "2.weigh"}});
  EXPECT_EQ(half[4]->as<torch::nn::Linear>()->weight.scalar_type(), torch::kFloat);
  EXPECT_EQ(half[4]->as<torch::nn::Linear>()->bias.scalar_type(), torch::kFloat);
  EXPECT_EQ(half[2]->as<torch::nn::Linear>()->weight.scalar_type(), torch::kHalf);
  EXPECT_EQ(half[0]->as<torch::nn::Linear>()->weight.scalar_type(), torch::kHalf);
  EXPECT_TRUE(torch::equal(half[4]->as<torch::nn::Linear>()->weight, plain[4]->as<torch::nn::Linear>()->weight));
  // Only float16 keeps them (upstream's rule): bfloat16 converts every floating-point weight.
  auto bf16 = make_mlp();
  acc::load_checkpoint_in_model(*bf16, sharded.str(), {.dtype = torch::kBFloat16, .keep_in_fp32_modules = {"4"}});
  EXPECT_EQ(bf16[4]->as<torch::nn::Linear>()->weight.scalar_type(), torch::kBFloat16);

  // Dispatched with a layer on the disk: a pickled file's weights are written to the offload
  // folder (nothing to point into), in the dtype asked for, kept float32 where asked.
  auto model = acc::init_empty_weights(make_mlp);
  model->eval();
  acc::load_checkpoint_and_dispatch(
      *model, sharded.str(),
      {.device_map = map({{"0", "cpu"}, {"1", "cpu"}, {"2", "disk"}, {"3", "cpu"}, {"4", "disk"}}),
       .offload_folder = offload.str(),
       .dtype = torch::kHalf,
       .keep_in_fp32_modules = {"4"}});
  const auto offloaded = acc::load_offload_index(offload.str());
  EXPECT_TRUE(offloaded.at("2.weight").safetensors_file.empty());
  EXPECT_TRUE(fs::is_regular_file(offload.path() / "2.weight.dat"));
  EXPECT_EQ(offloaded.at("2.weight").dtype, "float16");
  EXPECT_EQ(offloaded.at("4.weight").dtype, "float32");
  EXPECT_EQ(model[0]->as<torch::nn::Linear>()->weight.scalar_type(), torch::kHalf);
}

TEST(BigModeling, LoadStateDictWithDeviceMap) {
  TempDir dir;
  auto model = make_mlp();
  acc::save_state_dict_sharded(acc::get_state_dict(*model), dir.str());
  auto loaded = acc::load_state_dict((dir.path() / "model.safetensors").string(), map({{"0", "cpu"}, {"2", "disk"}}));
  EXPECT_EQ(loaded.size(), 11u);
  EXPECT_TRUE(torch::equal(loaded.at("2.weight"), model[2]->as<torch::nn::Linear>()->weight));
  EXPECT_EQ(loaded.at("2.weight").device(), torch::Device(torch::kCPU));
}

TEST(BigModeling, MisusesAreRefusedByName) {
  // A tie shared by an offloaded and a resident module.
  ModelForTest tied;
  Retie::tie(*tied->linear1, "weight", tied->linear2->weight);
  TempDir offload;
  EXPECT_THROWS_WITH(acc::dispatch_model(*tied, map({{"linear1", "cpu"}, {"batchnorm", "cpu"}, {"linear2", "disk"}}),
                                         {.offload_dir = offload.str()}),
                     "are split between offloaded and resident modules");
  // A checkpoint whose shapes differ from the model's, loaded into a device map.
  TempDir ckpt;
  acc::save_state_dict_sharded(acc::get_state_dict(*torch::nn::Sequential(torch::nn::Linear(3, 3))), ckpt.str());
  auto model = acc::init_empty_weights([] { return torch::nn::Sequential(torch::nn::Linear(2, 3)); });
  EXPECT_THROWS_WITH(acc::load_checkpoint_in_model(*model, ckpt.str(), map({{"", "cpu"}})),
                     "size mismatch for 0.weight");
  // A device map that leaves out a module whose weights the checkpoint holds.
  TempDir two;
  acc::save_state_dict_sharded(
      acc::get_state_dict(*torch::nn::Sequential(torch::nn::Linear(2, 2), torch::nn::Linear(2, 2))), two.str());
  auto pair =
      acc::init_empty_weights([] { return torch::nn::Sequential(torch::nn::Linear(2, 2), torch::nn::Linear(2, 2)); });
  EXPECT_THROWS_WITH(acc::load_checkpoint_in_model(*pair, two.str(), map({{"0", "cpu"}})),
                     "The device_map provided does not give any device for the following parameters: 1.weight, "
                     "1.bias");
  // A sharded checkpoint whose index is not JSON.
  TempDir broken;
  acc::save_state_dict_sharded(acc::get_state_dict(*torch::nn::Sequential(torch::nn::Linear(64, 64))), broken.str(),
                               "8KB");
  const auto index = broken.path() / "model.safetensors.index.json";
  ASSERT_TRUE(fs::exists(index));
  std::ofstream(index) << "{\"weight_map\": ";
  auto small = acc::init_empty_weights([] { return torch::nn::Sequential(torch::nn::Linear(64, 64)); });
  EXPECT_THROWS_WITH(acc::load_checkpoint_in_model(*small, broken.str(), map({{"", "cpu"}})),
                     "the index " + index.string() + " is not valid JSON");
  // Hooks: a null member of a sequence, and an offload map without a weight the module has.
  EXPECT_THROWS_WITH(acc::SequentialHook({nullptr}), "a hook is null");
  torch::nn::Linear lin(2, 2);
  acc::AlignDevicesOptions options;
  options.offload = true;
  options.weights_map = std::make_shared<acc::OffloadedWeightsLoader>(acc::TensorMap{{"weight", torch::ones({2, 2})}});
  EXPECT_THROWS_WITH(acc::add_hook_to_module(*lin, std::make_shared<acc::AlignDevicesHook>(options)),
                     "the weights map has no 'bias'");
}
