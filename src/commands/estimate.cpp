// `accelerate estimate-memory`; see include/accelerate/commands/estimate.h.
#include "accelerate/commands/estimate.h"

#include "accelerate/utils/safetensors.h"
#include "formats/checkpoint_index.h"
#include "commands/cli.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ostream>

namespace accelerate::commands {
namespace {

bool is_floating(const std::string& safetensors_dtype) {
  return safetensors_dtype.rfind("F", 0) == 0 || safetensors_dtype.rfind("BF", 0) == 0;
}

// Characters as shown (UTF-8 continuation bytes do not count).
size_t display_width(const std::string& text) {
  return static_cast<size_t>(
      std::count_if(text.begin(), text.end(), [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; }));
}

std::string repeat(const std::string& piece, size_t count) {
  std::string out;
  for (size_t i = 0; i < count; ++i) out += piece;
  return out;
}

std::string center(const std::string& text, size_t width) {
  const size_t shown = display_width(text);
  if (shown >= width) return text;
  const size_t left = (width - shown) / 2;
  return std::string(left, ' ') + text + std::string(width - shown - left, ' ');
}

// Note [Largest layer of a checkpoint]
// Upstream's largest layer is the largest module without children, measured on the model. A
// checkpoint has no modules, only names, so a layer here is the group of tensors that share
// everything up to the last '.' of their names ("encoder.fc1.weight" and "encoder.fc1.bias" form
// "encoder.fc1"); a tensor without a '.' is a layer of its own. For the usual naming, where only
// leaf modules hold parameters, this is the same answer. Sizes are compared in float32 and ties
// go to the name that sorts first.
std::string layer_of(const std::string& tensor) {
  const auto dot = tensor.rfind('.');
  return dot == std::string::npos ? tensor : tensor.substr(0, dot);
}

}  // namespace

CheckpointSizes calculate_checkpoint_sizes(const std::string& checkpoint) {
  const auto layout = detail::checkpoint_index::resolve_checkpoint(checkpoint, "estimate_memory");
  CheckpointSizes sizes;
  std::map<std::string, std::string> owner;                   // tensor -> file holding it
  std::map<std::string, std::pair<int64_t, int64_t>> layers;  // layer -> parameters, float32 bytes
  for (const auto& path : layout.files) {
    TORCH_CHECK_VALUE(std::filesystem::is_regular_file(path), "[estimate_memory] the index ", layout.index.string(),
                      " lists ", path.filename().string(), ", which does not exist in ", path.parent_path().string());
    TORCH_CHECK_VALUE(path.extension() != ".bin", "[estimate_memory] ", path.string(),
                      " is a pickled checkpoint (torch.save's); estimate-memory reads the sizes safetensors headers "
                      "give, without loading the weights: pass a safetensors checkpoint");
    std::optional<SafetensorsFile> file;
    try {
      file.emplace(path.string());
    } catch (const c10::Error& e) {
      C10_THROW_ERROR(ValueError, c10::str("[estimate_memory] ", path.string(),
                                           " is not a valid safetensors file: ", e.what_without_backtrace()));
    }
    sizes.files.push_back(path.string());
    for (const auto& name : file->keys()) {
      const auto [previous, inserted] = owner.emplace(name, path.string());
      TORCH_CHECK_VALUE(inserted, "[estimate_memory] tensor ", name, " is held by both ", previous->second, " and ",
                        path.string());
      const SafetensorsEntry& entry = file->entry(name);
      int64_t elements = 1;
      for (int64_t dim : entry.shape) elements *= dim;
      const auto bytes = static_cast<int64_t>(entry.end - entry.begin);
      const int64_t float32 = is_floating(entry.dtype) ? elements * 4 : bytes;
      DtypeTotals& totals = sizes.by_dtype[entry.dtype];
      totals.tensors += 1;
      totals.parameters += elements;
      totals.bytes += bytes;
      sizes.tensors += 1;
      sizes.parameters += elements;
      sizes.stored_bytes += bytes;
      sizes.float32_bytes += float32;
      auto& layer = layers[layer_of(name)];
      layer.first += elements;
      layer.second += float32;
    }
  }
  for (const auto& [tensor, file] : layout.weight_map) {
    const auto found = owner.find(tensor);
    TORCH_CHECK_VALUE(found != owner.end() && found->second == (layout.index.parent_path() / file).string(),
                      "[estimate_memory] the index ", layout.index.string(), " maps ", tensor, " to ", file,
                      ", which does not hold it");
  }
  for (const auto& [name, layer] : layers) {
    if (sizes.largest_layer.empty() || layer.second > sizes.largest_layer_float32_bytes) {
      sizes.largest_layer = name;
      sizes.largest_layer_parameters = layer.first;
      sizes.largest_layer_float32_bytes = layer.second;
    }
  }
  return sizes;
}

int64_t TrainingUsage::peak() const { return std::max({model, gradients, optimizer, step}); }

TrainingUsage estimate_training_usage(int64_t float32_bytes, const std::string& dtype) {
  TrainingUsage usage;
  if (dtype == "float32") {
    usage.model = float32_bytes;
    usage.gradients = float32_bytes;
    usage.optimizer = 2 * float32_bytes;  // Adam's two moments
    usage.step = 4 * float32_bytes;
  } else if (dtype == "float16" || dtype == "bfloat16") {
    // Mixed precision keeps float32 master weights; gradients and the matmuls' copies add 1.5x.
    usage.model = float32_bytes;
    usage.gradients = float32_bytes + float32_bytes / 2;
    usage.optimizer = 2 * float32_bytes;
    usage.step = usage.optimizer;
  }
  return usage;
}

const std::map<std::string, int>& estimate_dtypes() {
  static const std::map<std::string, int> dtypes = {
      {"float32", 1}, {"float16", 2}, {"bfloat16", 2}, {"int8", 4}, {"int4", 8}};
  return dtypes;
}

std::vector<MemoryEstimate> estimate_memory(const CheckpointSizes& sizes, const std::vector<std::string>& dtypes) {
  std::vector<MemoryEstimate> rows;
  for (const auto& dtype : dtypes) {
    const auto found = estimate_dtypes().find(dtype);
    TORCH_CHECK_VALUE(found != estimate_dtypes().end(), "[estimate_memory] unknown dtype '", dtype,
                      "'; expected float32, float16, bfloat16, int8 or int4");
    MemoryEstimate row;
    row.dtype = dtype;
    row.largest_layer_bytes = static_cast<double>(sizes.largest_layer_float32_bytes) / found->second;
    row.total_bytes = static_cast<double>(sizes.float32_bytes) / found->second;
    const int64_t peak = estimate_training_usage(sizes.float32_bytes, dtype).peak();
    if (peak != -1) row.training_bytes = peak;
    rows.push_back(row);
  }
  return rows;
}

std::string convert_bytes(double size) {
  const char* units[] = {"bytes", "KB", "MB", "GB", "TB", "PB"};
  size_t unit = 0;
  while (size >= 1024.0 && unit + 1 < std::size(units)) {
    size /= 1024.0;
    ++unit;
  }
  char text[64];
  std::snprintf(text, sizeof(text), "%.2f", std::round(size * 100.0) / 100.0);
  std::string number(text);
  number.erase(number.find_last_not_of('0') + 1);
  if (number.back() == '.') number.pop_back();
  return number + " " + units[unit];
}

std::string create_ascii_table(const std::vector<std::string>& headers,
                               const std::vector<std::vector<std::string>>& rows, const std::string& title) {
  std::vector<size_t> widths;
  for (size_t i = 0; i < headers.size(); ++i) {
    size_t width = display_width(headers[i]);
    for (const auto& row : rows) width = std::max(width, display_width(row.at(i)));
    widths.push_back(width);
  }
  size_t inner = widths.size() - 1;
  for (size_t w : widths) inner += w;
  if (display_width(title) > inner) {  // a long title widens the last column
    widths.back() += display_width(title) - inner;
    inner = display_width(title);
  }
  const auto rule = [&](const char* left, const char* middle, const char* right) {
    std::string line = left;
    for (size_t i = 0; i < widths.size(); ++i) line += (i ? middle : "") + repeat("─", widths[i]);
    return line + right + "\n";
  };
  const auto line = [&](const std::vector<std::string>& cells) {
    std::string text = "│";
    for (size_t i = 0; i < widths.size(); ++i) text += center(cells.at(i), widths[i]) + "│";
    return text + "\n";
  };
  std::string table = "┌" + repeat("─", inner) + "┐\n";
  table += "│" + center(title, inner) + "│\n";
  table += rule("├", "┬", "┤");
  table += line(headers);
  table += rule("├", "┼", "┤");
  for (const auto& row : rows) table += line(row);
  table += rule("└", "┴", "┘");
  return table;
}

int estimate_memory_main(const std::vector<std::string>& args, std::istream& /*in*/, std::ostream& out,
                         std::ostream& err) {
  CLI::App app{"Estimates the memory a model needs, from its safetensors checkpoint (headers only).",
               "accelerate estimate-memory"};
  app.set_help_flag("-h,--help", "Show this help and exit");
  std::string checkpoint;
  std::vector<std::string> dtypes = {"float32", "float16", "int8", "int4"};
  app.add_option("checkpoint", checkpoint,
                 "A .safetensors file, a model.safetensors.index.json file, or a folder holding either")
      ->required();
  app.add_option(detail::cli_spellings("dtypes"), dtypes,
                 "The dtypes to estimate for: float32, float16, bfloat16, int8, int4 (default: float32 float16 int8 "
                 "int4)")
      ->expected(1, -1)
      ->check(CLI::IsMember({"float32", "float16", "bfloat16", "int8", "int4"}));
  if (auto code = detail::parse_cli(app, args, "estimate-memory", out, err)) return *code;

  return detail::run_cli_command("estimate-memory", err, [&] {
    const CheckpointSizes sizes = calculate_checkpoint_sizes(checkpoint);
    out << "Checkpoint: " << checkpoint << " (" << sizes.files.size() << (sizes.files.size() == 1 ? " file" : " files")
        << ")\n";
    out << "Parameters: " << sizes.parameters << " in " << sizes.tensors << " tensors, stored in "
        << convert_bytes(static_cast<double>(sizes.stored_bytes)) << "\n";
    for (const auto& [dtype, totals] : sizes.by_dtype) {
      out << "  " << dtype << ": " << totals.parameters << " parameters in " << totals.tensors << " tensors, "
          << convert_bytes(static_cast<double>(totals.bytes)) << "\n";
    }
    out << "Largest layer: " << sizes.largest_layer << " (" << sizes.largest_layer_parameters << " parameters)\n\n";
    std::vector<std::vector<std::string>> rows;
    for (const auto& row : estimate_memory(sizes, dtypes)) {
      rows.push_back({row.dtype, convert_bytes(row.largest_layer_bytes), convert_bytes(row.total_bytes),
                      row.training_bytes ? convert_bytes(static_cast<double>(*row.training_bytes)) : "N/A"});
    }
    out << create_ascii_table({"dtype", "Largest Layer", "Total Size", "Training using Adam"}, rows,
                              "Memory Usage for loading `" + checkpoint + "`");
    return 0;
  });
}

}  // namespace accelerate::commands
