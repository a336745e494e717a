// Experiment trackers; see include/accelerate/tracking.h. TensorBoard records are encoded by hand
// (see Note [TensorBoard records without protoc] in docs/design.md).
#include "accelerate/tracking.h"

#include "detail/files.h"
#include "detail/text.h"
#include "formats/checksums.h"
#include "formats/png.h"
#include "formats/tensorboard.h"
#include "formats/yaml.h"
#include "tracking_impl.h"

#include <c10/util/Exception.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <sstream>
#include <utility>

namespace accelerate {

namespace fs = std::filesystem;
using detail::png::encode_png;
using detail::tensorboard::hparams_summary;
using detail::tensorboard::Proto;
using detail::tensorboard::scalar_summary;
using detail::tensorboard::summary_value;
using detail::tensorboard::text_summary;
using detail::yaml::to_yaml;

namespace {

double wall_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

bool contains(const std::vector<std::string>& items, const std::string& item) {
  return std::find(items.begin(), items.end(), item) != items.end();
}

[[noreturn]] void fail_io(const std::string& api, const std::string& what, const std::string& path, int error) {
  C10_THROW_ERROR(ValueError, "[" + api + "] cannot " + what + " " + path + ": " + std::strerror(error));
}

void create_folder(const std::string& api, const std::string& path) {
  std::error_code error;
  fs::create_directories(path, error);
  if (error) C10_THROW_ERROR(ValueError, "[" + api + "] cannot create the folder " + path + ": " + error.message());
}

std::FILE* open_file(const std::string& api, const std::string& path, const char* mode) {
  std::FILE* file = std::fopen(path.c_str(), mode);
  if (file == nullptr) fail_io(api, "open", path, errno);
  return file;
}

void write_bytes(const std::string& api, std::FILE* file, const std::string& bytes, const std::string& path) {
  if (std::fwrite(bytes.data(), 1, bytes.size(), file) != bytes.size() || std::fflush(file) != 0) {
    fail_io(api, "write", path, errno);
  }
}

void close_file(const std::string& api, std::FILE*& file, const std::string& path) {
  if (file == nullptr) return;
  std::FILE* f = std::exchange(file, nullptr);
  const bool ok = std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
  const int error = errno;
  if (std::fclose(f) != 0 || !ok) fail_io(api, "close", path, ok ? errno : error);
}

// Atomic writes for files rewritten whole (metrics.json, params.yaml, config.json, hparams.yml).
void write_whole(const std::string& api, const std::string& path, const std::string& bytes) {
  try {
    detail::write_file_atomically(path, bytes);
  } catch (const c10::Error& e) {
    C10_THROW_ERROR(ValueError, "[" + api + "] " + e.what_without_backtrace());
  }
}

// ---- values ---------------------------------------------------------------------------------

bool is_scalar(const nlohmann::json& v) { return v.is_number() || v.is_boolean(); }

double scalar_of(const nlohmann::json& v) { return v.is_boolean() ? (v.get<bool>() ? 1.0 : 0.0) : v.get<double>(); }

// A value as the text formats show it: strings as they are, numbers in JSON's shortest round-trip
// form, and (with `python`, for the files dvclive's Python writes) non-finite numbers and booleans
// as Python prints them.
std::string value_text(const nlohmann::json& v, bool python) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_number_float() && !std::isfinite(v.get<double>())) {
    const double d = v.get<double>();
    return std::isnan(d) ? "nan" : d > 0 ? "inf" : "-inf";
  }
  if (python && v.is_boolean()) return v.get<bool>() ? "True" : "False";
  return v.dump();
}

// Values flattened to `key` / `key/member` pairs, in the order given.
std::vector<std::pair<std::string, nlohmann::json>> flatten(const nlohmann::json& values) {
  std::vector<std::pair<std::string, nlohmann::json>> out;
  for (const auto& [key, value] : values.items()) {
    if (value.is_object()) {
      for (const auto& [member, v] : value.items()) out.emplace_back(key + "/" + member, v);
    } else {
      out.emplace_back(key, value);
    }
  }
  return out;
}

std::string hostname() { return detail::tracker_hostname(); }

std::atomic<int> event_file_counter{0};

std::string string_option(const nlohmann::json& kwargs, const std::string& key, const std::string& api,
                          const std::string& tracker) {
  const auto& v = kwargs.at(key);
  TORCH_CHECK_VALUE(v.is_string(), "[", api, "] init_kwargs['", tracker, "']['", key, "']: expected a string, got ",
                    v.dump());
  return v.get<std::string>();
}

void check_option_keys(const nlohmann::json& kwargs, const std::vector<std::string>& accepted, const std::string& api,
                       const std::string& tracker) {
  TORCH_CHECK_VALUE(kwargs.is_object(), "[", api, "] init_kwargs['", tracker,
                    "']: expected a JSON object of options, got ", kwargs.dump());
  for (const auto& [key, value] : kwargs.items()) {
    (void)value;
    TORCH_CHECK_VALUE(contains(accepted, key), "[", api, "] init_kwargs['", tracker, "']: unknown option '", key, "'; ",
                      tracker, " accepts ", accepted.empty() ? std::string("none") : detail::join(accepted));
  }
}

}  // namespace

namespace detail {

// Upstream's add_images: a [N, C, H, W] batch tiled into a grid of up to 8 columns (grey
// repeated to RGB), floating values scaled by 255, clipped to [0, 255] and truncated to uint8.
TrackerImage tracker_image(const std::string& api, const std::string& key, at::Tensor tensor) {
  TORCH_CHECK_VALUE(tensor.defined(), "[", api, "] '", key,
                    "': expected a tensor, got an undefined one");
  if (tensor.dim() == 3) tensor = tensor.unsqueeze(0);
  TORCH_CHECK_VALUE(tensor.dim() == 4, "[", api, "] '", key,
                    "': expected a [C, H, W] or [N, C, H, W] tensor, got ", tensor.dim(), " dimensions");
  const int64_t n = tensor.size(0), c = tensor.size(1), h = tensor.size(2), w = tensor.size(3);
  TORCH_CHECK_VALUE(c == 1 || c == 3 || c == 4, "[", api, "] '", key,
                    "': expected 1, 3 or 4 channels, got ", c);
  TORCH_CHECK_VALUE(n > 0 && h > 0 && w > 0, "[", api, "] '", key, "': the image is empty");
  tensor = tensor.detach().to(at::kCPU);
  if (tensor.scalar_type() != at::kByte) {
    TORCH_CHECK_VALUE(at::isFloatingType(tensor.scalar_type()), "[", api, "] '", key,
                      "': expected floating values in [0, 1] or uint8, got ", tensor.scalar_type());
    tensor = (tensor.to(at::kFloat) * 255).clamp(0, 255).to(at::kByte);
  }
  if (c == 1) tensor = tensor.expand({n, 3, h, w});
  const int64_t channels = c == 1 ? 3 : c;
  const int64_t cols = std::min<int64_t>(n, 8), rows = (n + cols - 1) / cols;
  at::Tensor canvas = at::zeros({channels, h * rows, w * cols}, at::kByte);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t y = i / cols, x = i % cols;
    canvas.slice(1, y * h, (y + 1) * h).slice(2, x * w, (x + 1) * w).copy_(tensor[i]);
  }
  at::Tensor hwc = canvas.permute({1, 2, 0}).contiguous();
  std::string pixels(static_cast<const char*>(hwc.data_ptr()), static_cast<size_t>(hwc.numel()));
  return {h * rows, w * cols, channels, encode_png(pixels, h * rows, w * cols, channels)};
}

std::string tracker_hostname() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "localhost";
  return name;
}

}  // namespace detail

// ---- CRC32C (the public function; TFRecord framing is in formats/tensorboard.cpp) --------------

uint32_t crc32c(const void* data, size_t size) {
  return detail::checksums::reflected_crc32<0x82F63B78u>(static_cast<const unsigned char*>(data), size);
}


// One event file on disk; its records are made in formats/tensorboard.cpp.
class TensorBoardTracker::EventWriter {
 public:
  EventWriter(const std::string& folder, const std::string& suffix) {
    create_folder("TensorBoardTracker", folder);
    char stamp[32];
    std::snprintf(stamp, sizeof(stamp), "%010lld", static_cast<long long>(std::time(nullptr)));
    path_ = (fs::path(folder) / ("events.out.tfevents." + std::string(stamp) + "." + hostname() + "." +
                                 std::to_string(::getpid()) + "." + std::to_string(event_file_counter++) + suffix))
                .string();
    file_ = open_file("TensorBoardTracker", path_, "wb");
    write(detail::tensorboard::file_version_event(wall_time()));
  }
  ~EventWriter() {
    try {
      close();
    } catch (...) {  // a destructor reports nothing; finish() reports close errors
    }
  }
  EventWriter(const EventWriter&) = delete;
  EventWriter& operator=(const EventWriter&) = delete;

  void write_summary(const Proto& summary, std::optional<int64_t> step, double time) {
    write(detail::tensorboard::summary_event(summary, step.value_or(0), time));
  }
  void close() { close_file("TensorBoardTracker.finish", file_, path_); }
  bool closed() const { return file_ == nullptr; }

 private:
  void write(const std::string& record) {
    TORCH_CHECK(file_ != nullptr, "[TensorBoardTracker] the tracker is finished: ", path_, " is closed");
    write_bytes("TensorBoardTracker", file_, record, path_);
  }

  std::string path_;
  std::FILE* file_ = nullptr;
};

// ---- GeneralTracker ---------------------------------------------------------------------------

GeneralTracker::~GeneralTracker() = default;

void GeneralTracker::log_images(const std::map<std::string, at::Tensor>& images, std::optional<int64_t> step) {
  (void)images;
  (void)step;
  C10_THROW_ERROR(ValueError, "[GeneralTracker.log_images] the tracker '" + name() + "' does not log images");
}

void check_log_values(const nlohmann::json& values, const char* api) {
  TORCH_CHECK_VALUE(values.is_object(), "[", api, "] expected a JSON object of values, got ", values.type_name());
  for (const auto& [key, value] : values.items()) {
    if (value.is_object()) {
      for (const auto& [member, v] : value.items()) {
        TORCH_CHECK_VALUE(is_scalar(v), "[", api, "] '", key, "/", member, "': a group of scalars holds numbers, got ",
                          v.type_name(), " (", v.dump(), ")");
      }
      continue;
    }
    TORCH_CHECK_VALUE(is_scalar(value) || value.is_string(), "[", api, "] '", key,
                      "': expected a number, a string or an object of numbers, got ", value.type_name(), " (",
                      value.dump(), ")");
  }
}

// ---- TensorBoardTracker -------------------------------------------------------------------------

TensorBoardTracker::TensorBoardTracker(const std::string& run_name, const std::string& logging_dir,
                                       const TensorBoardTrackerOptions& options)
    : run_dir_((fs::path(logging_dir) / run_name).string()), options_(options) {
  TORCH_CHECK_VALUE(!logging_dir.empty(), "[TensorBoardTracker] requires a logging_dir, got an empty one");
  main_ = std::make_unique<EventWriter>(run_dir_, options_.filename_suffix);
}

TensorBoardTracker::~TensorBoardTracker() = default;

TensorBoardTracker::EventWriter& TensorBoardTracker::writer_for(const std::string& folder) {
  auto& writer = scalars_writers_[folder];
  if (!writer) writer = std::make_unique<EventWriter>(folder, options_.filename_suffix);
  return *writer;
}

void TensorBoardTracker::store_init_configuration(const nlohmann::json& values) {
  detail::check_hparams(values, "TensorBoardTracker.store_init_configuration");
  // Upstream's add_hparams(values, metric_dict={}): an Experiment listing each hyperparameter's
  // type, the session start with the values, and the session end, in a run of their own.
  constexpr int kFloat64 = 3, kString = 1, kStatusSuccess = 1;
  Proto experiment, start;
  for (const auto& [key, value] : values.items()) {
    if (value.is_null()) continue;
    Proto v;
    if (value.is_string()) {
      v.bytes_always(3, value.get<std::string>());
    } else {
      v.fixed64_always(2, scalar_of(value));
    }
    experiment.message(4, std::move(Proto().bytes(1, key).varint(4, value.is_string() ? kString : kFloat64)));
    start.message(1, std::move(Proto().bytes(1, key).message(2, v)));
  }
  const double now = wall_time();
  char stamp[64];
  std::snprintf(stamp, sizeof(stamp), "%.6f", now);
  const std::string folder = (fs::path(run_dir_) / stamp).string();
  {
    EventWriter hparams(folder, options_.filename_suffix);
    hparams.write_summary(hparams_summary("_hparams_/experiment", std::move(Proto().message(2, experiment))),
                          std::nullopt, now);
    hparams.write_summary(hparams_summary("_hparams_/session_start_info", std::move(Proto().message(3, start))),
                          std::nullopt, now);
    hparams.write_summary(hparams_summary("_hparams_/session_end_info",
                                          std::move(Proto().message(4, std::move(Proto().varint(1, kStatusSuccess))))),
                          std::nullopt, now);
    hparams.close();
  }
  write_whole("TensorBoardTracker.store_init_configuration", (fs::path(folder) / "hparams.yml").string(),
              to_yaml(values));
}

void TensorBoardTracker::log(const nlohmann::json& values, std::optional<int64_t> step) {
  check_log_values(values, "TensorBoardTracker.log");
  const double now = wall_time();
  for (const auto& [key, value] : values.items()) {
    if (value.is_string()) {
      main_->write_summary(text_summary(key, value.get<std::string>()), step, now);
    } else if (value.is_object()) {
      std::string prefix = key;
      std::replace(prefix.begin(), prefix.end(), '/', '_');
      for (const auto& [member, v] : value.items()) {
        writer_for((fs::path(run_dir_) / (prefix + "_" + member)).string())
            .write_summary(scalar_summary(key, scalar_of(v)), step, now);
      }
    } else {
      main_->write_summary(scalar_summary(key, scalar_of(value)), step, now);
    }
  }
}

void TensorBoardTracker::log_images(const std::map<std::string, at::Tensor>& images, std::optional<int64_t> step) {
  std::vector<std::pair<std::string, detail::TrackerImage>> encoded;
  for (const auto& [key, tensor] : images) {
    encoded.emplace_back(key, detail::tracker_image("TensorBoardTracker.log_images", key, tensor));
  }
  const double now = wall_time();
  for (const auto& [key, image] : encoded) {
    Proto img = std::move(Proto()
                              .varint(1, static_cast<uint64_t>(image.height))
                              .varint(2, static_cast<uint64_t>(image.width))
                              .varint(3, static_cast<uint64_t>(image.channels))
                              .bytes(4, image.png));
    main_->write_summary(std::move(Proto().message(1, std::move(summary_value(key).message(4, img)))), step, now);
  }
}

void TensorBoardTracker::finish() {
  main_->close();
  for (auto& [folder, writer] : scalars_writers_) writer->close();
}

// ---- DVCLiveTracker ---------------------------------------------------------------------------

DVCLiveTracker::DVCLiveTracker(const std::string& run_name, const std::string& logging_dir,
                               const DVCLiveTrackerOptions& options)
    : dir_(!options.dir.empty()   ? options.dir
           : !logging_dir.empty() ? (fs::path(logging_dir) / run_name).string()
                                  : std::string("dvclive")) {
  create_folder("DVCLiveTracker", dir_);
}

void DVCLiveTracker::store_init_configuration(const nlohmann::json& values) {
  TORCH_CHECK_VALUE(values.is_object(), "[DVCLiveTracker.store_init_configuration] expected a JSON object, got ",
                    values.type_name());
  for (const auto& [key, value] : values.items()) params_[key] = value;
  write_whole("DVCLiveTracker.store_init_configuration", (fs::path(dir_) / "params.yaml").string(), to_yaml(params_));
}

void DVCLiveTracker::log(const nlohmann::json& values, std::optional<int64_t> step) {
  check_log_values(values, "DVCLiveTracker.log");
  if (step) step_ = *step;
  const auto flat = flatten(values);
  for (const auto& [key, value] : flat) {
    // dvclive names each metric's file after it; a name must stay inside the folder.
    const fs::path name(key);
    const bool inside = !key.empty() && name.is_relative() && key.back() != '/' &&
                        std::none_of(name.begin(), name.end(), [](const fs::path& p) { return p == ".." || p == "."; });
    TORCH_CHECK_VALUE(inside, "[DVCLiveTracker.log] '", key, "': metric names become file paths under ", dir_,
                      "/plots/metrics; expected a relative name without '.' or '..' parts");
  }
  for (const auto& [key, value] : flat) {
    const fs::path tsv = fs::path(dir_) / "plots" / "metrics" / (key + ".tsv");
    create_folder("DVCLiveTracker.log", tsv.parent_path().string());
    const bool existed = fs::exists(tsv);
    std::string text = value_text(value, /*python=*/true);
    if (text.find_first_of("\t\"\n\r") != std::string::npos) {
      std::string quoted = "\"";
      for (char ch : text) quoted += ch == '"' ? std::string("\"\"") : std::string(1, ch);
      text = quoted + "\"";
    }
    std::string rows = existed ? "" : "step\t" + tsv.stem().string() + "\n";
    rows += std::to_string(step_) + "\t" + text + "\n";
    std::FILE* file = open_file("DVCLiveTracker.log", tsv.string(), "ab");
    try {
      write_bytes("DVCLiveTracker.log", file, rows, tsv.string());
    } catch (...) {
      std::fclose(file);
      throw;
    }
    std::fclose(file);
    nlohmann::json* node = &summary_;
    std::string rest = key;
    for (size_t slash; (slash = rest.find('/')) != std::string::npos; rest = rest.substr(slash + 1)) {
      node = &(*node)[rest.substr(0, slash)];
      if (!node->is_object()) *node = nlohmann::json::object();
    }
    // dvclive keeps non-finite numbers as their text.
    const bool finite = !value.is_number_float() || std::isfinite(value.get<double>());
    (*node)[rest] = finite ? value : nlohmann::json(value_text(value, /*python=*/true));
  }
  summary_["step"] = step_;
  write_whole("DVCLiveTracker.log", (fs::path(dir_) / "metrics.json").string(), summary_.dump(4) + "\n");
  step_ += 1;
}

// ---- JSONLTracker -----------------------------------------------------------------------------

JSONLTracker::JSONLTracker(const std::string& run_name, const std::string& logging_dir,
                           const JSONLTrackerOptions& options)
    : dir_((fs::path(logging_dir) / run_name).string()), path_((fs::path(dir_) / options.filename).string()) {
  TORCH_CHECK_VALUE(!logging_dir.empty(), "[JSONLTracker] requires a logging_dir, got an empty one");
  create_folder("JSONLTracker", dir_);
  file_ = open_file("JSONLTracker", path_, "ab");
}

JSONLTracker::~JSONLTracker() {
  if (file_ != nullptr) std::fclose(file_);
}

void JSONLTracker::store_init_configuration(const nlohmann::json& values) {
  write_whole("JSONLTracker.store_init_configuration", (fs::path(dir_) / "config.json").string(),
              values.dump(2) + "\n");
}

void JSONLTracker::log(const nlohmann::json& values, std::optional<int64_t> step) {
  check_log_values(values, "JSONLTracker.log");
  TORCH_CHECK(file_ != nullptr, "[JSONLTracker.log] the tracker is finished: ", path_, " is closed");
  const std::string line = "{\"step\":" + (step ? std::to_string(*step) : std::string("null")) +
                           ",\"wall_time\":" + nlohmann::json(wall_time()).dump() + ",\"values\":" + values.dump() +
                           "}\n";
  write_bytes("JSONLTracker.log", file_, line, path_);
}

void JSONLTracker::finish() { close_file("JSONLTracker.finish", file_, path_); }

// ---- CSVTracker -------------------------------------------------------------------------------

namespace {

std::string csv_field(const std::string& text) {
  if (text.find_first_of(",\"\n\r") == std::string::npos) return text;
  std::string out = "\"";
  for (char c : text) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

// The records of a CSV text (a quoted field may hold line breaks), without their line ends.
std::vector<std::string> csv_records(const std::string& text) {
  std::vector<std::string> records;
  std::string current;
  bool quoted = false;
  for (char c : text) {
    if (c == '"') quoted = !quoted;
    if (c == '\n' && !quoted) {
      records.push_back(std::move(current));
      current.clear();
    } else {
      current.push_back(c);
    }
  }
  if (!current.empty()) records.push_back(std::move(current));
  return records;
}

std::vector<std::string> csv_fields(const std::string& record) {
  std::vector<std::string> fields(1);
  bool quoted = false;
  for (size_t i = 0; i < record.size(); ++i) {
    const char c = record[i];
    if (quoted) {
      if (c == '"' && i + 1 < record.size() && record[i + 1] == '"') {
        fields.back().push_back('"');
        ++i;
      } else if (c == '"') {
        quoted = false;
      } else {
        fields.back().push_back(c);
      }
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      fields.emplace_back();
    } else {
      fields.back().push_back(c);
    }
  }
  return fields;
}

std::string csv_header(const std::vector<std::string>& columns) {
  std::string out = "step,wall_time";
  for (const auto& c : columns) {
    // Appended piece by piece: GCC 12 misreads `"," + field` as an unbounded copy.
    out += ',';
    out += csv_field(c);
  }
  out += '\n';
  return out;
}

}  // namespace

CSVTracker::CSVTracker(const std::string& run_name, const std::string& logging_dir, const CSVTrackerOptions& options)
    : dir_((fs::path(logging_dir) / run_name).string()), path_((fs::path(dir_) / options.filename).string()) {
  TORCH_CHECK_VALUE(!logging_dir.empty(), "[CSVTracker] requires a logging_dir, got an empty one");
  create_folder("CSVTracker", dir_);
  // A run continuing in the same folder keeps the columns it had.
  if (fs::exists(path_)) {
    const auto records = csv_records(detail::read_file(path_));
    if (!records.empty()) {
      auto fields = csv_fields(records.front());
      TORCH_CHECK_VALUE(fields.size() >= 2 && fields[0] == "step" && fields[1] == "wall_time", "[CSVTracker] ", path_,
                        " exists and is not a log of this tracker (its header does not start with step,wall_time)");
      columns_.assign(fields.begin() + 2, fields.end());
    }
  }
  open_for_append();
}

CSVTracker::~CSVTracker() {
  if (file_ != nullptr) std::fclose(file_);
}

void CSVTracker::open_for_append() {
  file_ = open_file("CSVTracker", path_, "ab");
  if (std::ftell(file_) == 0) write_bytes("CSVTracker", file_, csv_header(columns_), path_);
}

void CSVTracker::store_init_configuration(const nlohmann::json& values) {
  write_whole("CSVTracker.store_init_configuration", (fs::path(dir_) / "config.json").string(), values.dump(2) + "\n");
}

void CSVTracker::log(const nlohmann::json& values, std::optional<int64_t> step) {
  check_log_values(values, "CSVTracker.log");
  TORCH_CHECK(file_ != nullptr, "[CSVTracker.log] the tracker is finished: ", path_, " is closed");
  const auto flat = flatten(values);
  const size_t old_columns = columns_.size();
  for (const auto& [key, value] : flat) {
    if (!contains(columns_, key)) columns_.push_back(key);
  }
  if (columns_.size() != old_columns) {
    // Rewrite with the extended header; earlier rows get empty fields for the new columns.
    std::fflush(file_);
    const auto records = csv_records(detail::read_file(path_));
    std::string text = csv_header(columns_);
    const std::string padding(columns_.size() - old_columns, ',');
    for (size_t i = 1; i < records.size(); ++i) text += records[i] + padding + "\n";
    std::fclose(std::exchange(file_, nullptr));
    write_whole("CSVTracker.log", path_, text);
    open_for_append();
  }
  std::vector<std::string> row(columns_.size());
  for (const auto& [key, value] : flat) {
    const size_t i = static_cast<size_t>(std::find(columns_.begin(), columns_.end(), key) - columns_.begin());
    row[i] = csv_field(value_text(value, /*python=*/false));
  }
  std::string line = step ? std::to_string(*step) : "";
  line += ',';
  line += nlohmann::json(wall_time()).dump();
  for (const auto& field : row) {
    line += ',';
    line += field;
  }
  write_bytes("CSVTracker.log", file_, line + "\n", path_);
}

void CSVTracker::finish() { close_file("CSVTracker.finish", file_, path_); }

// ---- the registry --------------------------------------------------------------------------

namespace detail {

// Note [The tracker registry]
// Every tracker name the library knows is one entry here: a built-in one with the options its
// init_kwargs accept, whether it writes under the logging folder, the checks beyond the keys, and
// how it is made; or one of upstream's that needs Python or a remote service, with `make` empty,
// which is refused by name. `available_trackers`, `filter_trackers`, `check_init_kwargs`,
// `make_tracker` and the Accelerator's stand-ins on other processes all read this table, so a
// tracker added here is whole; tests/tracking_test.cpp makes and logs through every built-in
// entry and checks that every `LoggerType` has one.
const std::vector<TrackerEntry>& tracker_registry() {
  using Make = TrackerEntry::Make;
  static const std::vector<TrackerEntry> entries = [] {
    auto option = [](const nlohmann::json& kwargs, const char* key, std::string fallback) {
      return kwargs.contains(key) ? kwargs.at(key).get<std::string>() : fallback;
    };
    std::vector<TrackerEntry> out;
    out.push_back({"tensorboard", {"filename_suffix", "flush_secs", "max_queue"}, /*needs_logging_dir=*/true, nullptr,
                   Make([option](const std::string& run, const std::string& dir, const nlohmann::json& kwargs) {
                     return std::make_shared<TensorBoardTracker>(
                         run, dir, TensorBoardTrackerOptions{option(kwargs, "filename_suffix", "")});
                   })});
    out.push_back({"dvclive", {"dir", "save_dvc_exp", "dvcyaml"}, /*needs_logging_dir=*/false,
                   [](const nlohmann::json& kwargs, const std::string& api) {
                     // dvclive.Live's save_dvc_exp and dvcyaml are accepted with the values that
                     // describe what this tracker does (no DVC experiment, no dvc.yaml), so
                     // upstream's documented calls port unchanged.
                     TORCH_CHECK_VALUE(!kwargs.contains("save_dvc_exp") || kwargs.at("save_dvc_exp") == false, "[",
                                       api,
                                       "] init_kwargs['dvclive']['save_dvc_exp']: only false is supported (no DVC "
                                       "experiment is saved), got ",
                                       kwargs.at("save_dvc_exp").dump());
                     TORCH_CHECK_VALUE(
                         !kwargs.contains("dvcyaml") || kwargs.at("dvcyaml").is_null() || kwargs.at("dvcyaml") == false,
                         "[", api,
                         "] init_kwargs['dvclive']['dvcyaml']: only null or false is supported (no dvc.yaml is "
                         "written), got ",
                         kwargs.at("dvcyaml").dump());
                   },
                   Make([option](const std::string& run, const std::string& dir, const nlohmann::json& kwargs) {
                     return std::make_shared<DVCLiveTracker>(run, dir, DVCLiveTrackerOptions{option(kwargs, "dir", "")});
                   })});
    out.push_back({"jsonl", {"filename"}, /*needs_logging_dir=*/true, nullptr,
                   Make([option](const std::string& run, const std::string& dir, const nlohmann::json& kwargs) {
                     return std::make_shared<JSONLTracker>(run, dir,
                                                           JSONLTrackerOptions{option(kwargs, "filename", "log.jsonl")});
                   })});
    out.push_back({"csv", {"filename"}, /*needs_logging_dir=*/true, nullptr,
                   Make([option](const std::string& run, const std::string& dir, const nlohmann::json& kwargs) {
                     return std::make_shared<CSVTracker>(run, dir, CSVTrackerOptions{option(kwargs, "filename", "log.csv")});
                   })});
    out.push_back({"wandb",
                   {"name", "notes", "tags", "group", "job_type", "entity", "dir", "id", "mode", "config"},
                   /*needs_logging_dir=*/false,
                   [](const nlohmann::json& kwargs, const std::string& api) {
                     for (const char* key : {"name", "notes", "group", "job_type", "entity", "id", "mode"}) {
                       if (kwargs.contains(key)) (void)string_option(kwargs, key, api, "wandb");
                     }
                     TORCH_CHECK_VALUE(!kwargs.contains("tags") || (kwargs.at("tags").is_array() &&
                                                                     std::all_of(kwargs.at("tags").begin(),
                                                                                 kwargs.at("tags").end(),
                                                                                 [](const auto& t) { return t.is_string(); })),
                                       "[", api, "] init_kwargs['wandb']['tags']: expected a list of strings, got ",
                                       kwargs.value("tags", nlohmann::json()).dump());
                     TORCH_CHECK_VALUE(!kwargs.contains("config") || kwargs.at("config").is_object(), "[", api,
                                       "] init_kwargs['wandb']['config']: expected a JSON object, got ",
                                       kwargs.value("config", nlohmann::json()).dump());
                   },
                   Make([option](const std::string& run, const std::string&, const nlohmann::json& kwargs) {
                     WandBTrackerOptions o;
                     o.name = option(kwargs, "name", "");
                     o.notes = option(kwargs, "notes", "");
                     o.group = option(kwargs, "group", "");
                     o.job_type = option(kwargs, "job_type", "");
                     o.entity = option(kwargs, "entity", "");
                     o.dir = option(kwargs, "dir", "");
                     o.id = option(kwargs, "id", "");
                     o.mode = option(kwargs, "mode", "");
                     if (kwargs.contains("tags")) o.tags = kwargs.at("tags").get<std::vector<std::string>>();
                     if (kwargs.contains("config")) o.config = kwargs.at("config");
                     return std::make_shared<WandBTracker>(run, o);
                   })});
    out.push_back({"mlflow",
                   {"run_id", "tags", "nested_run", "run_name", "description", "flush_timeout"},
                   /*needs_logging_dir=*/false,
                   [](const nlohmann::json& kwargs, const std::string& api) {
                     for (const char* key : {"run_id", "run_name", "description"}) {
                       if (kwargs.contains(key)) (void)string_option(kwargs, key, api, "mlflow");
                     }
                     TORCH_CHECK_VALUE(!kwargs.contains("tags") || kwargs.at("tags").is_object() ||
                                           kwargs.at("tags").is_string(),
                                       "[", api, "] init_kwargs['mlflow']['tags']: expected a JSON object (or its text), got ",
                                       kwargs.value("tags", nlohmann::json()).dump());
                     TORCH_CHECK_VALUE(!kwargs.contains("nested_run") || kwargs.at("nested_run").is_boolean(), "[", api,
                                       "] init_kwargs['mlflow']['nested_run']: expected a boolean, got ",
                                       kwargs.value("nested_run", nlohmann::json()).dump());
                   },
                   Make([option](const std::string& run, const std::string& dir, const nlohmann::json& kwargs) {
                     MLflowTrackerOptions o;
                     o.run_id = option(kwargs, "run_id", "");
                     o.run_name = option(kwargs, "run_name", "");
                     o.description = option(kwargs, "description", "");
                     if (kwargs.contains("tags")) {
                       const auto& tags = kwargs.at("tags");
                       o.tags = tags.is_string() ? nlohmann::json::parse(tags.get<std::string>(), nullptr, false) : tags;
                       TORCH_CHECK_VALUE(o.tags.is_object(),
                                         "[MLflowTracker] tags: expected a JSON object's text, got ", tags.dump());
                     }
                     o.nested_run = kwargs.value("nested_run", false);
                     o.flush_timeout = kwargs.value("flush_timeout", 60.0);
                     return std::make_shared<MLflowTracker>(run, dir, o);
                   }),
                   // "all" takes it only with a server to speak to.
                   [] { return std::getenv("MLFLOW_TRACKING_URI") != nullptr; }});
    // Upstream's trackers that need Python or a cloud service.
    for (const char* name : {"comet_ml", "aim", "clearml", "swanlab", "trackio"}) {
      out.push_back({name, {}, /*needs_logging_dir=*/false, nullptr, Make()});
    }
    return out;
  }();
  return entries;
}

const TrackerEntry* find_tracker_entry(const std::string& name) {
  for (const auto& entry : tracker_registry()) {
    if (entry.name == name) return &entry;
  }
  return nullptr;
}

}  // namespace detail

namespace {

// The built-in trackers; with `available_now`, only those that can run now (upstream's
// `get_available_trackers`: mlflow with a server to speak to).
std::vector<std::string> builtin_names(bool available_now = false) {
  std::vector<std::string> names;
  for (const auto& entry : detail::tracker_registry()) {
    if (entry.built_in() && (!available_now || !entry.available || entry.available())) names.push_back(entry.name);
  }
  return names;
}

}  // namespace

// ---- names ------------------------------------------------------------------------------------

Tracker::Tracker(std::shared_ptr<GeneralTracker> tracker) : tracker_(std::move(tracker)) {
  TORCH_CHECK_VALUE(tracker_ != nullptr, "[Tracker] expected a tracker, got null");
}

std::string Tracker::name() const { return tracker_ ? tracker_->name() : name_; }

std::vector<std::string> available_trackers() { return builtin_names(/*available_now=*/true); }

std::vector<Tracker> filter_trackers(const std::vector<Tracker>& log_with, const std::string& logging_dir) {
  return detail::filter_trackers(log_with, logging_dir, "filter_trackers");
}

std::shared_ptr<GeneralTracker> make_tracker(const std::string& name, const std::string& run_name,
                                             const std::string& logging_dir, const nlohmann::json& init_kwargs) {
  return detail::make_tracker(name, run_name, logging_dir, init_kwargs, "make_tracker");
}

namespace detail {

std::vector<Tracker> filter_trackers(const std::vector<Tracker>& log_with, const std::string& logging_dir,
                                     const std::string& api) {
  const std::string choices = detail::join(builtin_names()) + ", all";
  std::vector<Tracker> requested;
  bool all = false;
  for (const auto& tracker : log_with) {
    if (!tracker.is_name()) continue;
    const std::string name = tracker.name();
    if (name == "all") {
      all = true;
      continue;
    }
    const TrackerEntry* entry = find_tracker_entry(name);
    TORCH_CHECK_VALUE(entry == nullptr || entry->built_in(), "[", api, "] log_with: '", name,
                      "' needs Python or a remote service and is not available in accelerate-cpp; available trackers: ",
                      choices, " (or implement GeneralTracker and pass your tracker)");
    TORCH_CHECK_VALUE(entry != nullptr, "[", api, "] log_with: unsupported logging capability '", name,
                      "'; choose between ", choices, " (or pass a GeneralTracker of your own)");
  }
  std::vector<Tracker> out;
  std::vector<std::string> seen;
  auto add = [&](const Tracker& t) {
    if (t.is_name()) {
      if (contains(seen, t.name())) return;
      seen.push_back(t.name());
      TORCH_CHECK_VALUE(!find_tracker_entry(t.name())->needs_logging_dir || !logging_dir.empty(), "[", api, "] log_with: logging with '", t.name(),
                        "' requires a logging_dir; set project_dir or project_config.logging_dir");
    } else if (t.tracker()->requires_logging_directory()) {
      TORCH_CHECK_VALUE(!logging_dir.empty(), "[", api, "] log_with: logging with '", t.name(),
                        "' requires a logging_dir; set project_dir or project_config.logging_dir");
    }
    out.push_back(t);
  };
  // Upstream's order: log_with as given; with "all", the user's trackers then every built-in.
  if (all) {
    for (const auto& tracker : log_with) {
      if (!tracker.is_name()) add(tracker);
    }
    for (const auto& name : builtin_names(/*available_now=*/true)) add(name);
  } else {
    for (const auto& tracker : log_with) add(tracker);
  }
  return out;
}

void check_init_kwargs(const std::string& name, const nlohmann::json& kwargs, const std::string& api) {
  const TrackerEntry* entry = find_tracker_entry(name);
  TORCH_INTERNAL_ASSERT(entry != nullptr && entry->built_in(), "check_init_kwargs: '", name, "' is no built-in tracker");
  check_option_keys(kwargs, entry->init_keys, api, name);
  if (entry->check) entry->check(kwargs, api);
  for (const auto& key : {"filename_suffix", "dir", "filename"}) {
    if (kwargs.contains(key)) (void)string_option(kwargs, key, api, name);
  }
  for (const auto& key : {"flush_secs", "max_queue", "flush_timeout"}) {
    if (kwargs.contains(key)) {
      TORCH_CHECK_VALUE(kwargs.at(key).is_number(), "[", api, "] init_kwargs['", name, "']['", key,
                        "']: expected a number, got ", kwargs.at(key).dump());
    }
  }
  if (kwargs.contains("filename")) {
    const auto filename = kwargs.at("filename").get<std::string>();
    TORCH_CHECK_VALUE(!filename.empty() && filename.find('/') == std::string::npos, "[", api, "] init_kwargs['", name,
                      "']['filename']: expected a file name without folders, got '", filename, "'");
  }
}

std::shared_ptr<GeneralTracker> make_tracker(const std::string& name, const std::string& run_name,
                                             const std::string& logging_dir, const nlohmann::json& init_kwargs,
                                             const std::string& api) {
  const TrackerEntry* entry = find_tracker_entry(name);
  TORCH_CHECK_VALUE(entry != nullptr && entry->built_in(), "[", api, "] unknown tracker '", name,
                    "'; available trackers: ", detail::join(builtin_names()));
  check_init_kwargs(name, init_kwargs, api);
  return entry->make(run_name, logging_dir, init_kwargs);
}

void check_hparams(const nlohmann::json& values, const std::string& api) {
  TORCH_CHECK_VALUE(values.is_object(), "[", api, "] expected a JSON object of hyperparameters, got ",
                    values.type_name());
  for (const auto& [key, value] : values.items()) {
    TORCH_CHECK_VALUE(value.is_null() || value.is_primitive(), "[", api, "] '", key,
                      "': TensorBoard hyperparameters are numbers, booleans, strings or null, got ", value.type_name(),
                      " (", value.dump(), ")");
  }
}

}  // namespace detail

}  // namespace accelerate
