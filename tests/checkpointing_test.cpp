// Checkpoint states and the Accelerator's save_state / load_state: optimizer states resume every
// LibTorch optimizer exactly, generator states round-trip, the folder layout and names follow
// upstream, automatic naming and total_limit, the newest complete checkpoint, hooks, registered
// objects, and the refusals (all checked before anything changes).
#include "accelerate/accelerator.h"
#include "accelerate/checkpointing.h"
#include "accelerate/utils/safetensors.h"
#include "detail/files.h"
#include "support/accelerators.h"
#include "support/process.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <limits>

namespace accelerate::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// ---- optimizer states ----------------------------------------------------------------------

template <typename Optimizer, typename Options>
void expect_optimizer_resumes_exactly(const Options& options) {
  torch::manual_seed(0);
  torch::nn::Linear a(3, 2), b(3, 2);
  {
    torch::NoGradGuard no_grad;
    b->weight.copy_(a->weight);
    b->bias.copy_(a->bias);
  }
  const auto step = [](torch::nn::Linear& m, Optimizer& o, const torch::Tensor& x) {
    o.step([&] {
      o.zero_grad();
      auto loss = m(x).pow(2).sum();
      loss.backward();
      return loss;
    });
  };
  Optimizer trained(a->parameters(), options);
  for (int i = 0; i < 3; ++i) step(a, trained, torch::randn({4, 3}));
  {
    torch::NoGradGuard no_grad;
    b->weight.copy_(a->weight);
    b->bias.copy_(a->bias);
  }
  TempDir dir;
  const auto path = (dir.path() / "optimizer.safetensors").string();
  save_state_dict_file(optimizer_state_dict(trained), path);
  auto other_options = options;
  other_options.lr(123.0);  // restored from the checkpoint
  Optimizer resumed(b->parameters(), other_options);
  load_optimizer_state_dict(resumed, load_state_dict_file(path));
  EXPECT_EQ(optimizer_state_dict(resumed).values, optimizer_state_dict(trained).values);
  const auto x = torch::randn({4, 3});
  step(a, trained, x);
  step(b, resumed, x);
  EXPECT_TRUE(torch::equal(a->weight, b->weight)) << a->weight << b->weight;
  EXPECT_TRUE(torch::equal(a->bias, b->bias));
}

TEST(OptimizerStateDict, SGDWithMomentumResumesExactly) {
  expect_optimizer_resumes_exactly<torch::optim::SGD>(torch::optim::SGDOptions(0.1).momentum(0.9).nesterov(true));
}
TEST(OptimizerStateDict, AdamWithAmsgradResumesExactly) {
  expect_optimizer_resumes_exactly<torch::optim::Adam>(torch::optim::AdamOptions(0.01).amsgrad(true));
}
TEST(OptimizerStateDict, AdamWResumesExactly) {
  expect_optimizer_resumes_exactly<torch::optim::AdamW>(torch::optim::AdamWOptions(0.01).weight_decay(0.1));
}
TEST(OptimizerStateDict, AdagradResumesExactly) {
  expect_optimizer_resumes_exactly<torch::optim::Adagrad>(torch::optim::AdagradOptions(0.1).lr_decay(0.01));
}
TEST(OptimizerStateDict, CenteredRMSpropWithMomentumResumesExactly) {
  expect_optimizer_resumes_exactly<torch::optim::RMSprop>(
      torch::optim::RMSpropOptions(0.01).centered(true).momentum(0.5));
}
TEST(OptimizerStateDict, LBFGSResumesExactly) {
  expect_optimizer_resumes_exactly<torch::optim::LBFGS>(torch::optim::LBFGSOptions(0.5).history_size(3).max_iter(4));
}

TEST(OptimizerStateDict, UsesPyTorchsLayout) {
  torch::nn::Linear net(2, 2);
  torch::optim::Adam adam(net->parameters(), 0.5);
  adam.zero_grad();
  net(torch::ones({1, 2})).sum().backward();
  adam.step();
  const auto state = optimizer_state_dict(adam);
  EXPECT_EQ(state.values.at("optimizer"), "Adam");
  EXPECT_EQ(state.values.at("param_groups")[0].at("params"), nlohmann::json({0, 1}));
  EXPECT_EQ(state.values.at("param_groups")[0].at("lr"), 0.5);
  EXPECT_EQ(state.values.at("state").at("1").at("step"), 1);
  std::vector<std::string> names;
  for (const auto& [name, t] : state.tensors) names.push_back(name);
  EXPECT_THAT(names, ElementsAre("state.0.exp_avg", "state.0.exp_avg_sq", "state.1.exp_avg", "state.1.exp_avg_sq"));
}

TEST(OptimizerStateDict, RefusesAMismatchBeforeChangingAnything) {
  torch::nn::Linear net(2, 2), wider(3, 2);
  torch::optim::Adam adam(net->parameters(), 0.5);
  adam.zero_grad();
  net(torch::ones({1, 2})).sum().backward();
  adam.step();
  const auto state = optimizer_state_dict(adam);

  torch::optim::SGD sgd(net->parameters(), 0.1);
  EXPECT_THROWS_WITH(load_optimizer_state_dict(sgd, state), "holds the state of a \"Adam\" optimizer, this one is SGD");
  torch::optim::Adam other(wider->parameters(), 0.1);
  EXPECT_THROWS_WITH(load_optimizer_state_dict(other, state),
                     "tensor state.0.exp_avg has shape [2, 2] but its parameter has shape [2, 3]");
  EXPECT_EQ(other.param_groups()[0].options().get_lr(), 0.1);
  EXPECT_TRUE(other.state().empty());
  torch::optim::Adam two_groups(std::vector<torch::optim::OptimizerParamGroup>{
      torch::optim::OptimizerParamGroup({net->weight}), torch::optim::OptimizerParamGroup({net->bias})});
  EXPECT_THROWS_WITH(load_optimizer_state_dict(two_groups, state), "the checkpoint has 1 param groups, the optimizer has 2");
  auto broken = state;
  broken.values["param_groups"][0].erase("eps");
  torch::optim::Adam fresh(net->parameters(), 0.1);
  EXPECT_THROWS_WITH(load_optimizer_state_dict(fresh, broken), "param group 0: missing \"eps\"");
  broken = state;
  broken.tensors.erase("state.1.exp_avg_sq");
  EXPECT_THROWS_WITH(load_optimizer_state_dict(fresh, broken), "missing tensor state.1.exp_avg_sq");
  broken = state;
  broken.values["state"]["7"] = broken.values["state"]["0"];
  EXPECT_THROWS_WITH(load_optimizer_state_dict(fresh, broken), "names parameter \"7\", but the optimizer has 2");
  EXPECT_TRUE(fresh.state().empty());
}

// ---- generators and files ------------------------------------------------------------------

TEST(RngStateDict, RestoresTheDrawsOfTheDefaultGenerator) {
  torch::manual_seed(7);
  (void)torch::rand({3});
  const auto state = rng_state_dict();
  const auto expected = torch::rand({5});
  (void)torch::rand({11});
  load_rng_state_dict(state);
  EXPECT_TRUE(torch::equal(torch::rand({5}), expected));
  StateDict wrong;
  wrong.tensors["torch_manual_seed"] = torch::zeros({3});
  EXPECT_THROWS_WITH(load_rng_state_dict(wrong), "torch_manual_seed should be a 1-D uint8 tensor");
  EXPECT_THROWS_WITH(load_rng_state_dict(StateDict{}), "missing tensor torch_manual_seed");
}

TEST(StateDictFile, KeepsValuesAndTensorsAndRefusesWhatItCannotHold) {
  TempDir dir;
  StateDict state{{{"a", 1}, {"b", {1, 2}}}, {{"t", torch::arange(4)}}};
  save_state_dict_file(state, (dir.path() / "s.safetensors").string());
  const auto back = load_state_dict_file((dir.path() / "s.safetensors").string());
  EXPECT_EQ(back.values, state.values);
  EXPECT_TRUE(torch::equal(back.tensors.at("t"), torch::arange(4)));
  back.tensors.at("t").add_(1);  // an owned copy, writable

  EXPECT_THROWS_WITH(save_state_dict_file(state, (dir.path() / "s.json").string()), "a JSON file cannot hold tensors");
  EXPECT_THROWS_WITH(save_state_dict_file(state, (dir.path() / "s.bin").string()), "expected a path ending in");
  save_file({{"t", torch::ones({1})}}, (dir.path() / "plain.safetensors").string());
  EXPECT_THROWS_WITH(load_state_dict_file((dir.path() / "plain.safetensors").string()), "has no \"json\" entry");
  detail::write_file((dir.path() / "bad.json").string(), "{oops");
  EXPECT_THROWS_WITH(load_state_dict_file((dir.path() / "bad.json").string()), "is not valid JSON");
}

// ---- save_state / load_state -----------------------------------------------------------------

struct Counter {
  int value = 0;
  nlohmann::json state_dict() const { return {{"value", value}}; }
  void load_state_dict(const nlohmann::json& state) { value = state.at("value").get<int>(); }
};

struct Buffers {
  torch::Tensor t = torch::zeros({2});
  TensorMap state_dict() const { return {{"t", t}}; }
  void load_state_dict(const TensorMap& state) { t = state.at("t").clone(); }
};

struct Training {
  torch::nn::Linear net{3, 1};
  std::shared_ptr<torch::optim::Adam> adam = std::make_shared<torch::optim::Adam>(net->parameters(), 0.1);
  DataLoader loader{std::make_shared<TensorDataset>(torch::randn({8, 3}), torch::randn({8, 1})),
                    {.batch_size = 2, .shuffle = true}};
};

AcceleratorOptions project_options(const std::string& dir, int total_limit = 0) {
  AcceleratorOptions options;
  options.project_config = {.project_dir = dir, .automatic_checkpoint_naming = true, .total_limit = total_limit};
  return options;
}

std::vector<std::string> entries(const fs::path& folder) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(folder)) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  return names;
}

void train_one_pass(const Accelerator& acc, PreparedModel<torch::nn::Linear>& model, AcceleratedOptimizer& opt,
                    DataLoader& loader) {
  for (auto& batch : loader) {
    opt.zero_grad();
    acc.backward(torch::mse_loss(model(batch.data), batch.target));
    opt.step();
  }
}

TEST(SaveState, WritesUpstreamsNamesAndRestoresEverything) {
  TempDir dir;
  run_accelerators(1, [&](const Accelerator& acc, int) {
    Training t;
    torch::nn::Linear second(2, 2);
    auto sgd = std::make_shared<torch::optim::SGD>(second->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    auto schedule = std::make_shared<LambdaLR>(t.adam, [](int64_t epoch) { return 1.0 / (1 + epoch); });
    auto [model, opt, loader, model2, opt2, sched] = acc.prepare(t.net, t.adam, t.loader, second, sgd, schedule);
    Counter counter{5};
    auto buffers = std::make_shared<Buffers>();
    buffers->t = torch::tensor({1.5f, 2.5f});
    acc.register_for_checkpointing(counter, buffers);
    train_one_pass(acc, model, opt, loader);
    sched.step();
    const auto out = acc.save_state((dir.path() / "ckpt").string());
    EXPECT_EQ(out, (dir.path() / "ckpt").string());
    EXPECT_THAT(entries(dir.path()), ElementsAre("ckpt"));
    EXPECT_THAT(entries(dir.path() / "ckpt"),
                ElementsAre("custom_checkpoint_0.json", "custom_checkpoint_1.safetensors", "model.safetensors",
                            "model_1.safetensors", "optimizer.safetensors", "optimizer_1.safetensors",
                            "random_states_0.safetensors", "sampler.json", "scheduler.json"));

    const auto weight = model->weight.clone();
    const auto lr = opt.param_groups()[0].options().get_lr();
    const auto draws = torch::rand({3});
    train_one_pass(acc, model, opt, loader);
    sched.step();
    counter.value = 9;
    buffers->t.zero_();
    acc.load_state((dir.path() / "ckpt").string());
    EXPECT_TRUE(torch::equal(model->weight, weight));
    EXPECT_EQ(opt.param_groups()[0].options().get_lr(), lr);
    EXPECT_EQ(sched.scheduler()->last_epoch(), 1);
    EXPECT_EQ(counter.value, 5);
    EXPECT_TRUE(torch::equal(buffers->t, torch::tensor({1.5f, 2.5f})));
    EXPECT_TRUE(torch::equal(torch::rand({3}), draws));
  });
}

TEST(SaveState, PythonReadsTheCheckpointWithTheStandardLibraryOnly) {
  TempDir dir;
  run_accelerators(1, [&](const Accelerator& acc, int) {
    Training t;
    auto schedule = std::make_shared<LambdaLR>(t.adam, [](int64_t epoch) { return 0.5; });
    auto [model, opt, loader, sched] = acc.prepare(t.net, t.adam, t.loader, schedule);
    train_one_pass(acc, model, opt, loader);
    acc.save_state(dir.str() + "/ckpt");
    auto python = run({"/usr/bin/python3", built("tests/python/checkpoint_check.py"), dir.str() + "/ckpt"});
    ASSERT_EQ(python->exit_code(), 0) << python->err;
    const auto found = nlohmann::json::parse(python->out);
    const auto& weight = found.at("model.safetensors").at("tensors").at("weight");
    EXPECT_EQ(weight.at("dtype"), "F32");
    EXPECT_EQ(weight.at("shape"), nlohmann::json({1, 3}));
    for (int i = 0; i < 3; ++i) EXPECT_EQ(weight.at("values")[i].get<double>(), model->weight[0][i].item<double>());
    EXPECT_EQ(found.at("model.safetensors").at("metadata").at("format"), "pt");
    const auto& optimizer = found.at("optimizer.safetensors");
    EXPECT_EQ(optimizer.at("metadata").at("json").at("param_groups")[0].at("lr").get<double>(),
              opt.param_groups()[0].options().get_lr());
    EXPECT_EQ(optimizer.at("metadata").at("json").at("state").at("0").at("step"), 4);
    const auto exp_avg = optimizer_state_dict(*opt.optimizer()).tensors.at("state.1.exp_avg");
    EXPECT_EQ(optimizer.at("tensors").at("state.1.exp_avg").at("values")[0].get<double>(), exp_avg.item<double>());
    EXPECT_EQ(found.at("scheduler.json").at("last_epoch"), 0);
    EXPECT_EQ(found.at("sampler.json").at("epoch"), 1);
    EXPECT_EQ(found.at("random_states_0.safetensors").at("metadata").at("json").at("step"), acc.step());
    EXPECT_GT(found.at("random_states_0.safetensors").at("tensors").at("torch_manual_seed").at("values").get<int>(), 0);
  });
}

TEST(SaveState, AutomaticNamingKeepsExactlyTheLastTotalLimitCheckpoints) {
  TempDir dir;
  run_accelerators(1, [&](const Accelerator& acc, int) {
    Training t;
    (void)acc.prepare(t.net, t.adam);
    for (int i = 0; i < 12; ++i) {
      EXPECT_EQ(acc.save_state(), (dir.path() / "checkpoints" / ("checkpoint_" + std::to_string(i))).string());
    }
    EXPECT_THAT(entries(dir.path() / "checkpoints"), ElementsAre("checkpoint_10", "checkpoint_11"));
    EXPECT_EQ(acc.save_iteration(), 12);
    acc.set_save_iteration(11);
    EXPECT_THROWS_WITH(acc.save_state(), "checkpoint_11 (11) already exists; call set_save_iteration");
    EXPECT_THROWS_WITH(acc.save_state("elsewhere"), "automatic_checkpoint_naming chooses the folder");
  }, project_options(dir.str(), 2));
}

TEST(SaveState, MisuseIsRefusedNamingWhatIsMissing) {
  // Without automatic naming, save_state needs a folder.
  run_accelerators(1, [&](const Accelerator& acc, int) {
    EXPECT_THROWS_WITH(acc.save_state(), "expected an output_dir (or ProjectConfiguration::automatic_checkpoint_naming)");
    EXPECT_THROWS_WITH(acc.set_save_iteration(-1), "expected a non-negative iteration, got -1");
    EXPECT_THROWS_WITH(acc.register_save_state_pre_hook(nullptr),
                       "[Accelerator::register_save_state_pre_hook] expected a hook, got none");
    EXPECT_THROWS_WITH(acc.register_load_state_pre_hook(nullptr),
                       "[Accelerator::register_load_state_pre_hook] expected a hook, got none");
    EXPECT_EQ(acc.save_iteration(), 0);
  });
  // Automatic naming needs a project folder to put checkpoints/ in.
  AcceleratorOptions no_project;
  no_project.project_config.automatic_checkpoint_naming = true;
  run_accelerators(1, [&](const Accelerator& acc, int) {
    EXPECT_THROWS_WITH(acc.save_state(), "automatic_checkpoint_naming needs ProjectConfiguration::project_dir");
  }, no_project);
}

// An optimizer of the user's own, which the checkpoint code cannot know.
struct OwnOptimizer : torch::optim::Optimizer {
  explicit OwnOptimizer(std::vector<torch::Tensor> params)
      : torch::optim::Optimizer({torch::optim::OptimizerParamGroup(std::move(params))},
                                std::make_unique<torch::optim::SGDOptions>(0.1)) {}
  torch::Tensor step(LossClosure) override { return {}; }
};

TEST(SaveState, AnOptimizerOfAnUnknownTypeIsRefusedNamingItAndNothingIsCommitted) {
  TempDir dir;
  run_accelerators(1, [&](const Accelerator& acc, int) {
    torch::nn::Linear net(2, 2);
    auto [model, opt] = acc.prepare(net, std::make_shared<OwnOptimizer>(net->parameters()));
    (void)model;
    (void)opt;
    EXPECT_THROWS_WITH(acc.save_state((dir.path() / "ckpt").string()), "OwnOptimizer; LibTorch's SGD, Adam, AdamW");
    EXPECT_THROWS_WITH(acc.save_state((dir.path() / "ckpt").string()), "cannot checkpoint an optimizer of type");
  });
  EXPECT_TRUE(fs::is_empty(dir.path())) << "the refused save left a folder behind";
}

// Trains `saves` passes in the project `dir`, saving after each; returns the last weight.
torch::Tensor train_and_save(const TempDir& dir, int saves) {
  torch::Tensor newest;
  run_accelerators(1, [&](const Accelerator& acc, int) {
    Training t;
    auto [model, opt, loader] = acc.prepare(t.net, t.adam, t.loader);
    for (int i = 0; i < saves; ++i) {
      train_one_pass(acc, model, opt, loader);
      acc.save_state();
    }
    newest = model->weight.clone();
  }, project_options(dir.str()));
  return newest;
}

TEST(LoadState, TakesTheNewestCompleteCheckpointIgnoringLeftoversAndContinuesItsNumbering) {
  TempDir dir;
  const auto newest = train_and_save(dir, 3);
  // A crashed save leaves a hidden staging folder; it is never taken for a checkpoint.
  fs::create_directories(dir.path() / "checkpoints/.checkpoint_3.partial");
  detail::write_file((dir.path() / "checkpoints/.checkpoint_3.partial/model.safetensors").string(), "garbage");
  run_accelerators(1, [&](const Accelerator& acc, int) {
    Training t;
    auto [model, opt, loader] = acc.prepare(t.net, t.adam, t.loader);
    acc.load_state();
    EXPECT_TRUE(torch::equal(model->weight, newest));
    EXPECT_EQ(acc.save_iteration(), 3);
    EXPECT_EQ(acc.save_state(), (dir.path() / "checkpoints/checkpoint_3").string());
  }, project_options(dir.str()));
  EXPECT_THAT(entries(dir.path() / "checkpoints"),
              ElementsAre("checkpoint_0", "checkpoint_1", "checkpoint_2", "checkpoint_3"));
}

TEST(LoadState, ChecksEveryFileBeforeChangingAnything) {
  TempDir dir;
  run_accelerators(1, [&](const Accelerator& acc, int) {
    Training t;
    auto [model, opt, loader] = acc.prepare(t.net, t.adam, t.loader);
    train_one_pass(acc, model, opt, loader);
    acc.save_state(dir.str() + "/ckpt");
    const auto file = dir.str() + "/ckpt/optimizer.safetensors";
    const auto bytes = detail::read_file(file);
    detail::write_file(file, bytes.substr(0, bytes.size() - 4));
    train_one_pass(acc, model, opt, loader);
    const auto weight = model->weight.clone();
    EXPECT_THROWS_WITH(acc.load_state(dir.str() + "/ckpt"), "optimizer.safetensors");
    EXPECT_TRUE(torch::equal(model->weight, weight));

    fs::remove(dir.path() / "ckpt/optimizer.safetensors");
    EXPECT_THROWS_WITH(acc.load_state(dir.str() + "/ckpt"), "the checkpoint has no optimizer.safetensors");
    EXPECT_THROWS_WITH(acc.load_state(dir.str() + "/missing"), "but folder does not exist");
    EXPECT_THROWS_WITH(acc.load_state(), "no input_dir provided and automatic checkpoint naming is disabled");
  });
}

TEST(LoadState, RestoresOptimizerStateIntoTheOptimizersOwnTensors) {
  TempDir dir;
  run_accelerators(1, [&](const Accelerator& acc, int) {
    Training t;
    auto [model, opt, loader] = acc.prepare(t.net, t.adam, t.loader);
    train_one_pass(acc, model, opt, loader);
    acc.save_state(dir.str() + "/ckpt");
    std::map<std::string, at::Tensor> saved;
    for (const auto& [name, tensor] : optimizer_state_dict(*t.adam).tensors) saved[name] = tensor.clone();
    train_one_pass(acc, model, opt, loader);
    std::map<std::string, const void*> storage;
    for (const auto& [name, tensor] : optimizer_state_dict(*t.adam).tensors) storage[name] = tensor.data_ptr();

    acc.load_state(dir.str() + "/ckpt");
    const auto loaded = optimizer_state_dict(*t.adam).tensors;
    ASSERT_EQ(loaded.size(), saved.size());
    for (const auto& [name, tensor] : loaded) {
      EXPECT_TRUE(torch::equal(tensor, saved.at(name))) << name;
      EXPECT_EQ(tensor.data_ptr(), storage.at(name)) << name << " was reallocated instead of read into";
    }

    // A checkpoint whose optimizer state fails a check leaves the optimizer's tensors as they were,
    // although they would have been read into.
    train_one_pass(acc, model, opt, loader);
    std::map<std::string, at::Tensor> current;
    for (const auto& [name, tensor] : optimizer_state_dict(*t.adam).tensors) current[name] = tensor.clone();
    fs::copy(dir.path() / "ckpt", dir.path() / "broken", fs::copy_options::recursive);
    const auto file = dir.str() + "/broken/optimizer.safetensors";
    auto broken = load_state_dict_file(file);
    broken.values["param_groups"][0].erase("eps");
    save_state_dict_file(broken, file);
    EXPECT_THROWS_WITH(acc.load_state(dir.str() + "/broken"), "param group 0: missing \"eps\"");
    for (const auto& [name, tensor] : optimizer_state_dict(*t.adam).tensors) {
      EXPECT_TRUE(torch::equal(tensor, current.at(name))) << name << " changed by a refused load";
    }
  });
  // An optimizer with no state yet gets state tensors of its own, equal to the saved ones.
  run_accelerators(1, [&](const Accelerator& acc, int) {
    Training fresh;
    EXPECT_TRUE(fresh.adam->state().empty());
    auto [model, opt, loader] = acc.prepare(fresh.net, fresh.adam, fresh.loader);
    acc.load_state(dir.str() + "/ckpt");
    const auto loaded = optimizer_state_dict(*fresh.adam).tensors;
    const auto file = load_file(dir.str() + "/ckpt/optimizer.safetensors");
    ASSERT_EQ(loaded.size(), file.size());
    for (const auto& [name, tensor] : loaded) EXPECT_TRUE(torch::equal(tensor, file.at(name))) << name;
  });
}

TEST(LoadState, WhenTheModelAndTheOptimizerBothFailTheModelsErrorIsRaised) {
  // The two load side by side (Note [Loading models and optimizers side by side]): whichever
  // finishes first, the error is the model's, every time.
  TempDir dir;
  run_accelerators(1, [&](const Accelerator& acc, int) {
    Training t;
    auto [model, opt, loader] = acc.prepare(t.net, t.adam, t.loader);
    train_one_pass(acc, model, opt, loader);
    acc.save_state(dir.str() + "/ckpt");
    const auto model_file = dir.str() + "/ckpt/model.safetensors";
    auto weights = load_file(model_file);
    weights.emplace("extra", at::zeros({2}));
    save_file(weights, model_file);
    EXPECT_THROWS_WITH(acc.load_state(dir.str() + "/ckpt"), "unexpected keys [extra]");
    const auto optimizer_file = dir.str() + "/ckpt/optimizer.safetensors";
    auto broken = load_state_dict_file(optimizer_file);
    broken.values["param_groups"][0].erase("eps");
    save_state_dict_file(broken, optimizer_file);
    for (int i = 0; i < 5; ++i) EXPECT_THROWS_WITH(acc.load_state(dir.str() + "/ckpt"), "unexpected keys [extra]");
  });
}

TEST(LoadState, RefusesADifferentSetOfRegisteredObjects) {
  TempDir dir;
  run_accelerators(1, [&](const Accelerator& acc, int) {
    Counter a, b;
    acc.register_for_checkpointing(a);
    acc.save_state(dir.str() + "/ckpt");
    acc.register_for_checkpointing(b);
    EXPECT_THROWS_WITH(acc.load_state(dir.str() + "/ckpt"),
                       "found 1 checkpoints, 2 registered objects");
  });
  run_accelerators(1, [&](const Accelerator& acc, int) {
    std::shared_ptr<Counter> none;
    Counter c;
    EXPECT_THROWS_WITH(acc.register_for_checkpointing(c, none), "item 1 is a null pointer");
  });
}

TEST(LoadState, NoCheckpointYetIsAClearError) {
  TempDir dir;
  run_accelerators(1, [&](const Accelerator& acc, int) {
    EXPECT_THROWS_WITH(acc.load_state(), "no complete checkpoint in " + dir.str() + "/checkpoints");
  }, project_options(dir.str()));
}

TEST(SaveState, HooksSeeTheModelsAndFolderAndCanBeRemoved) {
  TempDir dir;
  run_accelerators(1, [&](const Accelerator& acc, int) {
    Training t;
    auto [model, opt] = acc.prepare(t.net, t.adam);
    int saves = 0;
    auto handle = acc.register_save_state_pre_hook(
        [&](const std::vector<DistributedDataParallel>& models, std::vector<StateDictMap>& weights,
            const std::string& output_dir) {
          ++saves;
          EXPECT_EQ(models.size(), 1u);
          ASSERT_EQ(weights.size(), 1u);
          weights.clear();  // this hook saves the model itself
          detail::write_file(output_dir + "/config.json", "{}");
        });
    std::string loaded_from;
    acc.register_load_state_pre_hook([&](std::vector<DistributedDataParallel>& models, const std::string& input_dir) {
      loaded_from = input_dir;
      models.clear();  // and loads it itself
    });
    acc.save_state(dir.str() + "/a");
    EXPECT_EQ(saves, 1);
    EXPECT_TRUE(fs::is_regular_file(dir.path() / "a/config.json"));
    EXPECT_FALSE(fs::exists(dir.path() / "a/model.safetensors"));
    acc.load_state(dir.str() + "/a");
    EXPECT_EQ(loaded_from, dir.str() + "/a");
    handle.remove();
    handle.remove();
    acc.save_state(dir.str() + "/b");
    EXPECT_EQ(saves, 1);
    EXPECT_TRUE(fs::exists(dir.path() / "b/model.safetensors"));
  });
}

TEST(SaveState, AFailureOnOneProcessFailsTheSaveOnEveryProcessWithNothingCommitted) {
  TempDir dir;
  std::vector<std::string> errors(2);
  run_accelerators(2, [&](const Accelerator& acc, int rank) {
    acc.register_save_state_pre_hook([rank](const auto&, auto&, const std::string&) {
      if (rank == 1) throw std::runtime_error("disk full (simulated)");
    });
    errors[rank] = error_of([&] { acc.save_state(dir.str() + "/ckpt"); });
  });
  for (const auto& e : errors) EXPECT_THAT(e, HasSubstr("failed on process 1: disk full (simulated)"));
  EXPECT_TRUE(entries(dir.path()).empty());
}

TEST(SaveState, TwoMachinesOnASharedFileSystemPublishOneCheckpoint) {
  for (const bool save_on_each_node : {false, true}) {
    TempDir dir;
    AcceleratorOptions options = project_options(dir.str());
    options.project_config.save_on_each_node = save_on_each_node;
    // Two machines of one process each: both processes are their machine's local main process,
    // and both see process 0's staging folder, so only process 0 publishes.
    options.standalone_state = PartialStateOptions{.local_process_index = 0, .local_num_processes = 1};
    run_accelerators(2, [&](const Accelerator& acc, int) {
      Training t;
      auto [model, opt] = acc.prepare(t.net, t.adam);
      EXPECT_TRUE(acc.is_local_main_process());
      acc.save_state();
      acc.load_state();
      EXPECT_EQ(acc.save_iteration(), 1);
    }, options);
    EXPECT_THAT(entries(dir.path() / "checkpoints"), ElementsAre("checkpoint_0")) << save_on_each_node;
    EXPECT_THAT(entries(dir.path() / "checkpoints/checkpoint_0"),
                ElementsAre("model.safetensors", "optimizer.safetensors", "random_states_0.safetensors",
                            "random_states_1.safetensors"));
  }
}

TEST(SaveState, ReplacesAnExistingFolderOfTheSameName) {
  TempDir dir;
  run_accelerators(1, [&](const Accelerator& acc, int) {
    Training t;
    auto [model, opt] = acc.prepare(t.net, t.adam);
    fs::create_directories(dir.path() / "ckpt");
    detail::write_file((dir.path() / "ckpt/stale.txt").string(), "old");
    acc.save_state(dir.str() + "/ckpt");
    EXPECT_FALSE(fs::exists(dir.path() / "ckpt/stale.txt"));
    EXPECT_TRUE(fs::exists(dir.path() / "ckpt/model.safetensors"));
    EXPECT_THAT(entries(dir.path()), ElementsAre("ckpt"));
  });
}

TEST(Save, WritesTensorsAndJsonAndSaveModelShardsAPreparedModel) {
  TempDir dir;
  run_accelerators(1, [&](const Accelerator& acc, int) {
    Training t;
    auto model = acc.prepare(t.net);
    acc.save(acc.get_state_dict(model), dir.str() + "/weights.safetensors");
    acc.save(nlohmann::json{{"epoch", 3}}, dir.str() + "/meta.json");
    EXPECT_TRUE(torch::equal(load_file(dir.str() + "/weights.safetensors").at("weight"), model->weight));
    EXPECT_EQ(nlohmann::json::parse(detail::read_file(dir.str() + "/meta.json")).at("epoch"), 3);
    acc.save_model(model, dir.str() + "/model", "8");
    EXPECT_TRUE(fs::exists(dir.path() / "model/model.safetensors.index.json"));
    torch::nn::Linear copy(3, 1);
    load_checkpoint_in_model(*copy, dir.str() + "/model", {.strict = true});
    EXPECT_TRUE(torch::equal(copy->weight, model->weight));
    EXPECT_THROWS_WITH(acc.save_model(model, dir.str() + "/meta.json"), "should be a directory, not a file");
  });
}

TEST(RemoveTree, RemovesAFolderWithEverythingInItButNotWhatALinkPointsTo) {
  TempDir dir;
  const auto tree = dir.path() / "tree";
  std::filesystem::create_directories(tree / "a" / "b");
  std::ofstream(tree / "a" / "b" / "file") << "x";
  std::ofstream(tree / "top") << "y";
  const auto outside = dir.path() / "outside";
  std::filesystem::create_directories(outside);
  std::ofstream(outside / "kept") << "z";
  std::filesystem::create_directory_symlink(outside, tree / "a" / "link");
  detail::remove_tree(tree);
  EXPECT_FALSE(std::filesystem::exists(tree));
  EXPECT_TRUE(std::filesystem::is_regular_file(outside / "kept")) << "the link was followed";
  // A missing path is no error; a path that cannot be one names itself and the reason.
  EXPECT_NO_THROW(detail::remove_tree(tree));
  EXPECT_EQ(detail::try_remove_tree(tree), 0);
  const auto below_a_file = outside / "kept" / "child";
  EXPECT_THAT(error_of([&] { detail::remove_tree(below_a_file); }),
              HasSubstr("cannot remove " + below_a_file.string() + ": Not a directory"));
  EXPECT_EQ(detail::try_remove_tree(below_a_file), ENOTDIR);
}


// ---- what a probe of checkpoints found ------------------------------------------------------

// The folders of `dir`/checkpoints.
std::vector<std::string> checkpoints_in(const TempDir& dir) { return entries(dir.path() / "checkpoints"); }

TEST(SaveState, ANewRunInAnEarlierRunsFolderNumbersAfterItsCheckpointsAndKeepsItsOwn) {
  TempDir dir;
  run_accelerators(1, [&](const Accelerator& acc, int) {
    Training t;
    (void)acc.prepare(t.net, t.adam);
    for (int i = 0; i < 5; ++i) acc.save_state();
  }, project_options(dir.str(), 2));
  ASSERT_THAT(checkpoints_in(dir), ElementsAre("checkpoint_3", "checkpoint_4"));
  // A second run, not resumed, in the same folder (upstream would write checkpoint_0 and prune it).
  torch::Tensor trained;
  CapturedLines lines;
  run_accelerators(1, [&](const Accelerator& acc, int) {
    Training t;
    auto [model, opt, loader] = acc.prepare(t.net, t.adam, t.loader);
    train_one_pass(acc, model, opt, loader);
    EXPECT_EQ(acc.save_state(), (dir.path() / "checkpoints/checkpoint_5").string());
    EXPECT_THAT(checkpoints_in(dir), ElementsAre("checkpoint_4", "checkpoint_5"));
    train_one_pass(acc, model, opt, loader);
    EXPECT_EQ(acc.save_state(), (dir.path() / "checkpoints/checkpoint_6").string());
    trained = model->weight.clone();
  }, project_options(dir.str(), 2));
  EXPECT_THAT(checkpoints_in(dir), ElementsAre("checkpoint_5", "checkpoint_6"));
  EXPECT_TRUE(lines.saw("already holds checkpoints up to checkpoint_4 of an earlier run; this run's checkpoints "
                        "are numbered from checkpoint_5"));
  // Resuming takes the second run's newest.
  run_accelerators(1, [&](const Accelerator& acc, int) {
    Training t;
    auto [model, opt] = acc.prepare(t.net, t.adam);
    acc.load_state();
    EXPECT_TRUE(torch::equal(model->weight, trained));
  }, project_options(dir.str(), 2));
}

TEST(SaveState, PruningKeepsTheCheckpointJustWrittenAndThisRunsOwnBeforeAnEarlierRunsNewerOnes) {
  TempDir dir;
  run_accelerators(1, [&](const Accelerator& acc, int) {
    Training t;
    (void)acc.prepare(t.net, t.adam);
    acc.set_save_iteration(3);
    acc.save_state();
    acc.save_state();
  }, project_options(dir.str(), 2));
  ASSERT_THAT(checkpoints_in(dir), ElementsAre("checkpoint_3", "checkpoint_4"));
  run_accelerators(1, [&](const Accelerator& acc, int) {
    Training t;
    (void)acc.prepare(t.net, t.adam);
    acc.set_save_iteration(0);  // chosen by the program: no renumbering
    acc.save_state();
    EXPECT_THAT(checkpoints_in(dir), ElementsAre("checkpoint_0", "checkpoint_4"));
    acc.save_state();
    EXPECT_THAT(checkpoints_in(dir), ElementsAre("checkpoint_0", "checkpoint_1"));
    acc.save_state();
    EXPECT_THAT(checkpoints_in(dir), ElementsAre("checkpoint_1", "checkpoint_2"));
  }, project_options(dir.str(), 2));
  // With a limit of one, the save still keeps the checkpoint it made.
  run_accelerators(1, [&](const Accelerator& acc, int) {
    Training t;
    (void)acc.prepare(t.net, t.adam);
    acc.set_save_iteration(0);
    fs::remove_all(dir.path() / "checkpoints/checkpoint_0");
    acc.save_state();
    EXPECT_THAT(checkpoints_in(dir), ElementsAre("checkpoint_0"));
  }, project_options(dir.str(), 1));
}

TEST(LoadState, TheNewestCompleteCheckpointSkipsAnEmptyFolderOfThatNameAndNamesIt) {
  TempDir dir;
  const auto newest = train_and_save(dir, 2);
  fs::create_directories(dir.path() / "checkpoints/checkpoint_5");
  fs::create_directories(dir.path() / "checkpoints/checkpoint_7");
  detail::write_file((dir.path() / "checkpoints/checkpoint_7/model.safetensors").string(), "half");
  CapturedLines lines;
  run_accelerators(1, [&](const Accelerator& acc, int) {
    Training t;
    auto [model, opt, loader] = acc.prepare(t.net, t.adam, t.loader);
    acc.load_state();
    EXPECT_TRUE(torch::equal(model->weight, newest));
    EXPECT_EQ(acc.save_iteration(), 2);
  }, project_options(dir.str()));
  EXPECT_TRUE(lines.saw("skipped checkpoint_5, checkpoint_7 in " + dir.str() + "/checkpoints: not complete"));
  // Only incomplete folders: the error names them.
  fs::remove_all(dir.path() / "checkpoints/checkpoint_0");
  fs::remove_all(dir.path() / "checkpoints/checkpoint_1");
  run_accelerators(1, [&](const Accelerator& acc, int) {
    EXPECT_THROWS_WITH(acc.load_state(), "no complete checkpoint in " + dir.str() +
                                             "/checkpoints (not complete: checkpoint_5, checkpoint_7)");
  }, project_options(dir.str()));
}

// Rewrites one tensor of a safetensors file with another dtype, keeping its metadata.
void retype_tensor(const std::string& path, const std::string& name, c10::ScalarType dtype) {
  SafetensorsFile file(path);
  TensorMap tensors;
  for (const auto& key : file.keys()) tensors.emplace(key, file.get_tensor(key).clone());
  const auto metadata = file.metadata();
  tensors.at(name) = tensors.at(name).mul(100).to(dtype);
  save_file(tensors, path, metadata);
}

TEST(LoadState, AModelTensorOfAnotherDtypeIsRefusedNamingFileTensorAndDtypesUnlessConversionIsAsked) {
  TempDir dir;
  run_accelerators(1, [&](const Accelerator& acc, int) {
    Training t;
    auto [model, opt, loader] = acc.prepare(t.net, t.adam, t.loader);
    train_one_pass(acc, model, opt, loader);
    acc.save_state(dir.str() + "/ckpt");
    const auto file = dir.str() + "/ckpt/model.safetensors";
    retype_tensor(file, "weight", at::kInt);
    const auto saved = load_file(file).at("weight");
    train_one_pass(acc, model, opt, loader);
    const auto weight = model->weight.clone();
    const auto exp_avg = optimizer_state_dict(*t.adam).tensors.at("state.0.exp_avg").clone();
    const auto error = error_of([&] { acc.load_state(dir.str() + "/ckpt"); });
    EXPECT_THAT(error, HasSubstr("dtype mismatch for weight in " + file +
                                 ": the checkpoint holds int32, the module holds float32; set "
                                 "LoadStateOptions::convert_dtypes to convert"));
    EXPECT_TRUE(torch::equal(model->weight, weight)) << "a refused load changed the model";
    EXPECT_TRUE(torch::equal(optimizer_state_dict(*t.adam).tensors.at("state.0.exp_avg"), exp_avg))
        << "a refused load changed the optimizer";
    EXPECT_THROW(acc.load_state(dir.str() + "/ckpt"), c10::ValueError);
    // Asked for, the conversion happens.
    acc.load_state(dir.str() + "/ckpt", {.convert_dtypes = true});
    EXPECT_TRUE(torch::equal(model->weight, saved.to(at::kFloat)));
    EXPECT_EQ(model->weight.scalar_type(), at::kFloat);
  });
  // load_checkpoint_in_model refuses it too, and converts when asked.
  torch::nn::Linear plain(3, 1);
  EXPECT_THROWS_WITH(load_checkpoint_in_model(*plain, dir.str() + "/ckpt/model.safetensors"),
                     "[load_checkpoint_in_model] dtype mismatch for weight in " + dir.str() + "/ckpt/model.safetensors");
  load_checkpoint_in_model(*plain, dir.str() + "/ckpt/model.safetensors", {.convert_dtypes = true});
  EXPECT_EQ(plain->weight.scalar_type(), at::kFloat);
}

TEST(LoadState, AnOptimizerStateOfAnotherDtypeIsRefusedAtLoadNamingTheFileNotAtTheFirstStep) {
  TempDir dir;
  run_accelerators(1, [&](const Accelerator& acc, int) {
    Training t;
    auto [model, opt, loader] = acc.prepare(t.net, t.adam, t.loader);
    train_one_pass(acc, model, opt, loader);
    acc.save_state(dir.str() + "/ckpt");
    const auto file = dir.str() + "/ckpt/optimizer.safetensors";
    retype_tensor(file, "state.0.exp_avg", at::kInt);
    const auto weight = model->weight.clone();
    EXPECT_THROWS_WITH(acc.load_state(dir.str() + "/ckpt"),
                       file + ": state of parameter 0: tensor state.0.exp_avg holds int32 but its parameter holds "
                              "float32");
    EXPECT_TRUE(torch::equal(model->weight, weight));
    acc.load_state(dir.str() + "/ckpt", {.convert_dtypes = true});
    EXPECT_EQ(optimizer_state_dict(*t.adam).tensors.at("state.0.exp_avg").scalar_type(), at::kFloat);
    train_one_pass(acc, model, opt, loader);  // and training goes on
  });
}

TEST(LoadState, WeightsHoldingNaNWhereTheModelHadNoneAreNamedInAWarning) {
  TempDir dir;
  CapturedLines lines;
  run_accelerators(1, [&](const Accelerator& acc, int) {
    Training t;
    auto [model, opt] = acc.prepare(t.net, t.adam);
    acc.save_state(dir.str() + "/ckpt");
    acc.load_state(dir.str() + "/ckpt");
    EXPECT_FALSE(lines.saw("NaN or infinite")) << "a finite checkpoint was warned about";
    const auto file = dir.str() + "/ckpt/model.safetensors";
    auto weights = load_file(file);
    weights.at("bias") = torch::full({1}, std::numeric_limits<float>::quiet_NaN());
    save_file(weights, file);
    acc.load_state(dir.str() + "/ckpt");
  });
  EXPECT_TRUE(lines.saw(dir.str() + "/ckpt/model.safetensors: 1 tensor(s) hold NaN or infinite values where the "
                                    "module's had none: bias"));
}

struct Limited {
  int value = 0;
  nlohmann::json state_dict() const { return {{"value", value}, {"name", "limited"}}; }
  void load_state_dict(const nlohmann::json& state) {
    const int v = state.at("value").get<int>();
    TORCH_CHECK_VALUE(v >= 0, "[Limited] a value >= 0, got ", v);
    value = v;
  }
};

TEST(LoadState, EveryStateFileIsCheckedBeforeAnythingChangesAndItsErrorsNameFileAndKey) {
  TempDir dir;
  run_accelerators(1, [&](const Accelerator& acc, int) {
    Training t;
    auto schedule = std::make_shared<LambdaLR>(t.adam, [](int64_t epoch) { return 1.0 / (1 + epoch); });
    auto [model, opt, loader, sched] = acc.prepare(t.net, t.adam, t.loader, schedule);
    Limited limited{3};
    acc.register_for_checkpointing(limited);
    train_one_pass(acc, model, opt, loader);
    sched.step();
    acc.save_state(dir.str() + "/ckpt");
    train_one_pass(acc, model, opt, loader);
    sched.step();
    limited.value = 8;
    const auto weight = model->weight.clone();
    const auto expect_unchanged = [&](const std::string& what) {
      EXPECT_TRUE(torch::equal(model->weight, weight)) << what;
      EXPECT_EQ(sched.scheduler()->last_epoch(), 2) << what;
      EXPECT_EQ(limited.value, 8) << what;
    };
    const auto copy = [&](const std::string& name) {
      fs::remove_all(dir.path() / name);
      fs::copy(dir.path() / "ckpt", dir.path() / name, fs::copy_options::recursive);
      return dir.str() + "/" + name;
    };
    const auto edit_json = [](const std::string& path, const std::function<void(nlohmann::json&)>& edit) {
      auto json = nlohmann::json::parse(detail::read_file(path));
      edit(json);
      detail::write_file(path, json.dump());
    };

    // A registered object's value of the wrong JSON type: named with file and key before its
    // own code would meet it.
    auto folder = copy("custom_type");
    edit_json(folder + "/custom_checkpoint_0.json", [](auto& j) { j["value"] = "three"; });
    EXPECT_THROWS_WITH(acc.load_state(folder), folder + "/custom_checkpoint_0.json: \"value\" holds a string where "
                                                        "the object's state holds a number");
    expect_unchanged("custom_type");

    // The object's own refusal comes after the scheduler was loaded: the scheduler is put back.
    folder = copy("custom_value");
    edit_json(folder + "/custom_checkpoint_0.json", [](auto& j) { j["value"] = -1; });
    EXPECT_THROWS_WITH(acc.load_state(folder), folder + "/custom_checkpoint_0.json: [Limited] a value >= 0, got -1");
    expect_unchanged("custom_value");

    // A scheduler state of the wrong type names scheduler.json.
    folder = copy("scheduler");
    edit_json(folder + "/scheduler.json", [](auto& j) { j["last_epoch"] = "one"; });
    EXPECT_THROWS_WITH(acc.load_state(folder), folder + "/scheduler.json: [LambdaLR::load_state_dict]");
    expect_unchanged("scheduler");

    // A data loader's state of the wrong type names its file.
    folder = copy("sampler");
    edit_json(folder + "/sampler.json", [](auto& j) { j["epoch"] = "two"; });
    EXPECT_THROWS_WITH(acc.load_state(folder), folder + "/sampler.json: ");
    expect_unchanged("sampler");

    // A model tensor of another dtype: refused before anything is applied.
    folder = copy("model");
    retype_tensor(folder + "/model.safetensors", "bias", at::kDouble);
    EXPECT_THROWS_WITH(acc.load_state(folder), "dtype mismatch for bias");
    expect_unchanged("model");

    acc.load_state(dir.str() + "/ckpt");
    EXPECT_EQ(limited.value, 3);
    EXPECT_EQ(sched.scheduler()->last_epoch(), 1);
  });
}

TEST(LoadState, AModelOrOptimizerThatFailsItsChecksLeavesTheOtherAsItWas) {
  // The two load side by side: each one's checks run before either changes.
  TempDir dir;
  run_accelerators(1, [&](const Accelerator& acc, int) {
    Training t;
    auto [model, opt, loader] = acc.prepare(t.net, t.adam, t.loader);
    train_one_pass(acc, model, opt, loader);
    acc.save_state(dir.str() + "/ckpt");
    fs::copy(dir.path() / "ckpt", dir.path() / "bad_model", fs::copy_options::recursive);
    fs::copy(dir.path() / "ckpt", dir.path() / "bad_optimizer", fs::copy_options::recursive);
    auto weights = load_file(dir.str() + "/bad_model/model.safetensors");
    weights.emplace("weigh", weights.at("weight"));
    weights.erase("weight");
    save_file(weights, dir.str() + "/bad_model/model.safetensors");
    auto optimizer = load_state_dict_file(dir.str() + "/bad_optimizer/optimizer.safetensors");
    optimizer.values["state"]["0"].erase("step");
    save_state_dict_file(optimizer, dir.str() + "/bad_optimizer/optimizer.safetensors");

    train_one_pass(acc, model, opt, loader);
    const auto weight = model->weight.clone();
    const auto exp_avg = optimizer_state_dict(*t.adam).tensors.at("state.0.exp_avg").clone();
    const auto step = optimizer_state_dict(*t.adam).values["state"]["0"]["step"];
    EXPECT_THROWS_WITH(acc.load_state(dir.str() + "/bad_model"), "missing keys [weight], unexpected keys [weigh]");
    EXPECT_TRUE(torch::equal(optimizer_state_dict(*t.adam).tensors.at("state.0.exp_avg"), exp_avg));
    EXPECT_EQ(optimizer_state_dict(*t.adam).values["state"]["0"]["step"], step);
    EXPECT_THROWS_WITH(acc.load_state(dir.str() + "/bad_optimizer"),
                       dir.str() + "/bad_optimizer/optimizer.safetensors: state of parameter 0: missing \"step\"");
    EXPECT_TRUE(torch::equal(model->weight, weight));
  });
}

TEST(LoadState, ErrorsOfEveryCheckpointEntryPointAreC10ErrorsOnEveryProcess) {
  TempDir dir;
  detail::write_file((dir.path() / "a_file").string(), "x");
  std::vector<std::string> kinds(2);
  run_accelerators(2, [&](const Accelerator& acc, int rank) {
    Training t;
    auto [model, opt] = acc.prepare(t.net, t.adam);
    // A folder that cannot be made: an operation that failed.
    EXPECT_THROW(acc.save_state((dir.path() / "a_file/ckpt").string()), c10::Error);
    acc.save_state(dir.str() + "/ckpt");
    // Bad input: a value error, on every process.
    EXPECT_THROW(acc.load_state(dir.str() + "/nowhere"), c10::ValueError);
    acc.wait_for_everyone();
    if (rank == 0) fs::remove(dir.path() / "ckpt/optimizer.safetensors");
    acc.wait_for_everyone();
    try {
      acc.load_state(dir.str() + "/ckpt");
      kinds[rank] = "none";
    } catch (const c10::ValueError& e) {
      kinds[rank] = std::string("ValueError: ") + e.what_without_backtrace();
    } catch (const c10::Error& e) {
      kinds[rank] = std::string("Error: ") + e.what_without_backtrace();
    }
  });
  for (const auto& kind : kinds) {
    EXPECT_THAT(kind, HasSubstr("ValueError: [Accelerator::load_state] loading " + dir.str() + "/ckpt failed on "
                                "process 0: the checkpoint has no optimizer.safetensors"));
  }
  // The free functions.
  EXPECT_THROW(save_file({{"a", at::ones({1})}}, (dir.path() / "a_file/x.safetensors").string()), c10::Error);
  EXPECT_THROW(load_state_dict_file((dir.path() / "missing.json").string()), c10::ValueError);
  EXPECT_THROW(SafetensorsFile((dir.path() / "a_file").string()), c10::Error);
  torch::nn::Linear net(3, 1);
  EXPECT_THROW(load_checkpoint_in_model(*net, (dir.path() / "missing.safetensors").string()), c10::Error);
  EXPECT_THROW(save_state_dict_file({}, (dir.path() / "a_file/s.json").string()), c10::Error);
}

}  // namespace
}  // namespace accelerate::testing
