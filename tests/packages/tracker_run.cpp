// A run that logs through the W&B and MLflow trackers for tests/packages/trackers_check.py, which
// reads it back with the real packages. Its values are fixed so that the reader can check each:
//   tracker_run <log_with (comma separated)> <project> <steps> [<pause step> <control folder>]
// With a pause step, the run stops before that step's log, writes <control>/paused and waits for
// <control>/resume (the server is killed meanwhile); then logs three steps, writes
// <control>/logged_while_down and waits for <control>/finish (the server is started again).
// After the steps: a log at step 0 (W&B drops it), two logs without a step.
// Prints one JSON line: the W&B run folder, the MLflow run id, what MLflow still held.
#include <accelerate/accelerate.h>

#include <chrono>
#include <cstdlib>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

namespace fs = std::filesystem;

namespace {

void wait_for(const fs::path& file) {
  for (int i = 0; i < 6000 && !fs::exists(file); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  if (!fs::exists(file)) throw std::runtime_error("tracker_run: nobody wrote " + file.string());
}

void touch(const fs::path& file) { std::ofstream(file) << "\n"; }

}  // namespace

int main(int argc, char** argv) try {
  if (argc != 4 && argc != 6) {
    std::cerr << "usage: tracker_run <log_with> <project> <steps> [<pause step> <control folder>]\n";
    return 2;
  }
  std::vector<accelerate::Tracker> log_with;
  std::stringstream names(argv[1]);
  for (std::string name; std::getline(names, name, ',');) log_with.emplace_back(name);
  const std::string project = argv[2];
  const int steps = std::stoi(argv[3]);
  const int pause = argc == 6 ? std::stoi(argv[4]) : -1;
  const fs::path control = argc == 6 ? argv[5] : "";

  accelerate::Accelerator accelerator({.log_with = log_with, .project_dir = "project"});
  const nlohmann::json config = {{"learning_rate", 0.001}, {"batch_size", 32}, {"model", "gpt"},
                                 {"use_amp", true},        {"dropout", nullptr}, {"long_text", std::string(70000, 'x')}};
  nlohmann::json init_kwargs = nlohmann::json::object();
  for (const auto& t : log_with) {
    if (t.name() == "wandb") {
      init_kwargs["wandb"] = {{"name", "cpp-run"}, {"tags", {"cpp", "test"}}, {"notes", "from accelerate-cpp"}};
    }
    if (t.name() == "mlflow") {
      init_kwargs["mlflow"] = {{"run_name", "cpp-run"}, {"tags", {{"team", "cpp"}}},
                               {"description", "from accelerate-cpp"},
                               {"flush_timeout", std::getenv("TRACKER_RUN_FLUSH_TIMEOUT") != nullptr
                                                     ? std::stod(std::getenv("TRACKER_RUN_FLUSH_TIMEOUT"))
                                                     : 120.0}};
    }
  }
  accelerator.init_trackers(project, config, init_kwargs);
  for (int step = 0; step < steps; ++step) {
    if (step == pause) {
      touch(control / "paused");
      wait_for(control / "resume");
    }
    if (pause >= 0 && step == pause + 3) {
      touch(control / "logged_while_down");
      wait_for(control / "finish");
    }
    accelerator.log({{"loss", 1.0 / (step + 1)}, {"accuracy", step * 0.01}, {"grad_norm", std::sqrt(step + 1.0)}},
                    step);
    if (step == 1) {
      accelerator.log({{"note", "halfway"}, {"lr", {{"group0", 0.5}, {"group1", 0.25}}}}, step);
      for (const auto& tracker : accelerator.trackers()) {
        if (tracker->name() == "wandb") {
          tracker->log_images({{"samples", torch::linspace(0, 1, 2 * 3 * 4 * 5).reshape({2, 3, 4, 5})}}, step);
        }
      }
    }
  }
  // W&B's step rules: an earlier step is dropped; without a step, the pending row is committed at
  // the current step and the next call goes to the step after.
  accelerator.log({{"late", 1}}, 0);
  accelerator.log({{"auto", 1}});
  accelerator.log({{"auto", 2}});
  accelerator.end_training();

  nlohmann::json out = nlohmann::json::object();
  for (const auto& tracker : accelerator.trackers()) {
    if (auto wandb = std::dynamic_pointer_cast<accelerate::WandBTracker>(tracker)) out["wandb_run_dir"] = wandb->run_dir();
    if (auto mlflow = std::dynamic_pointer_cast<accelerate::MLflowTracker>(tracker)) {
      out["mlflow_run_id"] = mlflow->run_id();
      out["mlflow_pending"] = mlflow->pending();
      out["mlflow_pending_file"] = mlflow->pending_file();
    }
  }
  std::cout << out.dump() << std::endl;
  return 0;
} catch (const std::exception& e) {
  std::cerr << "tracker_run: " << e.what() << "\n";
  return 1;
}
