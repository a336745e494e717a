// `accelerate test`: the built-in end-to-end checks; see include/accelerate/commands/test.h.
#include "accelerate/commands/test.h"

#include "accelerate/accelerator.h"
#include "accelerate/commands/launch.h"
#include "accelerate/utils/environment.h"
#include "detail/check.h"
#include "detail/files.h"

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <numeric>
#include <random>
#include <sstream>

namespace accelerate::commands {
namespace {

namespace fs = std::filesystem;

// A check compares what the job computed with what it must be; `fail_on_purpose` shifts the
// expectation so that a deliberately failing check exercises the reporting path.
struct CheckContext {
  Accelerator& accelerator;
  bool fail_on_purpose;
  fs::path scratch;  // a folder of the same name on every machine
};

void expect(bool ok, const std::string& check, const std::string& what) {
  TORCH_CHECK(ok, "[accelerate test] check '", check, "' failed on process ", PartialState().process_index(), ": ",
              what);
}

void check_process_control(const CheckContext& c) {
  const Accelerator& acc = c.accelerator;
  const int n = acc.num_processes();
  const int shift = c.fail_on_purpose ? 1 : 0;
  // Every process has its own index, and they are 0..n-1.
  auto indices = acc.gather(torch::tensor({static_cast<int64_t>(acc.process_index())}));
  expect(torch::equal(indices, torch::arange(n, torch::kLong) + shift), "process_control",
         c10::str("the gathered process indices are ", indices, " instead of 0..", n - 1));

  // The main process runs first, then the others.
  const fs::path order = c.scratch / "order.txt";
  acc.main_process_first([&] { std::ofstream(order, std::ios::app) << acc.process_index() << "\n"; });
  acc.wait_for_everyone();
  if (acc.is_main_process()) {  // the file holds the processes of the main
                                // process's machine
    std::ifstream in(order);
    int first = -1, lines = 0;
    for (int value; in >> value; ++lines) {
      if (lines == 0) first = value;
    }
    expect(first == 0 && lines == PartialState().local_num_processes(), "process_control",
           c10::str("main_process_first let process ", first, " run first (", lines, " processes ran)"));
  }
  acc.wait_for_everyone();

  // split_between_processes hands out contiguous shares that put together give the input back.
  std::vector<int64_t> items(2 * n + 1);
  std::iota(items.begin(), items.end(), 0);
  auto mine = acc.split_between_processes(items);
  std::vector<int64_t> joined;
  for (const auto& share : gather_object(PartialState(), std::vector<std::vector<int64_t>>{mine})) {
    joined.insert(joined.end(), share.begin(), share.end());
  }
  if (c.fail_on_purpose) joined.push_back(-1);
  expect(joined == items, "process_control", "split_between_processes lost or repeated items");
}

void check_data_sharding(const CheckContext& c) {
  Accelerator& acc = c.accelerator;
  const int n = acc.num_processes();
  const int64_t length = 3 * 4 * n + 1;  // not a multiple of the batch size times the processes
  auto data = std::make_shared<TensorDataset>(torch::arange(length, torch::kLong));
  auto loader = acc.prepare(DataLoader(data, {.batch_size = 3}));
  std::vector<torch::Tensor> seen;
  int64_t batches = 0;
  for (auto& batch : loader) {
    seen.push_back(acc.gather_for_metrics(batch.data));
    ++batches;
  }
  auto all = torch::cat(seen);
  auto expected = torch::arange(length + (c.fail_on_purpose ? 1 : 0), torch::kLong);
  expect(all.numel() == expected.numel() && torch::equal(std::get<0>(all.sort()), expected), "data_sharding",
         c10::str("the processes together saw ", all.numel(), " samples instead of each of the ", expected.numel(),
                  " once"));
  // Even batches: every process ran the same number of steps.
  auto counts = acc.gather(torch::tensor({batches}));
  expect((counts == batches).all().item<bool>(), "data_sharding",
         c10::str("the processes ran different numbers of batches: ", counts));
}

struct LineImpl : torch::nn::Module {
  LineImpl() {
    a = register_parameter("a", torch::zeros({}));
    b = register_parameter("b", torch::zeros({}));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x * a + b; }
  torch::Tensor a, b;
};
TORCH_MODULE(Line);

void check_training(const CheckContext& c) {
  Accelerator& acc = c.accelerator;
  const int n = acc.num_processes();
  const int64_t batch = 4;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(42);
  auto x = at::randn({batch * n * 4}, gen);
  auto data = std::make_shared<TensorDataset>(x, 2 * x + 3);

  // One process over batches of batch × n ...
  Line baseline;
  torch::optim::SGD baseline_opt(baseline->parameters(), 0.1);
  for (int epoch = 0; epoch < 3; ++epoch) {
    for (auto& b : DataLoader(data, {.batch_size = batch * n})) {
      baseline_opt.zero_grad();
      torch::mse_loss(baseline(b.data), b.target).backward();
      baseline_opt.step();
    }
  }
  // ... equals n processes over batches of `batch` with synchronised gradients.
  Line net;
  auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(), 0.1);
  auto [model, optimizer, loader] = acc.prepare(net, sgd, DataLoader(data, {.batch_size = batch}));
  for (int epoch = 0; epoch < 3; ++epoch) {
    for (auto& b : loader) {
      optimizer.zero_grad();
      acc.backward(torch::mse_loss(model(b.data), b.target));
      optimizer.step();
    }
  }
  const double a = net->a.item<double>() + (c.fail_on_purpose ? 1 : 0), b = net->b.item<double>();
  const double a0 = baseline->a.item<double>(), b0 = baseline->b.item<double>();
  expect(std::abs(a - a0) <= 1e-5 + 1.3e-6 * std::abs(a0) && std::abs(b - b0) <= 1e-5 + 1.3e-6 * std::abs(b0),
         "training",
         c10::str("distributed training gave a=", a, " b=", b, ", one process on the whole batch a=", a0, " b=", b0));
}

void check_collectives(const CheckContext& c) {
  const Accelerator& acc = c.accelerator;
  const int n = acc.num_processes();
  const int rank = acc.process_index();
  auto sum = acc.reduce(torch::tensor({static_cast<double>(rank + 1)}), "sum");
  const double expected_sum = n * (n + 1) / 2.0 + (c.fail_on_purpose ? 1 : 0);
  expect(sum.item<double>() == expected_sum, "collectives",
         c10::str("reduce(sum) of 1..", n, " gave ", sum.item<double>()));
  auto from_last = broadcast(PartialState(), torch::full({2}, static_cast<double>(rank)), n - 1);
  expect(torch::equal(from_last, torch::full({2}, static_cast<double>(n - 1))), "collectives",
         c10::str("broadcast from the last process gave ", from_last));
  // Tensors of different lengths are padded to the longest, then gathered.
  auto padded = acc.pad_across_processes(torch::ones({rank + 1}), /*dim=*/0,
                                         /*pad_index=*/-1);
  expect(padded.size(0) == n && padded.slice(0, rank + 1).eq(-1).all().item<bool>(), "collectives",
         c10::str("pad_across_processes gave ", padded));
  auto gathered = acc.gather(padded.unsqueeze(0));
  expect(gathered.sizes() == torch::IntArrayRef({n, n}), "collectives",
         c10::str("gather of padded tensors has shape ", gathered.sizes()));
}

void check_checkpoint(const CheckContext& c) {
  Accelerator& acc = c.accelerator;
  torch::manual_seed(0);
  torch::nn::Linear net(4, 2);
  auto adam = std::make_shared<torch::optim::Adam>(net->parameters(), 0.01);
  auto [model, optimizer] = acc.prepare(net, adam);
  auto step = [&] {
    optimizer.zero_grad();
    acc.backward(model(torch::ones({2, 4})).pow(2).sum());
    optimizer.step();
  };
  step();
  const std::string folder = acc.save_state((c.scratch / "checkpoint").string());
  const auto saved = net->weight.detach().clone();
  step();
  const auto next = net->weight.detach().clone();
  acc.load_state(folder);
  expect(torch::equal(net->weight.detach(), saved) != c.fail_on_purpose, "checkpoint",
         "load_state did not restore the weights save_state saved");
  // Adam's moments came back too: the same step from the restored state gives the same weights.
  step();
  expect(torch::equal(net->weight.detach(), next), "checkpoint",
         "a step after load_state differs from the step after save_state "
         "(optimizer state not restored)");
}

const std::vector<std::pair<std::string, std::function<void(const CheckContext&)>>>& checks() {
  static const std::vector<std::pair<std::string, std::function<void(const CheckContext&)>>> all = {
      {"process_control", check_process_control},
      {"data_sharding", check_data_sharding},
      {"training", check_training},
      {"collectives", check_collectives},
      {"checkpoint", check_checkpoint}};
  return all;
}

}  // namespace

const std::vector<std::string>& test_checks() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const auto& [name, fn] : checks()) out.push_back(name);
    return out;
  }();
  return names;
}

void run_test_checks() {
  const std::string fail = get_env("ACCELERATE_TEST_FAIL_CHECK").value_or("");
  TORCH_CHECK_VALUE(fail.empty() || std::count(test_checks().begin(), test_checks().end(), fail) == 1,
                    "[accelerate test] ACCELERATE_TEST_FAIL_CHECK names no check: '", fail, "'");
  Accelerator accelerator({.project_config = {.save_on_each_node = true}});
  // The main process picks a folder name; the main process of each machine creates it.
  std::vector<std::string> name = {""};
  if (accelerator.is_main_process()) {
    std::random_device random;
    name[0] = "accelerate-test-" + std::to_string(random()) + std::to_string(random());
  }
  broadcast_object_list(PartialState(), name);
  const fs::path scratch = fs::temp_directory_path() / name[0];
  if (accelerator.is_local_main_process()) fs::create_directories(scratch);
  accelerator.wait_for_everyone();

  accelerator.print("accelerate test: running", checks().size(), "checks on", accelerator.num_processes(),
                    "process(es),", to_string(accelerator.distributed_type()), "with mixed precision",
                    accelerator.mixed_precision());
  try {
    for (const auto& [check_name, fn] : checks()) {
      fn(CheckContext{accelerator, check_name == fail, scratch});
      accelerator.wait_for_everyone();
      accelerator.print("  check", check_name + ":", "ok");
    }
  } catch (...) {
    (void)detail::try_remove_tree(scratch);
    throw;
  }
  accelerator.wait_for_everyone();
  if (accelerator.is_local_main_process()) detail::remove_tree(scratch);
}

int test_main(const std::vector<std::string>& argv, const std::string& accelerate_program) {
  CLI::App app{
      "Run a short end-to-end check of the configured setup: process "
      "control, data sharding, training "
      "equivalence, collectives and a checkpoint save/load.",
      "accelerate test"};
  std::string config_file;
  bool run_checks = false;
  app.set_help_flag("-h,--help", "Show this help and exit");
  app.add_option("--config_file,--config-file", config_file,
                 "The configuration to test (default: the default "
                 "configuration file when it exists)");
  app.add_flag("--run_checks", run_checks, "Run the checks in this process (what each launched process does)");
  try {
    std::vector<std::string> reversed(argv.rbegin(), argv.rend());
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return 0;
  } catch (const CLI::ParseError& e) {
    std::cerr << "accelerate test: error: " << e.what() << "\n" << app.help();
    return 2;
  }
  if (run_checks) {
    try {
      run_test_checks();
    } catch (const std::exception& e) {
      // Escapes main, so the launcher reports it as the root cause; without LibTorch's backtrace.
      throw std::runtime_error(detail::error_text(e));
    }
    return 0;
  }
  std::vector<std::string> launch_argv;
  if (!config_file.empty()) launch_argv = {"--config_file", config_file};
  launch_argv.insert(launch_argv.end(), {accelerate_program, "test", "--run_checks"});
  std::cout << "Running: accelerate launch";
  for (const auto& arg : launch_argv) std::cout << " " << arg;
  std::cout << std::endl;
  const int code = launch_main(launch_argv);
  if (code == 0) {
    std::cout << "Test is a success! You are ready for your distributed training!" << std::endl;
  } else {
    std::cout << "Test failed (exit code " << code << "): see the error above." << std::endl;
  }
  return code;
}

}  // namespace accelerate::commands
