// The examples run as documented, on two processes through the launcher: the main character-level
// GPT job learns and resumes from its newest checkpoint, and each by-feature example does what its
// feature promises.
#include "accelerate/utils/safetensors.h"
#include "support/process.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <regex>

namespace accelerate::testing {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<Running> launch_example(const std::string& program, std::vector<std::string> args,
                                        double seconds = 180, int processes = 2) {
  std::vector<std::string> argv = {accelerate_bin(),      "launch", "--num_processes",           std::to_string(processes),
                                   "--main_process_port", "0",      built("examples/" + program)};
  argv.insert(argv.end(), args.begin(), args.end());
  return run(argv, seconds);
}

// The example as one process, without the launcher.
std::unique_ptr<Running> run_example_alone(const std::string& program, const std::vector<std::string>& args,
                                           double seconds = 180) {
  std::vector<std::string> argv = {built("examples/" + program)};
  argv.insert(argv.end(), args.begin(), args.end());
  return run(argv, seconds);
}

// Every number following `label` in `text`, in order.
std::vector<double> numbers_after(const std::string& text, const std::string& label) {
  std::vector<double> values;
  const std::regex re(label + " ([0-9.]+)");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), re); it != std::sregex_iterator(); ++it) {
    values.push_back(std::stod((*it)[1].str()));
  }
  return values;
}

const std::vector<std::string> kSmallGpt = {"--n_layer",      "1",  "--n_embd",           "64", "--batch_size",   "8",
                                            "--eval_every",   "20", "--checkpoint_every", "20", "--warmup_steps", "5",
                                            "--eval_samples", "64", "--sample_length",    "40"};

std::vector<std::string> small_gpt(const std::string& output_dir, std::vector<std::string> extra) {
  std::vector<std::string> args = kSmallGpt;
  args.insert(args.end(), {"--output_dir", output_dir});
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

TEST(CharGptExample, TheValidationLossFallsOnTwoProcesses) {
  TempDir dir;
  auto r = launch_example("char_gpt", small_gpt(dir.str(), {"--max_steps", "40"}));
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  const auto losses = numbers_after(r->err, "val_loss");
  ASSERT_EQ(losses.size(), 3u) << r->err;  // steps 0, 20, 40
  EXPECT_GT(losses[0], 4.0);               // about ln(65): a uniform guess over the characters
  EXPECT_LT(losses[2], losses[0] - 0.8) << r->err;
  EXPECT_THAT(r->out, HasSubstr("---- sample ----"));
  EXPECT_THAT(r->err, HasSubstr("train: 100% 40/40"));
  // Checkpoints at steps 20 and 40, and logs only from rank 0.
  EXPECT_TRUE(std::filesystem::is_directory(dir.path() / "checkpoints/checkpoint_1"));
  EXPECT_THAT(r->err, ::testing::Not(HasSubstr("[rank1]: 20")));

  // The same losses went to the JSONL log, and a TensorBoard event file exists beside it.
  std::ifstream jsonl(dir.path() / "logs/char_gpt/log.jsonl");
  std::vector<std::pair<int64_t, double>> logged;
  for (std::string line; std::getline(jsonl, line);) {
    const auto record = nlohmann::json::parse(line);
    if (record.at("values").contains("val_loss")) {
      logged.emplace_back(record.at("step").get<int64_t>(), record.at("values").at("val_loss").get<double>());
    }
  }
  ASSERT_EQ(logged.size(), 3u);
  EXPECT_EQ(logged[0].first, 0);
  EXPECT_EQ(logged[2].first, 40);
  EXPECT_NEAR(logged[0].second, losses[0], 1e-4);
  EXPECT_NEAR(logged[2].second, losses[2], 1e-4);
  bool event_file = false;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path() / "logs/char_gpt")) {
    event_file = event_file || entry.path().filename().string().rfind("events.out.tfevents.", 0) == 0;
  }
  EXPECT_TRUE(event_file);
}

TEST(CharGptExample, ResumeContinuesFromTheNewestCheckpoint) {
  TempDir dir;
  auto first = launch_example("char_gpt", small_gpt(dir.str(), {"--max_steps", "20"}));
  ASSERT_EQ(first->exit_code(), 0) << first->out << first->err;
  auto resumed = launch_example("char_gpt", small_gpt(dir.str(), {"--max_steps", "40", "--resume"}));
  ASSERT_EQ(resumed->exit_code(), 0) << resumed->out << resumed->err;
  EXPECT_THAT(resumed->err, HasSubstr("resumed from checkpoint at step 20"));
  // No step 0 evaluation: training went on from step 20 to 40.
  EXPECT_THAT(resumed->err, ::testing::Not(HasSubstr("step 0: val_loss")));
  EXPECT_THAT(resumed->err, HasSubstr("step 40: train_loss"));
  EXPECT_TRUE(std::filesystem::is_directory(dir.path() / "checkpoints/checkpoint_1"));
}

TEST(CharGptExample, ANewRunInAnEarlierRunsFolderKeepsItsCheckpointsAndABadCheckpointIsNamedNotAborted) {
  TempDir dir;
  const auto checkpoints = dir.path() / "checkpoints";
  const std::vector<std::string> every_10 = {"--max_steps", "20", "--checkpoint_every", "10", "--total_limit", "2"};
  auto first = launch_example("char_gpt", small_gpt(dir.str(), every_10));
  ASSERT_EQ(first->exit_code(), 0) << first->out << first->err;
  ASSERT_TRUE(std::filesystem::is_directory(checkpoints / "checkpoint_1"));
  // A second run, not resumed, in the same folder: its checkpoints follow the first run's and stay.
  auto second = launch_example("char_gpt", small_gpt(dir.str(), every_10));
  ASSERT_EQ(second->exit_code(), 0) << second->out << second->err;
  EXPECT_THAT(second->err, HasSubstr("this run's checkpoints are numbered from checkpoint_2"));
  EXPECT_TRUE(std::filesystem::is_directory(checkpoints / "checkpoint_2"));
  EXPECT_TRUE(std::filesystem::is_directory(checkpoints / "checkpoint_3"));
  EXPECT_FALSE(std::filesystem::exists(checkpoints / "checkpoint_0"));
  EXPECT_FALSE(std::filesystem::exists(checkpoints / "checkpoint_1"));

  // A weight stored with another dtype: the resume fails naming the file, tensor and dtypes, with
  // the main job's own error line and status (a c10::Error it catches, not an abort), and
  // nothing is removed.
  const auto file = (checkpoints / "checkpoint_3/model.safetensors").string();
  TensorMap weights;
  {
    SafetensorsFile saved(file);
    for (const auto& key : saved.keys()) weights.emplace(key, saved.get_tensor(key).clone());
  }
  auto& first_weight = weights.begin()->second;
  first_weight = first_weight.to(at::kInt);
  save_file(weights, file);
  auto resumed = launch_example("char_gpt", small_gpt(dir.str(), {"--max_steps", "30", "--resume"}));
  EXPECT_EQ(resumed->exit_code(), 1) << resumed->out << resumed->err;
  EXPECT_THAT(resumed->err, HasSubstr("dtype mismatch for " + weights.begin()->first + " in " + file +
                                      ": the checkpoint holds int32, the module holds float32"));
  EXPECT_THAT(resumed->err, ::testing::Not(HasSubstr("SIGABRT")));
  EXPECT_TRUE(std::filesystem::is_directory(checkpoints / "checkpoint_2"));
  EXPECT_TRUE(std::filesystem::is_directory(checkpoints / "checkpoint_3"));
}

// --tp_size 2: both processes train on the same batches, each computing half of every block's
// heads and MLP. The loss falls as on two data-parallel processes (the same global batch), the
// sample prints once, and the checkpoints hold whole tensors, so the run resumes without tensor
// parallelism. The blocks' norms are sequence-parallel (each process normalises half of each
// window, the gradients of their weights summed over the pair).
TEST(CharGptExample, TensorParallelTrainingLearnsAndItsCheckpointResumesWithoutIt) {
  TempDir dir;
  auto r = launch_example("char_gpt", small_gpt(dir.str(), {"--max_steps", "40", "--tp_size", "2", "--batch_size", "16",
                                                            "--sequence_parallel"}));
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  EXPECT_THAT(r->err, HasSubstr("tensor-parallel size: 2 (sequence-parallel norms)"));
  const auto losses = numbers_after(r->err, "val_loss");
  ASSERT_EQ(losses.size(), 3u) << r->err;
  EXPECT_LT(losses[2], losses[0] - 0.8) << r->err;
  const auto sample = r->out.find("---- sample ----");
  ASSERT_NE(sample, std::string::npos) << r->out;
  EXPECT_EQ(r->out.find("---- sample ----", sample + 1), std::string::npos) << r->out;
  SafetensorsFile weights((dir.path() / "checkpoints/checkpoint_1/model.safetensors").string());
  EXPECT_EQ(weights.get_tensor("blocks.0.qkv.weight").sizes(), (std::vector<int64_t>{192, 64}));
  EXPECT_EQ(weights.get_tensor("blocks.0.fc_out.weight").sizes(), (std::vector<int64_t>{64, 256}));
  auto resumed = launch_example("char_gpt", small_gpt(dir.str(), {"--max_steps", "60", "--resume"}));
  ASSERT_EQ(resumed->exit_code(), 0) << resumed->out << resumed->err;
  EXPECT_THAT(resumed->err, HasSubstr("resumed from checkpoint at step 40"));
  EXPECT_THAT(resumed->err, HasSubstr("tensor-parallel size: 1"));
  const auto later = numbers_after(resumed->err, "val_loss");
  ASSERT_EQ(later.size(), 1u) << resumed->err;  // step 60
  EXPECT_LT(later[0], losses[0] - 0.8) << resumed->err;
}

// --cp_size 2: both processes read the same batches, each its half of every window (the first
// and last quarters, or the middle two), attention running as ring attention between them. The
// run follows the one-process run of the same batches and seed: the same validation losses up to
// rounding.
TEST(CharGptExample, ContextParallelTrainingFollowsTheOneProcessRun) {
  TempDir alone_dir, cp_dir;
  auto alone = run_example_alone("char_gpt", small_gpt(alone_dir.str(), {"--max_steps", "40"}));
  ASSERT_EQ(alone->exit_code(), 0) << alone->out << alone->err;
  auto cp = launch_example("char_gpt", small_gpt(cp_dir.str(), {"--max_steps", "40", "--cp_size", "2"}));
  ASSERT_EQ(cp->exit_code(), 0) << cp->out << cp->err;
  EXPECT_THAT(cp->err, HasSubstr("tensor-parallel size: 1, context-parallel size: 2"));
  const auto want = numbers_after(alone->err, "val_loss"), got = numbers_after(cp->err, "val_loss");
  ASSERT_EQ(want.size(), 3u) << alone->err;
  ASSERT_EQ(got.size(), 3u) << cp->err;
  EXPECT_LT(got[2], got[0] - 0.8) << cp->err;
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 0.01) << "evaluation " << i << "\n" << cp->err;
}

// 8 processes as dp_shard 2 x cp 2 x tp 2: sharded (FSDP over the 4 processes of each tp rank),
// each block's heads split over a tp pair, each window over a cp pair. With 8 windows per
// process, 16 per step, it follows the one-process run of 16 windows per step.
TEST(CharGptExample, ShardedContextAndTensorParallelTrainingOnEightProcessesFollowsTheOneProcessRun) {
  TempDir alone_dir, dir;
  const std::vector<std::string> common = {"--max_steps", "20", "--eval_every", "10", "--checkpoint_every", "20"};
  auto with = [&](const std::string& out, std::vector<std::string> extra) {
    auto args = small_gpt(out, common);
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  };
  auto alone = run_example_alone("char_gpt", with(alone_dir.str(), {"--batch_size", "16"}));
  ASSERT_EQ(alone->exit_code(), 0) << alone->out << alone->err;
  auto r = launch_example("char_gpt", with(dir.str(), {"--batch_size", "8", "--tp_size", "2", "--cp_size", "2"}), 400, 8);
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  EXPECT_THAT(r->err, HasSubstr("processes: 8, tensor-parallel size: 2, context-parallel size: 2"));
  const auto want = numbers_after(alone->err, "val_loss"), got = numbers_after(r->err, "val_loss");
  ASSERT_EQ(want.size(), 3u) << alone->err;
  ASSERT_EQ(got.size(), 3u) << r->err;
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 0.01) << "evaluation " << i << "\n" << r->err;
}

TEST(CharGptExample, ResumeWithoutACheckpointIsAnError) {
  TempDir dir;
  auto r = launch_example("char_gpt", small_gpt(dir.str(), {"--max_steps", "5", "--resume"}));
  EXPECT_NE(r->exit_code(), 0);
  EXPECT_THAT(r->err, HasSubstr("checkpoint"));
}

TEST(CharGptExample, AnUnknownFlagIsNamed) {
  auto r = run({built("examples/char_gpt"), "--max_stepz", "5"});
  EXPECT_EQ(r->exit_code(), 2);
  EXPECT_THAT(r->err, HasSubstr("unknown argument '--max_stepz'"));
}

TEST(ByFeatureExamples, GradientAccumulationLearnsTheSpirals) {
  auto r = launch_example("by_feature/gradient_accumulation", {"--gradient_accumulation_steps", "4"});
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  const auto accuracy = numbers_after(r->out, "accuracy");
  ASSERT_EQ(accuracy.size(), 8u) << r->out;
  EXPECT_GT(accuracy.back(), 0.9) << r->out;
}

TEST(ByFeatureExamples, FsdpLearnsTheSpiralsWithEachProcessHoldingHalfTheParameters) {
  TempDir dir;
  auto r = launch_example("by_feature/fsdp", {"--output_dir", dir.str()});
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  // 4482 parameters: Linear(2, 64), Linear(64, 64), Linear(64, 2) split by rows over 2 processes.
  EXPECT_THAT(r->out, HasSubstr("[rank0]: process 0 holds 2241 of 4482 parameters")) << r->out;
  EXPECT_THAT(r->out, HasSubstr("[rank1]: process 1 holds 2241 of 4482 parameters")) << r->out;
  const auto accuracy = numbers_after(r->out, "accuracy");
  ASSERT_EQ(accuracy.size(), 8u) << r->out;
  EXPECT_GT(accuracy.back(), 0.9) << r->out;
  EXPECT_TRUE(std::filesystem::is_regular_file(dir.path() / "checkpoint" / "pytorch_model_fsdp_0" /
                                               "shard-1-of-2.safetensors"));
  EXPECT_TRUE(std::filesystem::is_regular_file(dir.path() / "model" / "model.safetensors"));
}

TEST(ByFeatureExamples, TensorParallelLearnsTheSpiralsWithTheHiddenLayersSplitOverTwoProcesses) {
  TempDir dir;
  auto r = run({accelerate_bin(), "launch", "--num_processes", "2", "--main_process_port", "0",
                "--parallelism_config_tp_size", "2", built("examples/by_feature/tensor_parallel"), "--output_dir",
                dir.str()},
               180);
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  // 8642 parameters; fc2 (4160) split whole, fc3's weight (4096) split, its bias (64) whole.
  EXPECT_THAT(r->out, HasSubstr("[rank0]: process 0 (tp rank 0, dp rank 0) holds 4514 of 8642 parameters")) << r->out;
  EXPECT_THAT(r->out, HasSubstr("[rank1]: process 1 (tp rank 1, dp rank 0) holds 4514 of 8642 parameters")) << r->out;
  const auto accuracy = numbers_after(r->out, "accuracy");
  ASSERT_EQ(accuracy.size(), 8u) << r->out;
  EXPECT_GT(accuracy.back(), 0.9) << r->out;
  // The saved model is whole: fc3's weight is 64 x 64 in the file.
  auto saved = accelerate::load_file((dir.path() / "model" / "model.safetensors").string());
  EXPECT_EQ(saved.at("fc3.weight").sizes(), (std::vector<int64_t>{64, 64}));
  EXPECT_EQ(saved.at("fc2.bias").sizes(), (std::vector<int64_t>{64}));
}

TEST(ByFeatureExamples, CheckpointingResumesMidEpochExactlyWhereTheRunStopped) {
  TempDir dir;
  const std::string whole = (dir.path() / "whole").string(), parts = (dir.path() / "parts").string();
  auto uninterrupted = launch_example("by_feature/checkpointing", {"--output_dir", whole, "--num_epochs", "3"});
  ASSERT_EQ(uninterrupted->exit_code(), 0) << uninterrupted->out << uninterrupted->err;
  auto first = launch_example("by_feature/checkpointing",
                              {"--output_dir", parts, "--num_epochs", "2", "--checkpointing_steps", "20"});
  ASSERT_EQ(first->exit_code(), 0) << first->out << first->err;
  // 2048 samples, batches of 32 on 2 processes: 32 steps per epoch, so step 40 is mid-epoch 1.
  auto resumed = launch_example("by_feature/checkpointing", {"--output_dir", parts, "--num_epochs", "3",
                                                             "--resume_from_checkpoint", parts + "/step_40"});
  ASSERT_EQ(resumed->exit_code(), 0) << resumed->out << resumed->err;
  const auto expected = numbers_after(uninterrupted->out, "accuracy");
  const auto after_resume = numbers_after(resumed->out, "accuracy");
  ASSERT_EQ(expected.size(), 3u);
  ASSERT_EQ(after_resume.size(), 2u) << resumed->out;  // epochs 1 and 2
  EXPECT_EQ(after_resume[0], expected[1]);
  EXPECT_EQ(after_resume[1], expected[2]);
}

TEST(ByFeatureExamples, TrackingWritesOneJsonlRecordPerEpochFromTheMainProcess) {
  TempDir dir;
  auto r = launch_example("by_feature/tracking", {"--project_dir", dir.str()});
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  const auto accuracy = numbers_after(r->out, "accuracy");
  ASSERT_EQ(accuracy.size(), 4u) << r->out;
  std::ifstream jsonl(dir.path() / "spirals/log.jsonl");
  std::vector<nlohmann::json> records;
  for (std::string line; std::getline(jsonl, line);) records.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(records.size(), 4u);  // written once, not once per process
  EXPECT_NEAR(records[3].at("values").at("accuracy").get<double>(), accuracy[3], 1e-6);
  EXPECT_EQ(records[3].at("values").at("epoch").get<int>(), 3);
  EXPECT_EQ(nlohmann::json::parse(std::ifstream(dir.path() / "spirals/config.json")).at("num_epochs"), 4);
}

TEST(ByFeatureExamples, MemoryFindsTheLargestBatchThatFits) {
  auto r = launch_example("by_feature/memory", {"--starting_batch_size", "128", "--largest_batch_that_fits", "100"});
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  // upstream's rule: 90% of the size that failed, rounded down.
  EXPECT_THAT(r->out, HasSubstr("trying batch size 128"));
  EXPECT_THAT(r->out, HasSubstr("trying batch size 115"));
  EXPECT_THAT(r->out, HasSubstr("trying batch size 103"));
  EXPECT_THAT(r->out, HasSubstr("batch size 92 fits"));
}

TEST(ByFeatureExamples, BigModelInferenceOffloadsToDiskAndMatchesTheInMemoryModel) {
  TempDir dir;
  auto r = run({built("examples/by_feature/big_model_inference"), "--work_dir", dir.str(), "--max_cpu_memory", "6MB"},
               120);
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  // 6 MB keep room for one 2.1 MB block: the embedding and the first block stay in memory.
  EXPECT_THAT(r->out, HasSubstr("device_map blocks.0: cpu"));
  EXPECT_THAT(r->out, HasSubstr("device_map blocks.1: disk"));
  EXPECT_THAT(r->out, HasSubstr("device_map head: disk"));
  EXPECT_THAT(r->out, HasSubstr("matches: yes"));
  EXPECT_TRUE(std::filesystem::exists(dir.path() / "offload" / "index.json"));
}

}  // namespace
}  // namespace accelerate::testing
