// The `accelerate estimate-memory` command (commands/estimate.h), on checkpoints the tests write.
#include "accelerate/commands/estimate.h"

#include "accelerate/utils/safetensors.h"
#include "support/process.h"
#include "support/commands.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace accelerate::testing {
namespace {

using commands::calculate_checkpoint_sizes;
using commands::CheckpointSizes;
using commands::convert_bytes;
using commands::estimate_memory;
using ::testing::HasSubstr;

// A small model whose numbers are worked out by hand:
//   embed.weight        F32  [10, 8]  80 elements  320 bytes (float32: 320)
//   encoder.fc1.weight  BF16 [16, 8] 128 elements  256 bytes (float32: 512)
//   encoder.fc1.bias    BF16 [16]     16 elements   32 bytes (float32:  64)
//   encoder.fc2.weight  F32  [4, 16]  64 elements  256 bytes (float32: 256)
//   position_ids        I64  [1, 10]  10 elements   80 bytes (kept:     80)
// 298 elements, 944 bytes stored, 1232 bytes in float32; the largest layer is encoder.fc1 (144
// elements, 576 bytes in float32).
TensorMap known_model() {
  return {{"embed.weight", torch::randn({10, 8})},
          {"encoder.fc1.weight", torch::randn({16, 8}).to(torch::kBFloat16)},
          {"encoder.fc1.bias", torch::randn({16}).to(torch::kBFloat16)},
          {"encoder.fc2.weight", torch::randn({4, 16})},
          {"position_ids", torch::arange(10, torch::kLong).unsqueeze(0)}};
}

void expect_known_sizes(const CheckpointSizes& sizes) {
  EXPECT_EQ(sizes.tensors, 5);
  EXPECT_EQ(sizes.parameters, 298);
  EXPECT_EQ(sizes.stored_bytes, 944);
  EXPECT_EQ(sizes.float32_bytes, 1232);
  ASSERT_EQ(sizes.by_dtype.size(), 3u);
  EXPECT_EQ(sizes.by_dtype.at("F32").tensors, 2);
  EXPECT_EQ(sizes.by_dtype.at("F32").parameters, 144);
  EXPECT_EQ(sizes.by_dtype.at("F32").bytes, 576);
  EXPECT_EQ(sizes.by_dtype.at("BF16").tensors, 2);
  EXPECT_EQ(sizes.by_dtype.at("BF16").parameters, 144);
  EXPECT_EQ(sizes.by_dtype.at("BF16").bytes, 288);
  EXPECT_EQ(sizes.by_dtype.at("I64").tensors, 1);
  EXPECT_EQ(sizes.by_dtype.at("I64").parameters, 10);
  EXPECT_EQ(sizes.by_dtype.at("I64").bytes, 80);
  EXPECT_EQ(sizes.largest_layer, "encoder.fc1");
  EXPECT_EQ(sizes.largest_layer_parameters, 144);
  EXPECT_EQ(sizes.largest_layer_float32_bytes, 576);
}

// Writes the known model as two shards and an index into `folder`.
std::string write_sharded(const std::filesystem::path& folder) {
  TensorMap model = known_model();
  TensorMap first{{"embed.weight", model.at("embed.weight")}, {"position_ids", model.at("position_ids")}};
  TensorMap second{{"encoder.fc1.weight", model.at("encoder.fc1.weight")},
                   {"encoder.fc1.bias", model.at("encoder.fc1.bias")},
                   {"encoder.fc2.weight", model.at("encoder.fc2.weight")}};
  std::filesystem::create_directories(folder);
  save_file(first, (folder / "model-00001-of-00002.safetensors").string(), {{"format", "pt"}});
  save_file(second, (folder / "model-00002-of-00002.safetensors").string(), {{"format", "pt"}});
  nlohmann::json index;
  index["metadata"] = {{"total_size", 944}};
  for (const auto& [name, tensor] : first) index["weight_map"][name] = "model-00001-of-00002.safetensors";
  for (const auto& [name, tensor] : second) index["weight_map"][name] = "model-00002-of-00002.safetensors";
  const std::string path = (folder / "model.safetensors.index.json").string();
  std::ofstream(path) << index.dump(2);
  return path;
}

CommandOutcome run_estimate(const std::vector<std::string>& args) {
  return run_command(commands::estimate_memory_main, args);
}

// ---- sizes -----------------------------------------------------------------------------------

TEST(CalculateCheckpointSizes, ASingleFileIsMeasuredFromItsHeader) {
  TempDir dir;
  const std::string path = (dir.path() / "model.safetensors").string();
  save_file(known_model(), path);
  const CheckpointSizes sizes = calculate_checkpoint_sizes(path);
  expect_known_sizes(sizes);
  EXPECT_EQ(sizes.files, std::vector<std::string>{path});
}

TEST(CalculateCheckpointSizes, AnIndexCountsEveryShard) {
  TempDir dir;
  const std::string index = write_sharded(dir.path() / "sharded");
  const CheckpointSizes sizes = calculate_checkpoint_sizes(index);
  expect_known_sizes(sizes);
  EXPECT_EQ(sizes.files.size(), 2u);
}

TEST(CalculateCheckpointSizes, AFolderWithAnIndexOrASingleFileIsAccepted) {
  TempDir dir;
  write_sharded(dir.path() / "sharded");
  expect_known_sizes(calculate_checkpoint_sizes((dir.path() / "sharded").string()));
  std::filesystem::create_directories(dir.path() / "single");
  save_file(known_model(), (dir.path() / "single" / "model.safetensors").string());
  expect_known_sizes(calculate_checkpoint_sizes((dir.path() / "single").string()));
}

TEST(CalculateCheckpointSizes, NoTensorDataIsRead) {
  // Zeroing the data section leaves the estimate unchanged: only the header counts.
  TempDir dir;
  const std::string path = (dir.path() / "model.safetensors").string();
  save_file(known_model(), path);
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  uint64_t header = 0;
  std::memcpy(&header, bytes.data(), 8);
  std::fill(bytes.begin() + 8 + static_cast<std::ptrdiff_t>(header), bytes.end(), '\xff');
  std::ofstream(path, std::ios::binary) << bytes;
  expect_known_sizes(calculate_checkpoint_sizes(path));
}

// ---- the estimate ----------------------------------------------------------------------------

TEST(EstimateMemory, SizesScaleFromFloat32AndAdamFollowsUpstreamsFormula) {
  TempDir dir;
  const std::string path = (dir.path() / "model.safetensors").string();
  save_file(known_model(), path);
  const auto rows =
      estimate_memory(calculate_checkpoint_sizes(path), {"float32", "float16", "bfloat16", "int8", "int4"});
  ASSERT_EQ(rows.size(), 5u);
  EXPECT_EQ(rows[0].dtype, "float32");
  EXPECT_EQ(rows[0].largest_layer_bytes, 576);
  EXPECT_EQ(rows[0].total_bytes, 1232);
  EXPECT_EQ(rows[0].training_bytes, std::optional<int64_t>(4 * 1232));  // weights + grads + 2 states, step at 4x
  EXPECT_EQ(rows[1].dtype, "float16");
  EXPECT_EQ(rows[1].largest_layer_bytes, 288);
  EXPECT_EQ(rows[1].total_bytes, 616);
  EXPECT_EQ(rows[1].training_bytes, std::optional<int64_t>(2 * 1232));  // upstream: 4x the float16 size
  EXPECT_EQ(rows[2].training_bytes, rows[1].training_bytes);
  EXPECT_EQ(rows[3].total_bytes, 308);
  EXPECT_EQ(rows[3].largest_layer_bytes, 144);
  EXPECT_EQ(rows[3].training_bytes, std::nullopt);
  EXPECT_EQ(rows[4].total_bytes, 154);
  EXPECT_EQ(rows[4].largest_layer_bytes, 72);
  EXPECT_EQ(rows[4].training_bytes, std::nullopt);
  EXPECT_THROWS_WITH(estimate_memory(calculate_checkpoint_sizes(path), {"float8"}), "unknown dtype 'float8'");
}

TEST(EstimateMemory, TrainingUsageBreakdownMatchesUpstream) {
  const auto fp32 = commands::estimate_training_usage(1000, "float32");
  EXPECT_EQ(fp32.model, 1000);
  EXPECT_EQ(fp32.gradients, 1000);
  EXPECT_EQ(fp32.optimizer, 2000);
  EXPECT_EQ(fp32.step, 4000);
  const auto fp16 = commands::estimate_training_usage(1000, "float16");
  EXPECT_EQ(fp16.model, 1000);
  EXPECT_EQ(fp16.gradients, 1500);
  EXPECT_EQ(fp16.optimizer, 2000);
  EXPECT_EQ(fp16.step, 2000);
  EXPECT_EQ(commands::estimate_training_usage(1000, "int8").peak(), -1);
}

TEST(ConvertBytes, UsesTheLargestUnitBelow1024WithTwoDecimalsAtMost) {
  EXPECT_EQ(convert_bytes(0), "0 bytes");
  EXPECT_EQ(convert_bytes(576), "576 bytes");
  EXPECT_EQ(convert_bytes(1024), "1 KB");
  EXPECT_EQ(convert_bytes(1232), "1.2 KB");
  EXPECT_EQ(convert_bytes(4928), "4.81 KB");
  EXPECT_EQ(convert_bytes(433249280), "413.18 MB");
  EXPECT_EQ(convert_bytes(3.0 * 1024 * 1024 * 1024), "3 GB");
  EXPECT_EQ(convert_bytes(2.0 * 1024 * 1024 * 1024 * 1024 * 1024), "2 PB");
}

TEST(CreateAsciiTable, DrawsTheTitleHeadersAndCentredCells) {
  EXPECT_EQ(commands::create_ascii_table({"a", "bbb"}, {{"xyz", "1"}}, "T"),
            "┌───────┐\n"
            "│   T   │\n"
            "├───┬───┤\n"
            "│ a │bbb│\n"
            "├───┼───┤\n"
            "│xyz│ 1 │\n"
            "└───┴───┘\n");
  // A title wider than the columns widens the last one.
  EXPECT_EQ(commands::create_ascii_table({"a"}, {{"b"}}, "title"),
            "┌─────┐\n"
            "│title│\n"
            "├─────┤\n"
            "│  a  │\n"
            "├─────┤\n"
            "│  b  │\n"
            "└─────┘\n");
}

// ---- the command -----------------------------------------------------------------------------

TEST(EstimateMemoryCommand, PrintsTheStoredSizesAndTheTable) {
  TempDir dir;
  const std::string index = write_sharded(dir.path() / "sharded");
  auto r = run({accelerate_bin(), "estimate-memory", index});
  ASSERT_EQ(r->exit_code(), 0) << r->err;
  EXPECT_THAT(r->out, HasSubstr("Checkpoint: " + index + " (2 files)\n"));
  EXPECT_THAT(r->out, HasSubstr("Parameters: 298 in 5 tensors, stored in 944 bytes\n"));
  EXPECT_THAT(r->out, HasSubstr("  BF16: 144 parameters in 2 tensors, 288 bytes\n"));
  EXPECT_THAT(r->out, HasSubstr("  F32: 144 parameters in 2 tensors, 576 bytes\n"));
  EXPECT_THAT(r->out, HasSubstr("  I64: 10 parameters in 1 tensors, 80 bytes\n"));
  EXPECT_THAT(r->out, HasSubstr("Largest layer: encoder.fc1 (144 parameters)\n"));
  EXPECT_THAT(r->out, HasSubstr("Memory Usage for loading `" + index + "`"));
  // (The title is wider than the columns, so the last one is widened by a length that depends on
  // the temporary folder's name.)
  EXPECT_THAT(r->out, HasSubstr("│ dtype │Largest Layer│Total Size│"));
  EXPECT_THAT(r->out, HasSubstr("│float32│  576 bytes  │  1.2 KB  │"));
  EXPECT_THAT(r->out, HasSubstr("│float16│  288 bytes  │616 bytes │"));
  EXPECT_THAT(r->out, HasSubstr("│ int4  │  72 bytes   │154 bytes │"));
  EXPECT_THAT(r->out, HasSubstr(" 4.81 KB "));
  EXPECT_THAT(r->out, HasSubstr(" 2.41 KB "));
  EXPECT_THAT(r->out, HasSubstr(" N/A "));
}

TEST(EstimateMemoryCommand, DtypesCanBeChosen) {
  TempDir dir;
  const std::string path = (dir.path() / "m.safetensors").string();
  save_file(known_model(), path);
  const CommandOutcome outcome = run_estimate({path, "--dtypes", "bfloat16", "int8"});
  ASSERT_EQ(outcome.code, 0) << outcome.err;
  EXPECT_THAT(outcome.out, HasSubstr("bfloat16"));
  EXPECT_THAT(outcome.out, HasSubstr("2.41 KB"));
  EXPECT_THAT(outcome.out, HasSubstr("308 bytes"));
  EXPECT_THAT(outcome.out, ::testing::Not(HasSubstr("float32")));
}

TEST(EstimateMemoryCommand, AMissingPathIsAnError) {
  TempDir dir;
  const std::string path = (dir.path() / "nowhere").string();
  const CommandOutcome outcome = run_estimate({path});
  EXPECT_EQ(outcome.code, 1);
  EXPECT_THAT(outcome.err, HasSubstr("[estimate_memory] " + path + " does not exist"));
}

TEST(EstimateMemoryCommand, AFolderWithoutACheckpointIsNotASafetensorsCheckpoint) {
  TempDir dir;
  EXPECT_THROWS_WITH(calculate_checkpoint_sizes(dir.str()),
                     "is not a checkpoint: it holds neither pytorch_model.bin nor model.safetensors");
  std::ofstream(dir.path() / "pytorch_model.bin") << "pickle";
  EXPECT_THROWS_WITH(calculate_checkpoint_sizes(dir.str()), "pytorch_model.bin is a pickled checkpoint (torch.save's)");
}

TEST(EstimateMemoryCommand, AFileThatIsNotSafetensorsIsNamed) {
  TempDir dir;
  const std::string path = (dir.path() / "notes.txt").string();
  std::ofstream(path) << "hello, this is not a checkpoint";
  const CommandOutcome outcome = run_estimate({path});
  EXPECT_EQ(outcome.code, 1);
  EXPECT_THAT(outcome.err, HasSubstr("[estimate_memory] " + path + " is not a valid safetensors file"));
}

TEST(EstimateMemoryCommand, ACorruptHeaderNamesTheShard) {
  TempDir dir;
  const std::string index = write_sharded(dir.path() / "sharded");
  const auto shard = dir.path() / "sharded" / "model-00002-of-00002.safetensors";
  std::fstream file(shard, std::ios::in | std::ios::out | std::ios::binary);
  file.seekp(8);
  file.write("[", 1);  // the header must be a JSON object
  file.close();
  EXPECT_THROWS_WITH(calculate_checkpoint_sizes(index), shard.string() + " is not a valid safetensors file");
}

TEST(EstimateMemoryCommand, AnIndexListingAMissingShardIsAnError) {
  TempDir dir;
  const std::string index = write_sharded(dir.path() / "sharded");
  std::filesystem::remove(dir.path() / "sharded" / "model-00001-of-00002.safetensors");
  EXPECT_THROWS_WITH(calculate_checkpoint_sizes(index), "lists model-00001-of-00002.safetensors, which does not exist");
}

TEST(EstimateMemoryCommand, AnIndexEntryItsShardDoesNotHoldIsAnError) {
  TempDir dir;
  const std::string index = write_sharded(dir.path() / "sharded");
  auto json = nlohmann::json::parse(std::ifstream(index));
  json["weight_map"]["lm_head.weight"] = "model-00001-of-00002.safetensors";
  std::ofstream(index) << json.dump();
  EXPECT_THROWS_WITH(calculate_checkpoint_sizes(index),
                     "maps lm_head.weight to model-00001-of-00002.safetensors, which does not hold it");
}

TEST(EstimateMemoryCommand, HelpExitsZeroAndBadFlagsExitTwo) {
  const CommandOutcome help = run_estimate({"--help"});
  EXPECT_EQ(help.code, 0);
  EXPECT_THAT(help.out, HasSubstr("--dtypes"));
  EXPECT_THAT(help.out, HasSubstr("checkpoint"));
  auto r = run({accelerate_bin(), "estimate-memory", "x.safetensors", "--trust_remote_code"});
  EXPECT_EQ(r->exit_code(), 2);
  EXPECT_THAT(r->err, HasSubstr("--trust_remote_code"));
  const CommandOutcome dtype = run_estimate({"x.safetensors", "--dtypes", "float8"});
  EXPECT_EQ(dtype.code, 2);
  EXPECT_THAT(dtype.err, HasSubstr("float8"));
  EXPECT_EQ(run_estimate({}).code, 2);
}

}  // namespace
}  // namespace accelerate::testing
