// torch.distributed.checkpoint folders (upstream's FSDP's SHARDED_STATE_DICT): a folder written
// by one process reads back as whole tensors, as any process's rows and as nested values; a
// crafted .metadata or item is refused naming what is wrong. Folders of upstream Accelerate
// itself are read and written in tests/packages/checkpoint_check.py; load_state of mutated
// folders in the load_state fuzzer's --dcp run.
#include "accelerate/accelerate.h"
#include "checkpoint/dcp_state.h"
#include "formats/dcp.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <iterator>

namespace accelerate::testing {
namespace {

namespace fs = std::filesystem;
namespace ck = detail::checkpoint;
using Path = std::vector<detail::dcp::PathStep>;

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// A folder as two processes of a fully sharded job write it: a 5 x 3 weight by rows (3 and 2), a
// scalar step and a param group's values, all from one process here.
fs::path write_folder(const fs::path& root) {
  const auto weight = torch::arange(15, torch::kFloat).reshape({5, 3});
  ck::DcpShare share;
  share.tensors["model.w"] = {weight, {5, 3}, {0, 0}, Path{std::string("model"), std::string("w")}};
  share.tensors["optimizer.state.w.step"] = {torch::scalar_tensor(3.0, torch::kFloat), {}, {},
                                             Path{std::string("optimizer"), std::string("state"), std::string("w"),
                                                  std::string("step")}};
  share.values["optimizer.param_groups.0.lr"] = {0.01, Path{std::string("optimizer"), std::string("param_groups"),
                                                            int64_t{0}, std::string("lr")}};
  share.values["optimizer.param_groups.0.params"] = {nlohmann::json::array({"w"}),
                                                     Path{std::string("optimizer"), std::string("param_groups"),
                                                          int64_t{0}, std::string("params")}};
  const auto folder = root / "dcp";
  ck::write_dcp_folder(folder, share, PartialState());
  // Split the weight into the two chunks two processes write: rows 0-2 and 3-4.
  auto metadata = detail::dcp::read_metadata(read_bytes(folder / ".metadata"));
  auto& entry = metadata.tensors.at("model.w");
  ck::DcpShare rows;
  rows.tensors["a"] = {weight.slice(0, 0, 3), {3, 3}, {0, 0}, {}};
  rows.tensors["b"] = {weight.slice(0, 3, 5), {2, 3}, {0, 0}, {}};
  ck::write_dcp_folder(root / "rows", rows, PartialState());
  const auto parts = detail::dcp::read_metadata(read_bytes(root / "rows" / ".metadata"));
  fs::copy_file(root / "rows" / detail::dcp::data_file(0), folder / detail::dcp::data_file(1));
  entry.chunks.clear();
  for (const auto* key : {"a", "b"}) {
    auto chunk = parts.tensors.at(key).chunks.at(0);
    chunk.where.file = detail::dcp::data_file(1);
    chunk.offsets = {key[0] == 'a' ? 0 : 3, 0};
    entry.chunks.push_back(chunk);
  }
  write_bytes(folder / ".metadata", detail::dcp::write_metadata(metadata));
  return folder;
}

TEST(DcpFolders, ReadBackWholeAsAnyProcesssRowsAndAsNestedValues) {
  TempDir dir;
  const auto folder = write_folder(dir.path());
  const ck::DcpReader reader(folder);
  const auto weight = torch::arange(15, torch::kFloat).reshape({5, 3});
  EXPECT_TRUE(torch::equal(reader.read_whole("model.w"), weight));
  // Rows 2-3 straddle the two chunks; a process of three holds rows 4.. of them.
  EXPECT_TRUE(torch::equal(reader.read("model.w", {{2, 0}, {2, 3}}), weight.slice(0, 2, 4)));
  const auto third = ck::shard_box({5, 3}, /*rows=*/true, -1, {.world = 3, .rank = 2});
  EXPECT_TRUE(torch::equal(reader.read("model.w", third), weight.slice(0, 4, 5)));
  // A folder of more than a model's state is not read as one.
  EXPECT_THROWS_WITH(ck::read_dcp_state(reader, "model", nullptr), "\"optimizer.state.w.step\" is not below \"model\"");
}

TEST(DcpFolders, AnOptimizersValuesNestAsTorchSaveWouldHoldThem) {
  TempDir dir;
  ck::DcpShare share;
  share.tensors["optimizer.state.0.weight.step"] = {torch::scalar_tensor(3.0, torch::kFloat), {}, {},
                                                    Path{std::string("optimizer"), std::string("state"),
                                                         std::string("0.weight"), std::string("step")}};
  share.values["optimizer.param_groups.0.lr"] = {0.01, Path{std::string("optimizer"), std::string("param_groups"),
                                                            int64_t{0}, std::string("lr")}};
  share.values["optimizer.param_groups.1.lr"] = {0.5, Path{std::string("optimizer"), std::string("param_groups"),
                                                           int64_t{1}, std::string("lr")}};
  ck::write_dcp_folder(dir.path() / "opt", share, PartialState());
  const auto state = ck::read_dcp_state(ck::DcpReader(dir.path() / "opt"), "optimizer", nullptr);
  EXPECT_EQ(state.values, nlohmann::json::parse(R"({"param_groups": [{"lr": 0.01}, {"lr": 0.5}]})"));
  ASSERT_EQ(state.tensors.count("state.0.weight.step"), 1u);  // the parameter's name keeps its dot
  EXPECT_EQ(state.tensors.at("state.0.weight.step").item<float>(), 3.0f);
}

// The folder's .metadata with its first `from` replaced by `to` (the pickle names its classes as
// text).
void edit_metadata(const fs::path& folder, const std::string& from, const std::string& to) {
  auto bytes = read_bytes(folder / ".metadata");
  const auto at = bytes.find(from);
  ASSERT_NE(at, std::string::npos) << from;
  bytes.replace(at, from.size(), to);
  write_bytes(folder / ".metadata", bytes);
}

TEST(DcpFolders, AClassOutsideCheckpointMetadataIsRefusedByName) {
  TempDir dir;
  const auto folder = write_folder(dir.path());
  edit_metadata(folder, "torch.distributed.checkpoint.filesystem\n_StorageInfo", "posix\nsystem");
  EXPECT_THROWS_WITH(ck::DcpReader{folder}, "an object of posix.system, which is not read");
}

TEST(DcpFolders, ChunksOutsideTheirTensorOrNotAddingUpToItAreRefused) {
  TempDir dir;
  const auto folder = write_folder(dir.path());
  auto metadata = detail::dcp::read_metadata(read_bytes(folder / ".metadata"));
  auto broken = metadata;
  broken.tensors.at("model.w").chunks.at(1).offsets = {4, 0};  // rows 4-5 of 5
  write_bytes(folder / ".metadata", detail::dcp::write_metadata(broken));
  EXPECT_THROWS_WITH(ck::DcpReader{folder}, "\"model.w\": a chunk that reaches outside its tensor (dimension 0)");
  broken = metadata;
  broken.tensors.at("model.w").chunks.pop_back();
  write_bytes(folder / ".metadata", detail::dcp::write_metadata(broken));
  EXPECT_THROWS_WITH(ck::DcpReader{folder}, "chunks that hold 9 of the tensor's 15 elements");
  // Two chunks of the same rows (their sizes add up, but rows 3-4 have none): refused where read.
  broken = metadata;
  auto& chunks = broken.tensors.at("model.w").chunks;
  chunks.at(1).offsets = {2, 0};
  write_bytes(folder / ".metadata", detail::dcp::write_metadata(broken));
  const ck::DcpReader reader(folder);
  EXPECT_THROWS_WITH(reader.read_whole("model.w"), "do not cover the part");
  EXPECT_THROWS_WITH(reader.read_whole("model.w"), "3 elements missing, 3 given twice");
}

TEST(DcpFolders, ItemsOutsideTheirFilesOrInOtherFoldersAreRefused) {
  TempDir dir;
  const auto folder = write_folder(dir.path());
  const auto metadata = detail::dcp::read_metadata(read_bytes(folder / ".metadata"));
  auto broken = metadata;
  broken.tensors.at("model.w").chunks.at(0).where.file = "__7_0.distcp";
  write_bytes(folder / ".metadata", detail::dcp::write_metadata(broken));
  EXPECT_THROWS_WITH(ck::DcpReader{folder}, "the folder has no __7_0.distcp, which holds \"model.w\"");
  broken = metadata;
  broken.tensors.at("model.w").chunks.at(0).where.offset = 1 << 20;
  write_bytes(folder / ".metadata", detail::dcp::write_metadata(broken));
  EXPECT_THROWS_WITH(ck::DcpReader{folder}, "but \"model.w\" is said to lie at 1048576+");
  broken = metadata;
  broken.values.at("optimizer.param_groups.0.lr").file = "../dcp/__0_0.distcp";
  write_bytes(folder / ".metadata", detail::dcp::write_metadata(broken));
  EXPECT_THROWS_WITH(ck::DcpReader{folder}, "is not a plain name in the folder");
  // A chunk's bytes that are another item's (a scalar where rows were expected).
  broken = metadata;
  broken.tensors.at("model.w").chunks.at(0).where = metadata.tensors.at("optimizer.state.w.step").chunks.at(0).where;
  write_bytes(folder / ".metadata", detail::dcp::write_metadata(broken));
  EXPECT_THROWS_WITH(ck::DcpReader(folder).read_whole("model.w"), "where the metadata says float32 [3, 3]");
}

TEST(DcpFolders, ItemsWrittenThroughTransformsAreRefused) {
  TempDir dir;
  const auto folder = write_folder(dir.path());
  // transform_descriptors=None becomes a list of one descriptor (DCP's compression extension).
  auto bytes = read_bytes(folder / ".metadata");
  const std::string key = std::string("X\x15\x00\x00\x00", 5) + "transform_descriptors";
  const auto at = bytes.find(key);
  ASSERT_NE(at, std::string::npos);
  ASSERT_EQ(bytes[at + key.size()], 'N');
  bytes.replace(at + key.size(), 1, std::string("]X\x04\x00\x00\x00zstda", 11));
  write_bytes(folder / ".metadata", bytes);
  EXPECT_THROWS_WITH(ck::DcpReader{folder}, "an item written through transforms");
}

}  // namespace
}  // namespace accelerate::testing
