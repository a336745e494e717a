// Running a model larger than the memory given to it (upstream: the big-model-inference guide):
// the model is built on the meta device, a device map puts as many blocks as the CPU budget
// allows in memory and the rest on the disk, the checkpoint is loaded straight into that
// placement, and each offloaded block's weights are read in just before it runs.
//
//   big_model_inference --work_dir /tmp/big --max_cpu_memory 6MB
//
// The program first writes a sharded checkpoint of a small residual network (and its in-memory
// output for reference), then runs the offloaded model and compares.
#include "task.h"

#include <accelerate/big_modeling.h>

#include <filesystem>
#include <iostream>

namespace acc = accelerate;

namespace {

// A residual block: never split across devices (its forward adds its input back).
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t width) {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
    up = register_module("up", torch::nn::Linear(width, 4 * width));
    down = register_module("down", torch::nn::Linear(4 * width, width));
  }
  torch::Tensor forward(torch::Tensor x) {
    // New Code //
    // Children are called through accelerate::forward so that their hooks run.
    auto h = acc::forward(norm, x);
    h = torch::gelu(acc::forward(up, h));
    return x + acc::forward(down, h);
    // End New Code //
  }
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear up{nullptr}, down{nullptr};
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl(int64_t vocab, int64_t width, int64_t layers) {
    embed = register_module("embed", torch::nn::Embedding(vocab, width));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < layers; ++i) blocks->push_back(Block(width));
    head = register_module("head", torch::nn::Linear(width, vocab));
  }
  torch::Tensor forward(torch::Tensor tokens) {
    auto x = acc::forward(embed, tokens);
    for (const auto& block : *blocks) x = acc::forward(block->as<BlockImpl>(), x);
    return acc::forward(head, x);
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::filesystem::path work = task::flag(argc, argv, "--work_dir", "big_model_inference");
    const std::string budget = task::flag(argc, argv, "--max_cpu_memory", "6MB");
    const int64_t layers = std::stoll(task::flag(argc, argv, "--n_layer", "8"));
    const int64_t width = std::stoll(task::flag(argc, argv, "--n_embd", "256"));
    const int64_t vocab = 512;
    auto build = [&] { return Net(vocab, width, layers); };
    torch::NoGradGuard no_grad;

    torch::manual_seed(0);
    const auto tokens = torch::randint(vocab, {4, 32});
    torch::Tensor expected;
    {
      torch::manual_seed(1);
      auto model = build();
      expected = model->forward(tokens);
      acc::save_state_dict_sharded(acc::get_state_dict(*model), (work / "checkpoint").string(), "2MB");
    }

    // New Code //
    auto model = acc::init_empty_weights(build);
    const auto sizes = acc::calculate_maximum_sizes(*model, {"Block"});
    std::cout << "model size " << sizes.total_size << " bytes, largest layer " << sizes.largest_layer_size
              << " bytes, CPU budget " << budget << "\n";
    const auto device_map = acc::infer_auto_device_map(
        *model, {.max_memory = acc::MaxMemory{{"cpu", budget}}, .no_split_module_classes = {"Block"}});
    for (const auto& [name, device] : device_map) std::cout << "device_map " << name << ": " << device << "\n";
    acc::load_checkpoint_and_dispatch(*model, (work / "checkpoint").string(),
                                      {.device_map = device_map, .offload_folder = (work / "offload").string()});
    const auto logits = acc::forward(model, tokens);
    // End New Code //

    const double diff = (logits - expected).abs().max().item<double>();
    std::cout << "max abs difference from the in-memory model: " << diff << "\n";
    std::cout << "matches: " << (diff < 1e-4 ? "yes" : "no") << "\n";
    return diff < 1e-4 ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "big_model_inference: " << e.what() << "\n";
    return 1;
  }
}
