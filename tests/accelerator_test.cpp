// The Accelerator's process control and collectives, with ranks as threads.
#include "accelerate/accelerator.h"
#include "accelerate/utils/environment.h"
#include "detail/torch_compat.h"
#include "support/accelerators.h"
#include "support/test_support.h"

#include <ATen/ATen.h>
#include <atomic>
#include <csignal>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace accelerate::testing {
namespace accelerator_test {  // not anonymous: its names must not meet another file's in a unity batch

using ::testing::HasSubstr;

// Runs `fn` with an Accelerator per rank, each over its own standalone state.
void run_accelerators(int n, const std::function<void(const Accelerator&)>& fn, AcceleratorOptions base = {}) {
  testing::run_accelerators(n, [&](const Accelerator& acc, int) { fn(acc); }, std::move(base));
}

TEST(Accelerator, ReportsItsTopologyAndMixedPrecision) {
  AcceleratorOptions options;
  options.mixed_precision = "bf16";
  run_accelerators(2, [](const Accelerator& acc) {
    EXPECT_EQ(acc.num_processes(), 2);
    EXPECT_EQ(acc.is_main_process(), acc.process_index() == 0);
    EXPECT_EQ(acc.is_last_process(), acc.process_index() == 1);
    EXPECT_EQ(acc.distributed_type(), DistributedType::kMultiCpu);
    EXPECT_EQ(acc.mixed_precision(), "bf16");
    EXPECT_TRUE(acc.device().is_cpu());
    EXPECT_TRUE(acc.sync_gradients());
  }, options);
}

TEST(Accelerator, NullObjectsToPrepareAndAnUndefinedLossAreRefusedByName) {
  run_accelerators(1, [](const Accelerator& acc) {
    EXPECT_THROWS_WITH(acc.prepare_model(std::shared_ptr<torch::nn::Module>()),
                       "[Accelerator.prepare_model] expected a module, got null");
    EXPECT_THROWS_WITH(acc.prepare_optimizer(nullptr),
                       "[Accelerator.prepare_optimizer] expected an optimizer, got null");
    EXPECT_THROWS_WITH(acc.prepare_scheduler(nullptr),
                       "[Accelerator.prepare_scheduler] expected a scheduler, got null");
    EXPECT_THROWS_WITH(acc.backward(at::Tensor()),
                       "[Accelerator.backward] expected a loss tensor, got an undefined tensor");
  });
}

// Settings that could not work are refused when the Accelerator is built, before any signal's
// handling changes.
TEST(Accelerator, PreemptionSettingsThatCannotWorkAreRefusedByName) {
  const auto refused = [](PreemptionKwargs preemption, ProjectConfiguration project) {
    Store store = Store::in_memory();
    std::string error;
    run_threads(1, [&](int rank) {
      AcceleratorOptions options;
      options.project_config = project;
      options.preemption = preemption;
      options.standalone_state = rank_options(PartialStateOptions{}, rank, 1, store);
      error = error_of([&] { Accelerator acc(options); });
    });
    return error;
  };
  const ProjectConfiguration automatic{.project_dir = "/nonexistent", .automatic_checkpoint_naming = true};
  EXPECT_THAT(refused({.signals = {"SIGTERM", "SIGFOO"}}, automatic),
              HasSubstr("preemption.signals: unknown signal \"SIGFOO\"; the signals that can ask a job to stop are "
                        "SIGTERM, SIGUSR1, SIGUSR2, SIGINT and SIGHUP"));
  EXPECT_THAT(refused({.signals = {}}, automatic), HasSubstr("preemption.signals is empty"));
  {
    Store store = Store::in_memory();
    std::string error;
    run_threads(1, [&](int rank) {
      AcceleratorOptions options;
      options.project_config = automatic;
      options.dataloader_config.even_batches = false;
      options.preemption = PreemptionKwargs{};
      options.standalone_state = rank_options(PartialStateOptions{}, rank, 1, store);
      error = error_of([&] { Accelerator acc(options); });
    });
    EXPECT_THAT(error, HasSubstr("it cannot be used with dataloader_config.even_batches false"));
  }
  EXPECT_THAT(refused({}, {}), HasSubstr("preemption.save_on_preemption saves into the project's next automatic "
                                         "checkpoint: set project_config.automatic_checkpoint_naming and a "
                                         "project_dir"));
}

// The question is a collective whose answer changes once a signal came (here to the whole test
// process, whose ranks are threads; tests/multiprocess/preemption_test.cpp sends one to one
// process of a real job).
TEST(Accelerator, PreemptionRequestedTurnsTrueOnEveryProcessOnceOneOfItsSignalsCame) {
  run_accelerators(2, [](const Accelerator& acc) { EXPECT_FALSE(acc.preemption_requested()); });
  AcceleratorOptions options;
  options.preemption = PreemptionKwargs{.signals = {"USR2"}, .save_on_preemption = false};
  std::atomic<int> asked{0};
  run_accelerators(2, [&](const Accelerator& acc) {
    EXPECT_FALSE(acc.preemption_requested());
    acc.wait_for_everyone();
    if (acc.is_main_process()) std::raise(SIGUSR2);  // handled: the test process goes on
    acc.wait_for_everyone();
    if (acc.preemption_requested()) ++asked;
  }, options);
  EXPECT_EQ(asked.load(), 2);
}

TEST(Accelerator, AStopRequestBeforeAnAcceleratorWasMadeIsNotItsRequest) {
  // A program (or a test suite) that makes a new Accelerator after an earlier one was asked to
  // stop: the new one starts unasked, the earlier one stays asked.
  AcceleratorOptions options;
  options.preemption = PreemptionKwargs{.signals = {"USR2"}, .save_on_preemption = false};
  Accelerator first(options);
  EXPECT_FALSE(first.preemption_requested());
  std::raise(SIGUSR2);
  EXPECT_TRUE(first.preemption_requested());
  Accelerator second(options);
  EXPECT_FALSE(second.preemption_requested());
  EXPECT_TRUE(first.preemption_requested());
  std::raise(SIGUSR2);
  EXPECT_TRUE(second.preemption_requested());
  // A request that came before an Accelerator was made, and that none answered, is its request.
  std::raise(SIGUSR2);
  Accelerator third(options);
  EXPECT_TRUE(third.preemption_requested());
}

TEST(Accelerator, ReduceDefaultsToSumUnlikeTheFreeFunction) {
  run_accelerators(2, [](const Accelerator& acc) {
    auto t = at::full({2}, static_cast<float>(acc.process_index() + 1));
    EXPECT_EQ(acc.reduce(t).sum().item<float>(), 6.0f);      // [3, 3]
    EXPECT_EQ(acc.reduce(t, "mean").sum().item<float>(), 3.0f);
  });
}

TEST(Accelerator, GatherAndPadAcrossProcesses) {
  run_accelerators(2, [](const Accelerator& acc) {
    auto t = at::arange(acc.process_index() + 1, at::kFloat);  // lengths 1 and 2
    auto padded = acc.pad_across_processes(t);
    EXPECT_EQ(padded.size(0), 2);
    EXPECT_EQ(acc.gather(padded).size(0), 4);
  });
}

TEST(Accelerator, GatherForMetricsDropsDuplicatesOnTheLastBatchForTensorsAndValues) {
  run_accelerators(2, [](const Accelerator& acc) {
    const auto& gs = acc.gradient_state();
    gs.set_end_of_dataloader(true);
    gs.set_remainder(3);
    auto tensors = acc.gather_for_metrics(at::full({2}, static_cast<float>(acc.process_index())));
    EXPECT_EQ(tensors.size(0), 3);
    auto labels = acc.gather_for_metrics(std::vector<std::string>{"a" + std::to_string(acc.process_index()), "b"});
    EXPECT_EQ(labels, (std::vector<std::string>{"a0", "b", "a1"}));
    auto as_objects = acc.gather_for_metrics(std::vector<at::Tensor>{at::ones({1})}, /*use_gather_object=*/true);
    EXPECT_EQ(as_objects.size(), 2u);  // one per process, fewer than the remainder
    gs.set_end_of_dataloader(false);
    EXPECT_EQ(acc.gather_for_metrics(at::ones({2})).size(0), 4);  // not the last batch: nothing dropped
  });
}

TEST(Accelerator, GatherRefusesNonTensorValuesNamingTheType) {
  run_accelerators(1, [](const Accelerator& acc) {
    std::pair<at::Tensor, std::string> data{at::ones({1}), "id"};
    EXPECT_THROWS_WITH(acc.gather(data), "[gather] unsupported type (std::__cxx11::basic_string");
    EXPECT_THROWS_WITH(acc.gather_for_metrics(data, /*use_gather_object=*/true), "use_gather_object needs a std::vector");
  });
}

TEST(Accelerator, ProcessControlForwardsToTheState) {
  std::atomic<int> ran{0};
  run_accelerators(2, [&](const Accelerator& acc) {
    acc.on_main_process([&] { ++ran; })();
    auto share = acc.split_between_processes(std::vector<int>{1, 2, 3});
    EXPECT_EQ(share.size(), acc.process_index() == 0 ? 2u : 1u);
    EXPECT_EQ(acc.main_process_first([&] { return acc.process_index() * 10; }), acc.process_index() * 10);
    if (acc.process_index() == 1) acc.set_trigger();
    EXPECT_TRUE(acc.check_trigger());
  });
  EXPECT_EQ(ran.load(), 1);
}

TEST(Accelerator, ABadMixedPrecisionIsRefused) {
  AcceleratorOptions options;
  options.mixed_precision = "fp8";
  EXPECT_THROWS_WITH(run_accelerators(1, [](const Accelerator&) {}, options), "fp8 mixed precision is not supported");
}


// ---- training options, environment and misuse ---------------------------------------------

// Tests of the process-wide accelerator start and end without a process-wide state.
class ProcessWideAccelerator : public ::testing::Test {
 protected:
  void SetUp() override { reset(); }
  void TearDown() override { reset(); }
  static void reset() {
    AcceleratorState::reset();
    GradientState::reset();
  }
};

TEST_F(ProcessWideAccelerator, GradientAccumulationComesFromTheArgumentThePluginOrTheEnvironment) {
  EXPECT_EQ(Accelerator().gradient_accumulation_steps(), 1);
  EXPECT_EQ(Accelerator({.gradient_accumulation_steps = 3}).gradient_accumulation_steps(), 3);
  Accelerator with_plugin({.gradient_accumulation_plugin = GradientAccumulationPlugin{.num_steps = 5,
                                                                                       .sync_each_batch = true}});
  EXPECT_EQ(with_plugin.gradient_accumulation_steps(), 5);
  EXPECT_TRUE(with_plugin.gradient_state().sync_each_batch());
  auto env = patch_environment({{"ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4"}});
  EXPECT_EQ(Accelerator().gradient_accumulation_steps(), 4);
  EXPECT_EQ(Accelerator({.gradient_accumulation_steps = 2}).gradient_accumulation_steps(), 4);  // as upstream
}

TEST_F(ProcessWideAccelerator, BothAccumulationOptionsAreRefused) {
  EXPECT_THROWS_WITH(Accelerator({.gradient_accumulation_steps = 2,
                                  .gradient_accumulation_plugin = GradientAccumulationPlugin{.num_steps = 2}}),
                     "pass either gradient_accumulation_steps or gradient_accumulation_plugin, not both");
  EXPECT_THROWS_WITH(Accelerator({.gradient_accumulation_steps = 0}), "must be at least 1");
  auto env = patch_environment({{"ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "two"}});
  EXPECT_THROWS_WITH(Accelerator(), "ACCELERATE_GRADIENT_ACCUMULATION_STEPS must be an integer, got 'two'");
}

TEST_F(ProcessWideAccelerator, MixedPrecisionComesFromTheEnvironmentWhenNotGiven) {
  {
    auto env = patch_environment({{"ACCELERATE_MIXED_PRECISION", "bf16"}});
    EXPECT_EQ(Accelerator().mixed_precision(), "bf16");
  }
  reset();
  auto env = patch_environment({{"ACCELERATE_MIXED_PRECISION", "bf16"}});
  EXPECT_EQ(Accelerator({.mixed_precision = "no"}).mixed_precision(), "no");
}

TEST_F(ProcessWideAccelerator, Fp16WithoutCudaWarnsAndRunsInFullPrecision) {
  if (Accelerator({.cpu = false}).device().is_cuda()) GTEST_SKIP() << "this machine has CUDA: fp16 is supported";
  reset();
  CapturedLines collect;
  Accelerator accelerator({.mixed_precision = "fp16"});
  EXPECT_EQ(accelerator.mixed_precision(), "no");
  EXPECT_FALSE(accelerator.scaler().has_value());
  // Through the library's logger, as its other messages: no glog line.
  ASSERT_EQ(collect.lines().size(), 1u);
  EXPECT_THAT(collect.lines()[0], HasSubstr(" WARNING accelerate.state: [AcceleratorState] fp16 mixed precision needs a "
                                            "CUDA device"));
}

TEST_F(ProcessWideAccelerator, UseCpuFromTheEnvironment) {
  auto env = patch_environment({{"ACCELERATE_USE_CPU", "true"}});
  EXPECT_TRUE(Accelerator().device().is_cpu());
}

TEST_F(ProcessWideAccelerator, PreparingAfterAResetIsRefused) {
  Accelerator accelerator;
  torch::nn::Linear net(2, 1);
  (void)accelerator.prepare(net);
  AcceleratorState::reset();
  EXPECT_THROWS_WITH((void)accelerator.prepare(torch::nn::Linear(2, 1)),
                     "the process-wide state was reset after this Accelerator was created");
  EXPECT_THROWS_WITH((void)accelerator.prepare_optimizer(std::make_shared<torch::optim::SGD>(net->parameters(), 0.1)),
                     "[Accelerator.prepare_optimizer] the process-wide state was reset");
  Accelerator fresh;
  EXPECT_NO_THROW((void)fresh.prepare(net));
}

TEST_F(ProcessWideAccelerator, UnknownTrackersAndGeneratorsAreRefused) {
  EXPECT_THROWS_WITH(Accelerator({.log_with = {"neptune"}}), "log_with: unsupported logging capability 'neptune'");
  EXPECT_THROWS_WITH(Accelerator({.rng_types = {"numpy"}}), "rng_types: unknown generator 'numpy'");
}

TEST_F(ProcessWideAccelerator, ProjectDirectoriesFollowUpstreamsRules) {
  Accelerator a({.project_dir = "runs/x"});
  EXPECT_EQ(a.project_dir(), "runs/x");
  EXPECT_EQ(a.logging_dir(), "runs/x");
  Accelerator b({.project_config = {.project_dir = "p", .logging_dir = "l", .total_limit = 2}});
  EXPECT_EQ(b.project_dir(), "p");
  EXPECT_EQ(b.logging_dir(), "l");
  EXPECT_EQ(b.project_configuration().total_limit, 2);
}

TEST(ProjectConfiguration, SetDirectoriesSetsTheProjectAndALoggingDirLeftEmpty) {
  ProjectConfiguration config;
  config.set_directories("runs/a");
  EXPECT_EQ(config.project_dir, "runs/a");
  EXPECT_EQ(config.logging_dir, "runs/a");
  config.set_directories("runs/b");
  EXPECT_EQ(config.project_dir, "runs/b");
  EXPECT_EQ(config.logging_dir, "runs/a") << "a logging_dir already set stays";
}

TEST(AcceleratorTraining, PrepareReturnsObjectsInArgumentOrderAndReusesPreparedOnes) {
  run_accelerators(1, [](const Accelerator& acc) {
    torch::nn::Linear net(2, 1);
    auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(), 0.1);
    auto x = torch::ones({4, 2});
    auto loader = DataLoader(std::make_shared<TensorDataset>(x), {.batch_size = 2});
    auto [opt, model, train] = acc.prepare(sgd, net, loader);
    static_assert(std::is_same_v<decltype(opt), AcceleratedOptimizer>);
    static_assert(std::is_same_v<decltype(model), PreparedModel<torch::nn::Linear>>);
    static_assert(std::is_same_v<decltype(train), DataLoader>);
    EXPECT_EQ(opt.optimizer(), sgd);
    EXPECT_EQ(acc.unwrap_model(model).ptr(), net.ptr());
    EXPECT_TRUE(train.prepared());
    EXPECT_TRUE(torch::equal(model(x), net(x)));
    // Preparing again hands back the same engines.
    auto again = acc.prepare(net);
    EXPECT_EQ(again.ddp().impl(), model.ddp().impl());
    EXPECT_EQ(acc.prepare(sgd).optimizer(), sgd);
    EXPECT_EQ(acc.prepared_models().size(), 1u);
    EXPECT_EQ(acc.prepared_optimizers().size(), 1u);
    EXPECT_EQ(acc.prepared_data_loaders().size(), 1u);
    acc.free_memory();
    EXPECT_TRUE(acc.prepared_models().empty());
    EXPECT_TRUE(acc.prepared_optimizers().empty());
    EXPECT_EQ(acc.step(), 0);
  });
}

TEST(AcceleratorTraining, ClipGradNormClipsTheGlobalNorm) {
  run_accelerators(1, [](const Accelerator& acc) {
    auto w = torch::zeros({2}, torch::requires_grad());
    w.mutable_grad() = torch::tensor({3.f, 4.f});
    EXPECT_DOUBLE_EQ(acc.clip_grad_norm_({w}, 1.0), 5.0);
    EXPECT_TRUE(torch::allclose(w.grad(), torch::tensor({0.6f, 0.8f})));
    acc.clip_grad_value_({w}, 0.7);
    EXPECT_TRUE(torch::allclose(w.grad(), torch::tensor({0.6f, 0.7f})));
    EXPECT_THROWS_WITH(acc.clip_grad_norm_({w}, -1.0), "max_norm must not be negative");
    EXPECT_THROWS_WITH(acc.clip_grad_value_({w}, -1.0), "clip_value must not be negative, got -1");
  });
}

// Without a loss scaler (no fp16 on a CUDA device) there is nothing to divide by: gradients stay
// as backward left them, whichever optimizer is named and however often it is called.
// tests/gpu/accelerator_test.cpp checks the scaled case.
TEST(AcceleratorTraining, UnscaleGradientsWithoutALossScalerLeavesTheGradientsAsTheyAre) {
  for (const char* precision : {"no", "fp16", "bf16"}) {
    run_accelerators(
        1,
        [&](const Accelerator& acc) {
          ASSERT_FALSE(acc.scaler().has_value()) << precision << " made a loss scaler on " << acc.device();
          torch::manual_seed(0);
          torch::nn::Linear net(3, 2);
          auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(), 0.1);
          auto [model, opt] = acc.prepare(net, sgd);
          acc.backward(model(torch::randn({4, 3})).pow(2).sum());
          const auto weight_grad = model->weight.grad().clone();
          const auto bias_grad = model->bias.grad().clone();
          ASSERT_GT(weight_grad.abs().sum().item<float>(), 0.f);
          acc.unscale_gradients();
          acc.unscale_gradients(opt);
          acc.unscale_gradients();
          EXPECT_TRUE(torch::equal(model->weight.grad(), weight_grad)) << precision;
          EXPECT_TRUE(torch::equal(model->bias.grad(), bias_grad)) << precision;
          // The step that follows uses those gradients.
          const auto weight = model->weight.detach().clone();
          opt.step();
          EXPECT_TRUE(torch::allclose(model->weight.detach(), weight - 0.1 * weight_grad)) << precision;
        },
        AcceleratorOptions{.mixed_precision = precision, .gradient_accumulation_steps = 2});
  }
}

TEST(AcceleratorTraining, ProfileWritesATracePerProcess) {
  TempDir dir;
  AcceleratorOptions options;
  options.profile_kwargs.output_trace_dir = dir.str();
  run_accelerators(2, [](const Accelerator& acc) {
    auto result = acc.profile([] { return torch::mm(torch::ones({8, 8}), torch::ones({8, 8})).sum().item<float>(); });
    EXPECT_EQ(result, 512.f);
  }, options);
  EXPECT_TRUE(std::filesystem::exists(dir.path() / "profile_0.json"));
  EXPECT_TRUE(std::filesystem::exists(dir.path() / "profile_1.json"));
}

}  // namespace accelerator_test
}  // namespace accelerate::testing
