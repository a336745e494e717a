// `accelerate merge-weights`; see include/accelerate/commands/merge.h.
#include "accelerate/commands/merge.h"

#include "accelerate/utils/safetensors.h"
#include "formats/checkpoint_index.h"
#include "checkpoint/dcp_state.h"
#include "checkpoint/python_layout.h"
#include "checkpoint/sharded_format.h"
#include "commands/cli.h"
#include "detail/files.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <optional>
#include <ostream>
#include <set>

namespace accelerate::commands {
namespace {

namespace fs = std::filesystem;

// Whether `inner` is `outer` or a folder below it (both existing or not).
bool is_within(const fs::path& inner, const fs::path& outer) {
  const fs::path a = fs::weakly_canonical(inner);
  const fs::path b = fs::weakly_canonical(outer);
  auto mismatch = std::mismatch(b.begin(), b.end(), a.begin(), a.end());
  return mismatch.first == b.end();
}

}  // namespace

std::string merge_weights(const std::string& checkpoint_directory, const std::string& output_path,
                          const MergeWeightsOptions& options) {
  const fs::path input(checkpoint_directory);
  TORCH_CHECK_VALUE(fs::is_directory(input), "[merge_weights] ", checkpoint_directory,
                    " is not a folder; pass the folder holding model.safetensors.index.json and its shards");
  // A fully sharded model's folder (Note [Sharded checkpoint layout]) or upstream's FSDP's
  // torch.distributed.checkpoint folder (Note [DCP states]), or a checkpoint holding one.
  std::optional<fs::path> sharded, dcp;
  for (const auto& candidate : {input, input / "pytorch_model_fsdp_0"}) {
    if (!sharded && !dcp && fs::is_regular_file(candidate / "index.json")) sharded = candidate;
    if (!sharded && !dcp && detail::checkpoint::is_dcp_folder(candidate)) dcp = candidate;
  }
  const auto index =
      sharded || dcp ? std::nullopt : detail::checkpoint_index::find_checkpoint_index(input, "merge_weights");
  TORCH_CHECK_VALUE(sharded || dcp || index.has_value(), "[merge_weights] ", checkpoint_directory,
                    " holds no `.index.json` file, so it is not a sharded safetensors checkpoint (nor a fully "
                    "sharded model's folder with an index.json, nor a torch.distributed.checkpoint folder with a "
                    ".metadata)",
                    fs::exists(input / "model.safetensors") ? " (it already holds a single model.safetensors)" : "");
  const fs::path output(output_path);
  TORCH_CHECK_VALUE(fs::weakly_canonical(output) != fs::weakly_canonical(input), "[merge_weights] the output folder ",
                    output_path, " is the checkpoint folder itself; choose another output folder");
  TORCH_CHECK_VALUE(!is_within(output, input) || !options.remove_checkpoint_dir, "[merge_weights] the output folder ",
                    output_path, " is inside the checkpoint folder ", checkpoint_directory,
                    ", which --remove_checkpoint_dir would delete; choose another output folder");
  TORCH_CHECK_VALUE(!fs::exists(output) || fs::is_directory(output), "[merge_weights] the output path ", output_path,
                    " exists and is not a folder");

  // safetensors, or with --unsafe_serialization torch.save's pytorch_model.bin (upstream's names).
  const auto write = [&](TensorMap& merged) {
    fs::create_directories(output);
    const std::string target = (output / (options.safe_serialization ? "model.safetensors" : "pytorch_model.bin")).string();
    if (options.safe_serialization) {
      save_file(merged, target, {{"format", "pt"}});
    } else {
      detail::checkpoint::python_layout::write_pickled_model({merged.begin(), merged.end()}, target);
    }
    if (options.remove_checkpoint_dir) {
      merged.clear();  // release the mappings before the files go
      detail::remove_tree(input);
    }
    return target;
  };
  if (sharded) {
    TensorMap merged = detail::checkpoint::merge_sharded_state(sharded->string());
    return write(merged);
  }
  if (dcp) {
    // Upstream merges the folder's state dict, and of a model's ({"model": ...}) the model's.
    const detail::checkpoint::DcpReader reader(*dcp);
    bool model = !reader.metadata().tensors.empty();
    for (const auto& [key, path] : reader.metadata().paths) {
      model = model && !path.empty() && std::holds_alternative<std::string>(path[0]) &&
              std::get<std::string>(path[0]) == "model";
    }
    TORCH_CHECK_VALUE(model && reader.metadata().values.empty(), "[merge_weights] ", dcp->string(),
                      " is a torch.distributed.checkpoint folder of something other than a model's weights (an "
                      "optimizer's state?); pass the model's folder, pytorch_model_fsdp_<i>");
    auto state = detail::checkpoint::read_dcp_state(reader, "model", nullptr);
    TensorMap merged(state.tensors.begin(), state.tensors.end());
    return write(merged);
  }
  const auto layout = detail::checkpoint_index::read_checkpoint_index(*index, "merge_weights");
  TORCH_CHECK_VALUE(!layout.weight_map.empty(), "[merge_weights] the index ", index->string(), " lists no tensors");
  std::vector<std::string> missing;
  for (const auto& file : layout.files) {
    if (!fs::is_regular_file(file)) missing.push_back(file.filename().string());
  }
  if (!missing.empty()) {
    std::string listed;
    for (const auto& name : missing) listed += (listed.empty() ? "" : ", ") + name;
    C10_THROW_ERROR(ValueError, c10::str("[merge_weights] the index ", index->string(),
                                         " lists shards that do not exist: ", listed));
  }

  TensorMap merged;
  std::map<std::string, std::string> owner;  // tensor -> shard holding it
  for (const auto& path : layout.files) {
    const SafetensorsFile shard(path.string());
    const std::string shard_name = path.lexically_relative(index->parent_path()).string();
    for (const auto& name : shard.keys()) {
      const auto listed = layout.weight_map.find(name);
      TORCH_CHECK_VALUE(listed != layout.weight_map.end(), "[merge_weights] shard ", shard_name, " holds tensor ", name,
                        ", which the index ", index->string(), " does not list");
      const auto [previous, inserted] = owner.emplace(name, shard_name);
      TORCH_CHECK_VALUE(inserted, "[merge_weights] tensor ", name, " is held by both ", previous->second, " and ",
                        shard_name);
      TORCH_CHECK_VALUE(fs::path(listed->second).lexically_normal() == fs::path(shard_name).lexically_normal(),
                        "[merge_weights] the index maps tensor ", name, " to ", listed->second, ", but it is in ",
                        shard_name);
      merged.emplace(name, shard.get_tensor(name));  // a view of the mapped shard: no copy until written
    }
  }
  for (const auto& [name, file] : layout.weight_map) {
    TORCH_CHECK_VALUE(owner.count(name) == 1, "[merge_weights] the index ", index->string(), " maps tensor ", name,
                      " to ", file, ", which does not hold it");
  }

  return write(merged);
}

int merge_weights_main(const std::vector<std::string>& args, std::istream& /*in*/, std::ostream& out,
                       std::ostream& err) {
  CLI::App app{
      "Merges a sharded checkpoint (model.safetensors.index.json and its shards, a fully sharded model's "
      "folder, or a torch.distributed.checkpoint folder as upstream's FSDP writes it) into one "
      "model.safetensors file in the output folder.",
      "accelerate merge-weights"};
  app.set_help_flag("-h,--help", "Show this help and exit");
  std::string checkpoint_directory;
  std::string output_path;
  bool unsafe_serialization = false;
  bool remove_checkpoint_dir = false;
  app.add_option("checkpoint_directory", checkpoint_directory,
                 "The folder holding model.safetensors.index.json and its shards")
      ->required();
  app.add_option("output_path", output_path, "The folder to write model.safetensors into (created if needed)")
      ->required();
  app.add_flag(detail::cli_spellings("unsafe_serialization"), unsafe_serialization,
               "Write torch.save's pytorch_model.bin instead of model.safetensors");
  app.add_flag(detail::cli_spellings("remove_checkpoint_dir"), remove_checkpoint_dir,
               "Delete the checkpoint folder once the merged file is written");
  if (auto code = detail::parse_cli(app, args, "merge-weights", out, err)) return *code;

  return detail::run_cli_command("merge-weights", err, [&] {
    const std::string target =
        merge_weights(checkpoint_directory, output_path,
                      {.safe_serialization = !unsafe_serialization, .remove_checkpoint_dir = remove_checkpoint_dir});
    out << "Merged weights saved to " << target << "\n";
    if (remove_checkpoint_dir) out << "Removed the checkpoint folder " << checkpoint_directory << "\n";
    return 0;
  });
}

}  // namespace accelerate::commands
