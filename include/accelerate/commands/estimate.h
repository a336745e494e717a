// `accelerate estimate-memory`: how much memory a model needs for inference and for training
// with Adam, computed from a local safetensors checkpoint (upstream: accelerate/commands/estimate.py,
// which builds an empty model from the Hugging Face Hub instead). Only the files' headers are
// read, never the tensors' data. The sizes follow upstream's rules: the model's size in float32
// scaled to each requested dtype, and upstream's Adam formula. Hub look-ups (model names,
// `--library_name`, `--trust_remote_code`) are not supported.
//
// Example:
//   accelerate estimate-memory out/model.safetensors.index.json --dtypes float32 bfloat16 int4
#pragma once

#include <cstdint>
#include <iosfwd>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace accelerate::commands {

/// Tensors, elements and bytes of one stored dtype.
struct DtypeTotals {
  int64_t tensors = 0;
  int64_t parameters = 0;
  int64_t bytes = 0;
};

/// What a checkpoint holds, read from its headers.
struct CheckpointSizes {
  /// The safetensors files read.
  std::vector<std::string> files;
  /// Totals by stored safetensors dtype name ("F32", "BF16", "I64", …).
  std::map<std::string, DtypeTotals> by_dtype;
  int64_t tensors = 0;
  int64_t parameters = 0;
  /// Bytes as stored.
  int64_t stored_bytes = 0;
  /// Bytes of the model in float32 (upstream builds its model in float32): floating-point
  /// tensors at 4 bytes per element, other tensors as stored.
  int64_t float32_bytes = 0;
  /// The largest layer (see Note [Largest layer of a checkpoint] in estimate.cpp): the module
  /// prefix shared by its tensors, e.g. "encoder.layers.0.fc1".
  std::string largest_layer;
  int64_t largest_layer_parameters = 0;
  int64_t largest_layer_float32_bytes = 0;
};

/// Reads the headers of a checkpoint: a `.safetensors` file, an index JSON, or a folder holding
/// `model.safetensors` or one `*.index.json`. Raises a ValueError for a missing path, something
/// that is not a safetensors checkpoint, a file with a corrupt header (naming the file), a shard
/// the index lists that is missing, an index entry its shard does not hold, and a tensor held by
/// two shards.
CheckpointSizes calculate_checkpoint_sizes(const std::string& checkpoint);

/// Memory for training at batch size 1 with Adam (upstream: `estimate_training_usage`), from the
/// model's float32 size; -1 where the dtype has no estimate (int8, int4).
struct TrainingUsage {
  int64_t model = -1;
  int64_t gradients = -1;
  int64_t optimizer = -1;
  int64_t step = -1;
  /// The largest of the four: what the "Training using Adam" column shows.
  int64_t peak() const;
};

/// See `TrainingUsage`. `dtype` is "float32" (weights, gradients, 2 Adam states, step at 4x) or
/// "float16"/"bfloat16" (mixed precision: float32 master weights, 1.5x gradients, 2x states).
TrainingUsage estimate_training_usage(int64_t float32_bytes, const std::string& dtype);

/// One row of the estimate.
struct MemoryEstimate {
  std::string dtype;
  double largest_layer_bytes = 0;
  double total_bytes = 0;
  /// Training with Adam; empty for int8 and int4.
  std::optional<int64_t> training_bytes;
};

/// The dtypes `estimate_memory` knows, and how many float32 bytes make one of theirs.
const std::map<std::string, int>& estimate_dtypes();

/// The model's size, its largest layer's and training with Adam for each of `dtypes` (names of
/// `estimate_dtypes()`; others raise a ValueError), as upstream's `gather_data` computes them.
std::vector<MemoryEstimate> estimate_memory(const CheckpointSizes& sizes, const std::vector<std::string>& dtypes);

/// A byte count in the largest unit that keeps it below 1024, with at most two decimals:
/// "512 bytes", "1.5 KB", "2.31 GB" (upstream: `convert_bytes`).
std::string convert_bytes(double size);

/// A box-drawn table with a title row and centred cells (upstream: `create_ascii_table`).
std::string create_ascii_table(const std::vector<std::string>& headers,
                               const std::vector<std::vector<std::string>>& rows, const std::string& title);

/// `accelerate estimate-memory <checkpoint> [--dtypes …]`: prints what the checkpoint holds and
/// the estimate table to `out`. Returns 0, 1 on an error (printed to `err`), 2 for a usage error.
int estimate_memory_main(const std::vector<std::string>& args, std::istream& in, std::ostream& out, std::ostream& err);

}  // namespace accelerate::commands
