// The device-generic paths on the stand-in accelerator (tests/stand_in/device.h): what the GPU
// tier checks on CUDA, checked on every run without a GPU. The process's Accelerator takes the
// stand-in as its device (Note [Accelerators other than CUDA] in src/detail/accelerator_device.h).
#include "accelerate/accelerate.h"
#include "accelerate/big_modeling.h"
#include "stand_in/device.h"
#include "support/accelerators.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <limits>

namespace accelerate::testing {
namespace stand_in_test {

// Installed before main(), hence before any backward pass (autograd counts devices once).
const bool kInstalled = (stand_in::install(), true);

bool on_stand_in(const at::Tensor& t, int index = 0) { return t.device() == stand_in::device(index); }

torch::nn::Sequential make_mlp() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 16),
                               torch::nn::ReLU(), torch::nn::Linear(16, 4));
}

at::Tensor weight_of(torch::nn::Sequential& model, size_t index) {
  return model[index]->as<torch::nn::Linear>()->weight;
}

// ---- the stand-in itself ---------------------------------------------------------------------

TEST(StandInDevice, HostCodeCannotTouchItsMemoryAndKernelsRefuseTensorsOfTwoDevices) {
  ASSERT_TRUE(kInstalled);
  const auto t = torch::arange(4, torch::kFloat).to(stand_in::device());
  EXPECT_TRUE(on_stand_in(t));
  EXPECT_TRUE(torch::equal((t * 2).cpu(), torch::tensor({0.f, 2.f, 4.f, 6.f})));
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH((void)*static_cast<volatile float*>(t.data_ptr()), "")
      << "host code read the stand-in's memory: a GPU would not let it";
  EXPECT_THROWS_WITH((void)(t + torch::ones({4})), "Expected all tensors to be on the same device");
  // A CPU scalar may be read by a kernel of the device, as on CUDA, but not written.
  EXPECT_TRUE(torch::equal((t * torch::tensor(3.f)).cpu(), torch::tensor({0.f, 3.f, 6.f, 9.f})));
  auto cpu_scalar = torch::zeros({});
  EXPECT_THROWS_WITH(cpu_scalar.add_(t.sum()), "Expected all tensors to be on the same device");
  // Views share the device's storage.
  auto u = torch::zeros({2, 3}, stand_in::device());
  u.select(0, 1).fill_(5);
  EXPECT_TRUE(torch::equal(u.cpu(), torch::tensor({{0.f, 0.f, 0.f}, {5.f, 5.f, 5.f}})));
}

TEST(StandInDevice, RandomDrawsOnItComeFromItsOwnGenerator) {
  torch::manual_seed(3);
  auto generator = stand_in::default_generator(0);
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_current_seed(11);
  }
  const auto first = torch::randn({8}, stand_in::device());
  torch::manual_seed(3);  // the CPU's generator does not decide the device's draws
  const auto second = torch::randn({8}, stand_in::device());
  EXPECT_FALSE(torch::equal(first.cpu(), second.cpu()));
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_current_seed(11);
  }
  EXPECT_TRUE(torch::equal(torch::randn({8}, stand_in::device()).cpu(), first.cpu()));
}

// ---- the accelerator and prepare -------------------------------------------------------------

TEST(StandInAccelerator, ThePartialStateTakesTheStandInAndCpuTrueTakesTheCpu) {
  EXPECT_EQ(PartialState::standalone({}).device(), stand_in::device(0));
  run_accelerators(1, [](const Accelerator& acc, int) { EXPECT_EQ(acc.device(), stand_in::device(0)); });
  run_accelerators(1, [](const Accelerator& acc, int) { EXPECT_TRUE(acc.device().is_cpu()); },
                   AcceleratorOptions{.cpu = true});
}

TEST(StandInAccelerator, SetDeviceMakesTheProcessDeviceTheCurrentOneAsTheStateDoesWhenMade) {
  const auto* guard = c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1);
  guard->setDevice(stand_in::device(1));
  const auto state = PartialState::standalone({});
  ASSERT_EQ(state.device(), stand_in::device(0));
  EXPECT_EQ(guard->getDevice(), stand_in::device(0)) << "making the state sets its device";
  guard->setDevice(stand_in::device(1));
  state.set_device();
  EXPECT_EQ(guard->getDevice(), stand_in::device(0));
  const auto accelerator_state = AcceleratorState::standalone(AcceleratorStateOptions{});
  guard->setDevice(stand_in::device(1));
  accelerator_state.set_device();
  EXPECT_EQ(guard->getDevice(), stand_in::device(0));
}

TEST(StandInAccelerator, AJobOfSeveralProcessesOnItIsRefusedNamingTheDevice) {
  EXPECT_THROWS_WITH(run_accelerators(2, [](const Accelerator&, int) {}), "cannot run on privateuseone:");
}

TEST(StandInAccelerator, PrepareMovesTheModelItsOptimizerStateAndTheBatchesAndATrainingStepRunsThere) {
  run_accelerators(1, [](const Accelerator& acc, int) {
    torch::manual_seed(0);
    torch::nn::Linear net(3, 1);
    auto adam = std::make_shared<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(0.1));
    torch::mse_loss(net(torch::randn({4, 3})), torch::zeros({4, 1})).backward();
    adam->step();  // Adam's state is now on the CPU, as when resuming
    DataLoader loader(std::make_shared<TensorDataset>(torch::randn({8, 3}), torch::randn({8, 1})), {.batch_size = 4});
    auto [model, opt, batches] = acc.prepare(net, adam, loader);
    EXPECT_TRUE(on_stand_in(model->weight));
    EXPECT_TRUE(on_stand_in(model->bias));
    ASSERT_FALSE(adam->state().empty());
    for (const auto& [key, state] : adam->state()) {
      const auto& adam_state = static_cast<const torch::optim::AdamParamState&>(*state);
      EXPECT_TRUE(on_stand_in(adam_state.exp_avg())) << "Adam state " << key << " stayed on the CPU";
      EXPECT_TRUE(on_stand_in(adam_state.exp_avg_sq())) << "Adam state " << key << " stayed on the CPU";
    }
    int seen = 0;
    for (auto& batch : batches) {
      EXPECT_TRUE(on_stand_in(batch.data));
      EXPECT_TRUE(on_stand_in(batch.target));
      const auto before = model->weight.detach().cpu();
      opt.zero_grad();
      acc.backward(torch::mse_loss(model(batch.data), batch.target));
      opt.step();
      EXPECT_FALSE(torch::equal(model->weight.detach().cpu(), before)) << "the step changed nothing";
      ++seen;
    }
    EXPECT_EQ(seen, 2);
  });
}

// A model, an Adam stepped once on the CPU (so that it holds state there, as when resuming) and a
// loader of 8 samples in batches of 4: what the device-placement tests prepare.
struct CpuTrainingObjects {
  torch::nn::Linear net{3, 1};
  std::shared_ptr<torch::optim::Adam> adam;
  DataLoader loader;

  CpuTrainingObjects()
      : adam(std::make_shared<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(0.1))),
        loader(std::make_shared<TensorDataset>(torch::randn({8, 3}), torch::randn({8, 1})), {.batch_size = 4}) {
    torch::mse_loss(net(torch::randn({4, 3})), torch::zeros({4, 1})).backward();
    adam->step();
  }
};

// Whether every state tensor of `adam` is on the stand-in (true) or on the CPU (false); fails
// the test when they disagree or there is none.
void expect_adam_state_on_stand_in(const torch::optim::Adam& adam, bool on_device, const std::string& what) {
  ASSERT_FALSE(adam.state().empty()) << what;
  for (const auto& [key, state] : adam.state()) {
    const auto& adam_state = static_cast<const torch::optim::AdamParamState&>(*state);
    for (const auto& t : {adam_state.exp_avg(), adam_state.exp_avg_sq()}) {
      if (on_device) {
        EXPECT_TRUE(on_stand_in(t)) << what << ": Adam state " << key << " is on " << t.device();
      } else {
        EXPECT_TRUE(t.is_cpu()) << what << ": Adam state " << key << " is on " << t.device();
      }
    }
  }
}

TEST(StandInAccelerator, DevicePlacementOffLeavesTheModelItsOptimizerStateAndTheBatchesOnTheCpu) {
  run_accelerators(
      1,
      [](const Accelerator& acc, int) {
        EXPECT_FALSE(acc.device_placement());
        EXPECT_EQ(acc.device(), stand_in::device(0)) << "the process's device is still the stand-in";
        torch::manual_seed(0);
        CpuTrainingObjects objects;
        const auto copies_before = stand_in::copies();
        auto [model, opt, batches] = acc.prepare(objects.net, objects.adam, objects.loader);
        EXPECT_TRUE(model->weight.is_cpu()) << model->weight.device();
        EXPECT_TRUE(model->bias.is_cpu()) << model->bias.device();
        expect_adam_state_on_stand_in(*objects.adam, /*on_device=*/false, "prepare");
        int seen = 0;
        for (auto& batch : batches) {
          EXPECT_TRUE(batch.data.is_cpu()) << batch.data.device();
          EXPECT_TRUE(batch.target.is_cpu()) << batch.target.device();
          // The user places things themselves: a step on the CPU runs.
          const auto before = model->weight.detach().clone();
          opt.zero_grad();
          acc.backward(torch::mse_loss(model(batch.data), batch.target));
          opt.step();
          EXPECT_FALSE(torch::equal(model->weight.detach(), before)) << "the step changed nothing";
          ++seen;
        }
        EXPECT_EQ(seen, 2);
        expect_adam_state_on_stand_in(*objects.adam, /*on_device=*/false, "after training");
        EXPECT_EQ(stand_in::copies(), copies_before) << "something was copied to or from the stand-in";
      },
      AcceleratorOptions{.device_placement = false});
}

TEST(StandInAccelerator, APerObjectDevicePlacementOverridesTheAcceleratorsOptionEitherWay) {
  // The option on (the default), each object asking to stay where it is.
  run_accelerators(1, [](const Accelerator& acc, int) {
    ASSERT_TRUE(acc.device_placement());
    torch::manual_seed(0);
    CpuTrainingObjects kept, placed;
    auto kept_model = acc.prepare_model(kept.net, /*device_placement=*/false);
    acc.prepare_optimizer(kept.adam, /*device_placement=*/false);
    auto kept_batches = acc.prepare_data_loader(kept.loader, /*device_placement=*/false);
    EXPECT_TRUE(kept_model->weight.is_cpu()) << kept_model->weight.device();
    expect_adam_state_on_stand_in(*kept.adam, /*on_device=*/false, "device_placement=false");
    for (auto& batch : kept_batches) EXPECT_TRUE(batch.data.is_cpu()) << batch.data.device();
    // Objects that say nothing follow the option.
    auto [model, opt, batches] = acc.prepare(placed.net, placed.adam, placed.loader);
    EXPECT_TRUE(on_stand_in(model->weight));
    expect_adam_state_on_stand_in(*placed.adam, /*on_device=*/true, "the option");
    for (auto& batch : batches) EXPECT_TRUE(on_stand_in(batch.data));
  });
  // The option off, each object asking to be placed.
  run_accelerators(
      1,
      [](const Accelerator& acc, int) {
        ASSERT_FALSE(acc.device_placement());
        torch::manual_seed(0);
        CpuTrainingObjects placed, kept;
        auto placed_model = acc.prepare_model(placed.net, /*device_placement=*/true);
        acc.prepare_optimizer(placed.adam, /*device_placement=*/true);
        auto placed_batches = acc.prepare_data_loader(placed.loader, /*device_placement=*/true);
        EXPECT_TRUE(on_stand_in(placed_model->weight)) << placed_model->weight.device();
        EXPECT_TRUE(on_stand_in(placed_model->bias)) << placed_model->bias.device();
        expect_adam_state_on_stand_in(*placed.adam, /*on_device=*/true, "device_placement=true");
        for (auto& batch : placed_batches) {
          EXPECT_TRUE(on_stand_in(batch.data)) << batch.data.device();
          EXPECT_TRUE(on_stand_in(batch.target)) << batch.target.device();
        }
        auto [model, opt, batches] = acc.prepare(kept.net, kept.adam, kept.loader);
        EXPECT_TRUE(model->weight.is_cpu());
        expect_adam_state_on_stand_in(*kept.adam, /*on_device=*/false, "the option");
        for (auto& batch : batches) EXPECT_TRUE(batch.data.is_cpu());
      },
      AcceleratorOptions{.device_placement = false});
}

TEST(StandInOperations, SendToDeviceMovesEveryTensorOfNestedDataExceptSkippedKeys) {
  std::map<std::string, at::Tensor> batch{{"x", torch::ones({2})}, {"keep", torch::zeros({1})}};
  const auto moved = send_to_device(batch, stand_in::device(1), false, {"keep"});
  EXPECT_TRUE(on_stand_in(moved.at("x"), 1));
  EXPECT_TRUE(moved.at("keep").is_cpu());
  const auto back = send_to_device(std::vector<at::Tensor>{moved.at("x")}, c10::Device(c10::kCPU));
  EXPECT_TRUE(torch::equal(back[0], torch::ones({2})));
}

// ---- device maps and dispatch ----------------------------------------------------------------

TEST(StandInDispatch, IntegersOfADeviceMapNameTheStandInAndTheDispatchedModelComputesWhatTheCpuModelComputes) {
  auto plain = make_mlp();
  const auto x = torch::randn({5, 8});
  const auto expected = plain->forward(x);
  auto model = make_mlp();
  dispatch_model(*model, DeviceMap{{"0", 0}, {"2", "cpu"}, {"4", 1}});
  EXPECT_TRUE(on_stand_in(weight_of(model, 0), 0));
  EXPECT_TRUE(on_stand_in(weight_of(model, 4), 1));
  EXPECT_TRUE(weight_of(model, 2).is_meta()) << "the \"cpu\" layer is offloaded behind the stand-in";
  const auto out = forward(model, x);
  EXPECT_TRUE(out.is_cpu()) << "outputs go back to the device of the inputs, got " << out.device();
  EXPECT_TRUE(torch::allclose(out, expected, 1e-5, 1e-6));
  const auto out_device = forward(model, x.to(stand_in::device(0)));
  EXPECT_TRUE(on_stand_in(out_device, 0));
  EXPECT_TRUE(torch::allclose(out_device.cpu(), expected, 1e-5, 1e-6));
}

TEST(StandInDispatch, LoadCheckpointAndDispatchMaterialisesLayersOnTheStandInAndOffloadsTheRest) {
  auto plain = make_mlp();
  const auto x = torch::randn({4, 8});
  const auto expected = plain->forward(x);
  TempDir checkpoint, offload;
  save_state_dict_sharded(get_state_dict(*plain), checkpoint.str());
  auto model = init_empty_weights(make_mlp);
  load_checkpoint_and_dispatch(
      *model, checkpoint.str(),
      {.device_map = DeviceMap{{"0", 0}, {"2", "disk"}, {"4", "cpu"}}, .offload_folder = offload.str()});
  EXPECT_TRUE(on_stand_in(weight_of(model, 0)));
  EXPECT_TRUE(torch::equal(weight_of(model, 0).cpu(), weight_of(plain, 0)));
  EXPECT_TRUE(weight_of(model, 2).is_meta());
  EXPECT_TRUE(weight_of(model, 4).is_meta());
  EXPECT_TRUE(torch::allclose(forward(model, x), expected, 1e-5, 1e-6));
}

TEST(StandInDispatch, InferAutoDeviceMapFillsTheStandInsBudgetsBeforeTheCpu) {
  auto model = make_mlp();
  // Layers of 576, 1088 and 272 bytes; each device keeps room for the largest (1088), as upstream.
  const auto map = infer_auto_device_map(*model, {.max_memory = MaxMemory{{0, 1800}, {1, 2400}, {"cpu", 1 << 20}}});
  ASSERT_EQ(map.count("0"), 1u) << "no place for the first layer";
  EXPECT_EQ(map.at("0").str(), "0");
  auto placed = make_mlp();
  dispatch_model(*placed, map);
  bool any_on_second = false;
  for (const auto& p : placed->parameters()) any_on_second = any_on_second || on_stand_in(p, 1);
  EXPECT_TRUE(any_on_second) << "nothing went to the second stand-in device";
}

// ---- loading weights -------------------------------------------------------------------------

TEST(StandInCheckpoint, LoadCheckpointInModelCopiesTheFileIntoAModelOnTheStandIn) {
  auto source = make_mlp();
  TempDir dir;
  TensorMap weights;
  for (const auto& item : get_state_dict(*source)) weights.emplace(item.key(), item.value());
  save_file(weights, dir.str() + "/model.safetensors");
  torch::manual_seed(5);
  auto model = torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 16),
                                     torch::nn::ReLU(), torch::nn::Linear(16, 4));
  model->to(stand_in::device());
  load_checkpoint_in_model(*model, dir.str(), LoadCheckpointOptions{.strict = true});
  for (size_t i : {0, 2, 4}) {
    EXPECT_TRUE(on_stand_in(weight_of(model, i))) << "layer " << i << " left the device";
    EXPECT_TRUE(torch::equal(weight_of(model, i).cpu(), weight_of(source, i))) << "layer " << i;
  }
  // Converting dtypes on the way.
  load_checkpoint_in_model(*model, dir.str(), LoadCheckpointOptions{.dtype = torch::kDouble});
  EXPECT_EQ(weight_of(model, 0).scalar_type(), torch::kDouble);
  EXPECT_TRUE(on_stand_in(weight_of(model, 0)));
  EXPECT_TRUE(torch::equal(weight_of(model, 0).cpu(), weight_of(source, 0).to(torch::kDouble)));
}

TEST(StandInCheckpoint, SaveStateAndLoadStateRestoreAModelAndItsOptimizerOnTheStandIn) {
  TempDir dir;
  run_accelerators(1, [&](const Accelerator& acc, int) {
    torch::manual_seed(0);
    torch::nn::Linear net(4, 2);
    auto adam = std::make_shared<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(0.05));
    auto [model, opt] = acc.prepare(net, adam);
    auto step = [&] {
      opt.zero_grad();
      acc.backward(model(torch::randn({3, 4}, acc.device())).pow(2).mean());
      opt.step();
    };
    step();
    const std::string folder = acc.save_state((dir.path() / "ckpt").string());
    const auto saved_weight = model->weight.detach().cpu();
    std::vector<at::Tensor> saved_moments;
    for (const auto& [key, state] : adam->state()) {
      saved_moments.push_back(static_cast<const torch::optim::AdamParamState&>(*state).exp_avg().cpu());
    }
    step();
    step();
    ASSERT_FALSE(torch::equal(model->weight.detach().cpu(), saved_weight));

    acc.load_state(folder);
    EXPECT_TRUE(on_stand_in(model->weight)) << "load_state moved the model off its device";
    EXPECT_TRUE(torch::equal(model->weight.detach().cpu(), saved_weight));
    size_t i = 0;
    for (const auto& [key, state] : adam->state()) {
      const auto& moment = static_cast<const torch::optim::AdamParamState&>(*state).exp_avg();
      EXPECT_TRUE(on_stand_in(moment)) << "Adam state " << key << " was loaded off the device";
      ASSERT_LT(i, saved_moments.size());
      EXPECT_TRUE(torch::equal(moment.cpu(), saved_moments[i++])) << "Adam state " << key;
    }
    step();  // training goes on from the restored state
  });
}

// Per-device generator states: LibTorch 2.x asks the backend's hooks for its generators; 1.13
// has no way to reach a PrivateUse1 backend's generator (docs/design.md), so only CUDA's are saved.
TEST(StandInCheckpoint, LoadStateRestoresTheDrawsOfTheStandInGeneratorsWhereLibTorchReachesThem) {
  TempDir dir;
  run_accelerators(1, [&](const Accelerator& acc, int) {
    torch::nn::Linear net(2, 1);
    auto model = acc.prepare(net);
    (void)torch::randn({3}, acc.device());
    const std::string folder = acc.save_state((dir.path() / "ckpt").string());
    const auto first = torch::randn({16}, acc.device()).cpu();
    const auto first_second_device = torch::randn({4}, stand_in::device(1)).cpu();
    const auto first_cpu = torch::rand({4});
    ASSERT_FALSE(torch::equal(torch::randn({16}, acc.device()).cpu(), first));
    acc.load_state(folder);
    const auto states = load_file(folder + "/random_states_0.safetensors");
    EXPECT_EQ(states.count("torch_manual_seed"), 1u);
    EXPECT_TRUE(torch::equal(torch::rand({4}), first_cpu));
#if TORCH_VERSION_MAJOR >= 2
    EXPECT_EQ(states.count("torch_privateuseone_manual_seed.0"), 1u);
    EXPECT_EQ(states.count("torch_privateuseone_manual_seed.1"), 1u);
    EXPECT_TRUE(torch::equal(torch::randn({16}, acc.device()).cpu(), first))
        << "the device's draws after load_state differ from those after save_state";
    EXPECT_TRUE(torch::equal(torch::randn({4}, stand_in::device(1)).cpu(), first_second_device));
#else
    EXPECT_EQ(states.count("torch_privateuseone_manual_seed.0"), 0u) << "LibTorch 1.13 cannot reach it";
    (void)first_second_device;
#endif
  });
}

// ---- the loss scaler -------------------------------------------------------------------------

TEST(StandInGradScaler, UnscalesGradientsSpreadOverTheCpuAndTheStandInAndFindsAnInfOnEither) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  for (const bool inf_on_device : {false, true}) {
    // The CPU's parameter comes first in the optimizer, then the device's.
    auto cpu = torch::ones({2}).requires_grad_(true);
    auto device = torch::ones({3}, stand_in::device()).requires_grad_(true);
    torch::optim::SGD sgd(std::vector<at::Tensor>{cpu, device}, 0.5);
    GradScaler scaler({.init_scale = 4.0});
    cpu.mutable_grad() = torch::tensor({4.f, 8.f});
    device.mutable_grad() = torch::tensor({4.f, inf_on_device ? kInf : 4.f, 8.f}).to(stand_in::device());
    scaler.unscale_(sgd);
    EXPECT_TRUE(torch::equal(cpu.grad(), torch::tensor({1.f, 2.f})));
    EXPECT_TRUE(on_stand_in(device.grad()));
    EXPECT_EQ(device.grad().cpu()[0].item<float>(), 1.f);
    EXPECT_EQ(scaler.step(sgd), !inf_on_device) << (inf_on_device ? "stepped over an inf" : "skipped a clean step");
    if (!inf_on_device) {
      EXPECT_TRUE(torch::allclose(device.detach().cpu(), torch::tensor({0.5f, 0.5f, 0.0f})));
    }
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), inf_on_device ? 2.0 : 4.0);
  }
}

}  // namespace stand_in_test
}  // namespace accelerate::testing
