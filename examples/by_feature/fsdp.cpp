// Fully sharded data parallelism (upstream: `fsdp_plugin` and examples/by_feature/fsdp_with_peak_mem_tracking.py):
// every process keeps only its rows of each parameter, of its gradient and of the optimizer's
// state; each Linear layer is gathered whole just for its forward and backward, and its gradients
// are reduce-scattered as soon as its backward is done. The checkpoint is sharded too: every
// process writes its own rows, and the job can resume on another number of processes.
//
//   accelerate launch -n 2 fsdp --output_dir fsdp_output
//   accelerate launch -n 2 --fsdp_sharding_strategy SHARD_GRAD_OP fsdp   # the launcher's flags fill
//                                                                         # what the code leaves empty
//   accelerate launch -n 4 --use_fsdp --parallelism_config_dp_replicate_size 2 fsdp
//                                     # hybrid: two replicas, each sharded over two processes
//   accelerate launch -n 2 --fsdp_activation_checkpointing true fsdp
//                                     # each unit's forward runs again in the backward pass
#include "task.h"

#include <iostream>

namespace acc = accelerate;

int main(int argc, char** argv) {
  acc::set_seed(42);
  const std::string output_dir = task::flag(argc, argv, "--output_dir", "fsdp_output");
  // New Code //
  acc::Accelerator accelerator(
      {.fsdp_plugin = acc::FullyShardedDataParallelPlugin{
           .auto_wrap_policy = acc::FsdpAutoWrapPolicy::kTransformerBasedWrap,
           .transformer_cls_names_to_wrap = {"Linear"},  // each torch::nn::Linear is a unit
           .state_dict_type = acc::FsdpStateDictType::kShardedStateDict}});
  // End New Code //
  task::MLP net;
  int64_t whole = 0;
  for (const auto& p : net->parameters()) whole += p.numel();
  auto optimizer = std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(1e-2));
  acc::DataLoader train_data(task::spirals(2048, 1), {.batch_size = 16, .shuffle = true});
  acc::DataLoader eval_data(task::spirals(512, 2), {.batch_size = 64});
  auto [model, opt, train, eval] = accelerator.prepare(net, optimizer, train_data, eval_data);
  // New Code //
  // The module's parameters now hold this process's rows only.
  int64_t mine = 0;
  for (const auto& p : net->parameters()) mine += p.numel();
  std::cout << "process " << accelerator.process_index() << " holds " << mine << " of " << whole << " parameters"
            << std::endl;
  // End New Code //

  for (int epoch = 0; epoch < 8; ++epoch) {
    for (auto& batch : train) {
      auto loss = torch::nn::functional::cross_entropy(model(batch.data), batch.target);
      accelerator.backward(loss);
      accelerator.clip_grad_norm_(net->parameters(), 1.0);  // the norm over every process's rows
      opt.step();
      opt.zero_grad();
    }
    accelerator.print("epoch", epoch, "accuracy", task::accuracy(accelerator, model, eval));
  }
  // New Code //
  accelerator.save_state(output_dir + "/checkpoint");  // pytorch_model_fsdp_0/, optimizer_0/: one file per process
  accelerator.save_model(model, output_dir + "/model");  // the whole model, gathered
  // End New Code //
  return 0;
}
