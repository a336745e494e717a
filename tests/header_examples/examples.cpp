// The banner examples of the public headers, compiled by check.cmake (CTest:
// compile.header_banner_examples). Each example is pasted, as written in its header, into a
// function whose parameters and the declarations around it give the names the example takes for
// granted; the examples themselves are never edited here.
#include "accelerate/accelerate.h"

#include <torch/torch.h>

#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

namespace {

// The user's model of most examples.
struct NetImpl : torch::nn::Module {
  NetImpl() : fc(register_module("fc", torch::nn::Linear(4, 1))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc(x); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Net);
using Model = Net;

struct GPTImpl : torch::nn::Module {
  explicit GPTImpl(int64_t vocabulary) : head(register_module("head", torch::nn::Linear(vocabulary, vocabulary))) {}
  torch::Tensor forward(const torch::Tensor& tokens) { return head(tokens); }
  torch::nn::Linear head;
};
TORCH_MODULE(GPT);

double fit(Model&, int64_t) { return 0.0; }
double train_step(int64_t) { return 0.0; }
at::Tensor train_step(const accelerate::Example& batch) { return batch.data; }
void step(const at::Tensor&, const at::Tensor&) {}
void download_dataset() {}
void use(const at::Tensor&) {}

}  // namespace

// utils/tensor_tree.h declares a specialisation, which belongs at namespace scope.
#include "accelerate/utils/tensor_tree.h.inc"

// nn.h's example declares a module class.
namespace nn_example {
#include "accelerate/nn.h.inc"
}  // namespace nn_example

namespace examples {

void accelerator(Net net, std::shared_ptr<torch::optim::SGD> sgd, accelerate::DataLoader data) {
#include "accelerate/accelerator.h.inc"
}

void parallelism_config() {
#include "accelerate/parallelism_config.h.inc"
}

void context_parallel(accelerate::Accelerator accelerator, accelerate::PreparedModel<GPT> model,
                      accelerate::Example batch) {
#include "accelerate/context_parallel.h.inc"
}

void device_mesh(const accelerate::Accelerator& accelerator, torch::Tensor loss) {
#include "accelerate/device_mesh.h.inc"
}

void attention(torch::Tensor q, torch::Tensor k, torch::Tensor v) {
#include "accelerate/attention.h.inc"
  (void)y;
}

void big_modeling(int64_t config, torch::Tensor tokens) {
#include "accelerate/big_modeling.h.inc"
}

void checkpointing(std::shared_ptr<torch::optim::Adam> adam) {
#include "accelerate/checkpointing.h.inc"
}

void data_loader(torch::Tensor inputs, torch::Tensor labels, accelerate::PartialState state,
                 accelerate::GradientState gradient_state) {
#include "accelerate/data_loader.h.inc"
}

void distributed(accelerate::Accelerator accelerator, torch::Tensor x, torch::Tensor y) {
#include "accelerate/distributed.h.inc"
}

void grad_scaler(torch::Tensor loss, std::shared_ptr<torch::optim::SGD> optimizer) {
#include "accelerate/grad_scaler.h.inc"
}

void local_sgd(accelerate::Accelerator accelerator, accelerate::PreparedModel<Net> model,
               accelerate::AcceleratedOptimizer optimizer, accelerate::DataLoader loader) {
#include "accelerate/local_sgd.h.inc"
}

void logging() {
#include "accelerate/logging.h.inc"
}

void lr_scheduler(Net model, accelerate::DataLoader loader) {
#include "accelerate/lr_scheduler.h.inc"
}

void memory_utils(Model model) {
#include "accelerate/memory_utils.h.inc"
}

void optimizer(accelerate::Accelerator accelerator, Net net, torch::Tensor loss) {
#include "accelerate/optimizer.h.inc"
}

void scheduler(accelerate::Accelerator accelerator, std::shared_ptr<torch::optim::SGD> optimizer) {
#include "accelerate/scheduler.h.inc"
}

void state(std::vector<std::string> prompts) {
#include "accelerate/state.h.inc"
}

void tracking() {
#include "accelerate/tracking.h.inc"
}

void autocast(Net model, torch::Tensor inputs) {
#include "accelerate/utils/autocast.h.inc"
}

void communication(accelerate::Accelerator& accelerator, torch::Tensor loss) {
#include "accelerate/utils/communication.h.inc"
}

void constants(const std::string& folder) {
#include "accelerate/utils/constants.h.inc"
  (void)weights;
}

void device_map(Net model) {
#include "accelerate/utils/device_map.h.inc"
}

void modeling(Net net) {
#include "accelerate/utils/modeling.h.inc"
}

void operations(torch::Tensor predictions, torch::Tensor tokens) {
#include "accelerate/utils/operations.h.inc"
}

void profiler(accelerate::PartialState state, accelerate::Example batch) {
#include "accelerate/utils/profiler.h.inc"
}

void random(at::Generator sampler_generator) {
#include "accelerate/utils/random.h.inc"
}

void safetensors(torch::Tensor w, torch::Tensor b) {
#include "accelerate/utils/safetensors.h.inc"
}

void tqdm(int64_t max_steps) {
#include "accelerate/utils/tqdm.h.inc"
}

}  // namespace examples

int main() { return 0; }
