// Tensor parallelism (upstream: `ParallelismConfig(tp_size=...)` with a model that carries a
// `tp_plan`): each hidden layer of the MLP is split over the processes of a tensor-parallel
// group — the first by its output features ("colwise"), the second by its input features
// ("rowwise", the partial outputs summed) — so each process holds about half of those weights and
// of their optimizer state. The other dimensions of the mesh compose with it: data parallelism
// runs over the processes that share a tensor-parallel rank.
//
//   accelerate launch -n 2 --parallelism_config_tp_size 2 tensor_parallel --output_dir tp_output
//   accelerate launch -n 4 --parallelism_config_tp_size 2 --parallelism_config_dp_shard_size 2 tensor_parallel
//                                     # 2-D: each half-layer is also fully sharded over two processes
#include "task.h"

#include <iostream>

namespace acc = accelerate;

namespace {

// New Code //
// Members declared with accelerate::nn's holders run their hooks when called as `fc(x)`; the
// class carries its own plan, by module name.
struct SplitMLPImpl : torch::nn::Module, acc::nn::TensorParallelPlanned {
  SplitMLPImpl()
      : fc1(register_module("fc1", acc::nn::Linear(2, 64))), fc2(register_module("fc2", acc::nn::Linear(64, 64))),
        fc3(register_module("fc3", acc::nn::Linear(64, 64))), fc4(register_module("fc4", acc::nn::Linear(64, 2))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(fc1(x));
    return fc4(torch::relu(fc3(torch::relu(fc2(h)))));  // fc2's sharded output feeds fc3 directly
  }
  std::vector<std::pair<std::string, std::string>> tp_plan() const override {
    return {{"fc2", "colwise"}, {"fc3", "rowwise"}};
  }
  acc::nn::Linear fc1, fc2, fc3, fc4;
};
// End New Code //

}  // namespace

int main(int argc, char** argv) {
  acc::set_seed(42);
  const std::string output_dir = task::flag(argc, argv, "--output_dir", "tp_output");
  // New Code //
  // The sizes come from the launcher's --parallelism_config_* flags (PARALLELISM_CONFIG_*); in code:
  // .parallelism_config = acc::ParallelismConfig{.tp_size = 2}.
  acc::Accelerator accelerator;
  const auto mesh = accelerator.torch_device_mesh();
  if (!mesh || mesh->size("tp") < 2) {
    std::cerr << "tensor_parallel: launch with --parallelism_config_tp_size 2 (or more)" << std::endl;
    return 2;
  }
  // End New Code //
  auto net = std::make_shared<SplitMLPImpl>();
  int64_t whole = 0;
  for (const auto& p : net->parameters()) whole += p.numel();
  auto optimizer = std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(1e-2));
  acc::DataLoader train_data(task::spirals(2048, 1), {.batch_size = 16, .shuffle = true});
  acc::DataLoader eval_data(task::spirals(512, 2), {.batch_size = 64});
  auto [model, opt, train, eval] = accelerator.prepare(net, optimizer, train_data, eval_data);
  // New Code //
  int64_t mine = 0;
  for (const auto& p : net->parameters()) mine += p.numel();
  std::cout << "process " << accelerator.process_index() << " (tp rank " << mesh->get_local_rank("tp")
            << ", dp rank " << mesh->get_local_rank("dp") << ") holds " << mine << " of " << whole << " parameters"
            << std::endl;
  // End New Code //

  for (int epoch = 0; epoch < 8; ++epoch) {
    for (auto& batch : train) {  // every process of a tp group reads the same batch
      auto loss = torch::nn::functional::cross_entropy(model(batch.data), batch.target);
      accelerator.backward(loss);
      accelerator.clip_grad_norm_(net->parameters(), 1.0);  // the norm of the whole model
      opt.step();
      opt.zero_grad();
    }
    accelerator.print("epoch", epoch, "accuracy", task::accuracy(accelerator, model, eval));
  }
  // New Code //
  accelerator.save_model(model, output_dir + "/model");  // whole weights, gathered over the group
  // End New Code //
  return 0;
}
