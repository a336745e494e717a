// W&B offline runs (upstream: WandBTracker); see include/accelerate/tracking.h and Note [W&B
// offline runs] in docs/design.md. The run file's encoding is in formats/wandb_log.
#include "accelerate/tracking.h"

#include "detail/files.h"
#include "detail/warn.h"
#include "formats/wandb_log.h"
#include "tracking_impl.h"

#include <c10/util/Exception.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <exception>
#include <random>

namespace accelerate {

namespace fs = std::filesystem;
namespace wandb_log = detail::wandb_log;

namespace {

double seconds_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string wandb_env_or(const std::string& value, const char* name) {
  if (!value.empty()) return value;
  const char* v = std::getenv(name);
  return v != nullptr ? v : "";
}

// Numbers as Python's json module writes them (W&B's value_json), non-finite ones included.
std::string json_text(const nlohmann::json& v) {
  if (v.is_number_float() && !std::isfinite(v.get<double>())) {
    const double d = v.get<double>();
    return std::isnan(d) ? "NaN" : d > 0 ? "Infinity" : "-Infinity";
  }
  return v.dump();
}

std::string random_id() {
  static const char alphabet[] = "abcdefghijklmnopqrstuvwxyz0123456789";
  std::random_device device;
  std::mt19937_64 engine((static_cast<uint64_t>(device()) << 32) ^ device() ^ static_cast<uint64_t>(::getpid()));
  std::string id;
  for (int i = 0; i < 8; ++i) id.push_back(alphabet[engine() % (sizeof(alphabet) - 1)]);
  return id;
}

// A key as a file name part: W&B's media files sit flat in media/images/.
std::string file_part(std::string key) {
  for (char& c : key) {
    if (c == '/' || c == '\\' || c == ' ') c = '_';
  }
  return key;
}

}  // namespace

// The run file, appended one framed record at a time and flushed to the operating system.
struct WandBTracker::Writer {
  std::string path;
  std::FILE* file = nullptr;
  uint64_t offset = 0;
  int64_t num = 0;

  void append(const std::string& bytes) {
    if (std::fwrite(bytes.data(), 1, bytes.size(), file) != bytes.size() || std::fflush(file) != 0) {
      C10_THROW_ERROR(ValueError, "[WandBTracker] cannot write " + path + ": " + std::strerror(errno));
    }
    offset += bytes.size();
  }
  template <typename Make>
  void record(Make&& make) {
    append(wandb_log::frame(make(++num), offset));
  }
  void close(bool sync) {
    if (file == nullptr) return;
    std::FILE* f = std::exchange(file, nullptr);
    const bool ok = std::fflush(f) == 0 && (!sync || ::fsync(::fileno(f)) == 0);
    const int error = errno;
    if (std::fclose(f) != 0 || !ok) {
      C10_THROW_ERROR(ValueError, "[WandBTracker.finish] cannot close " + path + ": " + std::strerror(error));
    }
  }
  ~Writer() {
    if (file != nullptr) std::fclose(file);
  }
};

WandBTracker::WandBTracker(const std::string& run_name, const WandBTrackerOptions& options) {
  constexpr const char* api = "WandBTracker";
  std::string mode = wandb_env_or(options.mode, "WANDB_MODE");
  if (mode.empty() || mode == "dryrun") mode = "offline";
  TORCH_CHECK_VALUE(mode != "online" && mode != "run" && mode != "shared", "[", api, "] mode '", mode,
                    "': accelerate-cpp writes W&B runs in offline mode only (online mode needs W&B's own service); "
                    "set WANDB_MODE=offline (or init_kwargs {\"wandb\": {\"mode\": \"offline\"}}) and upload the run "
                    "afterwards with `wandb sync <dir>/wandb/offline-run-*`");
  TORCH_CHECK_VALUE(mode == "offline" || mode == "disabled", "[", api, "] mode '", mode,
                    "': expected offline, dryrun or disabled");
  TORCH_CHECK_VALUE(options.config.is_object(), "[", api, "] config: expected a JSON object, got ",
                    options.config.dump());
  run_id_ = wandb_env_or(options.id, "WANDB_RUN_ID");
  if (run_id_.empty()) run_id_ = random_id();
  for (char c : run_id_) {
    TORCH_CHECK_VALUE(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-', "[", api, "] run id '",
                      run_id_, "': W&B run ids are letters, digits, '_' and '-'");
  }
  start_ = seconds_now();
  if (mode == "disabled") return;

  const fs::path dir = wandb_env_or(options.dir, "WANDB_DIR").empty() ? fs::path(".") : fs::path(wandb_env_or(options.dir, "WANDB_DIR"));
  const auto seconds = static_cast<std::time_t>(start_);
  std::tm utc{};
  ::gmtime_r(&seconds, &utc);
  char stamp[32];
  std::strftime(stamp, sizeof(stamp), "%Y%m%d_%H%M%S", &utc);
  const std::string folder = "offline-run-" + std::string(stamp) + "-" + run_id_;
  run_dir_ = (dir / "wandb" / folder).string();
  std::error_code error;
  fs::create_directories(fs::path(run_dir_) / "files", error);
  TORCH_CHECK_VALUE(!error, "[", api, "] cannot create the folder ", run_dir_, ": ", error.message());

  writer_ = std::make_unique<Writer>();
  writer_->path = (fs::path(run_dir_) / ("run-" + run_id_ + ".wandb")).string();
  writer_->file = std::fopen(writer_->path.c_str(), "wbx");
  TORCH_CHECK_VALUE(writer_->file != nullptr, "[", api, "] cannot create ", writer_->path, ": ", std::strerror(errno));
  // W&B points `latest-run` at the newest run; a failure to do so loses nothing.
  const fs::path latest = dir / "wandb" / "latest-run";
  fs::remove(latest, error);
  fs::create_directory_symlink(folder, latest, error);

  wandb_log::Run run;
  run.run_id = run_id_;
  run.project = run_name.empty() ? wandb_env_or("", "WANDB_PROJECT") : run_name;
  if (run.project.empty()) run.project = "uncategorized";
  run.entity = wandb_env_or(options.entity, "WANDB_ENTITY");
  run.display_name = wandb_env_or(options.name, "WANDB_NAME");
  run.notes = wandb_env_or(options.notes, "WANDB_NOTES");
  run.run_group = wandb_env_or(options.group, "WANDB_RUN_GROUP");
  run.job_type = wandb_env_or(options.job_type, "WANDB_JOB_TYPE");
  run.tags = options.tags;
  if (run.tags.empty()) {
    std::string tags = wandb_env_or("", "WANDB_TAGS");
    for (size_t start = 0; !tags.empty() && start <= tags.size();) {
      const size_t comma = std::min(tags.find(',', start), tags.size());
      if (comma > start) run.tags.push_back(tags.substr(start, comma - start));
      start = comma + 1;
    }
  }
  run.host = detail::tracker_hostname();
  run.start_time = start_;
  for (const auto& [key, value] : options.config.items()) run.config.push_back({{key}, json_text(value)});

  writer_->append(wandb_log::file_header());
  writer_->record([](int64_t num) { return wandb_log::header_record(num, "accelerate-cpp"); });
  writer_->record([&](int64_t num) { return wandb_log::run_record(num, run); });
}

// A run the program leaves without `finish` (upstream: wandb's exit hook) is ended too: with exit
// code 1 while an exception unwinds the stack, else 0.
WandBTracker::~WandBTracker() {
  if (finished_ || !writer_ || writer_->file == nullptr) return;
  try {
    commit_row();
    const auto runtime = static_cast<int32_t>(seconds_now() - start_);
    const int32_t code = std::uncaught_exceptions() > 0 ? 1 : 0;
    writer_->record([&](int64_t num) { return wandb_log::exit_record(num, code, runtime); });
    writer_->close(/*sync=*/true);
  } catch (const std::exception& e) {
    detail::warn("accelerate.tracking", std::string("[WandBTracker] could not end the run: ") + e.what());
  }
}

void WandBTracker::store_init_configuration(const nlohmann::json& values) {
  TORCH_CHECK_VALUE(values.is_object(), "[WandBTracker.store_init_configuration] expected a JSON object, got ",
                    values.type_name());
  if (!writer_) return;
  TORCH_CHECK(writer_->file != nullptr, "[WandBTracker.store_init_configuration] the run has finished");
  std::vector<wandb_log::Item> items;
  for (const auto& [key, value] : values.items()) items.push_back({{key}, json_text(value)});
  writer_->record([&](int64_t num) { return wandb_log::config_record(num, items); });
}

void WandBTracker::commit_row() {
  if (row_.empty()) return;
  std::vector<wandb_log::Item> items;
  for (const auto& [key, value] : row_.items()) {
    if (value.is_object()) {
      for (const auto& [member, v] : value.items()) items.push_back({{key, member}, json_text(v)});
    } else {
      items.push_back({{key}, json_text(value)});
    }
    summary_[key] = value;
  }
  items.push_back({{"_step"}, std::to_string(step_)});
  items.push_back({{"_runtime"}, json_text(row_time_ - start_)});
  items.push_back({{"_timestamp"}, json_text(row_time_)});
  row_ = nlohmann::json::object();
  if (!writer_) return;
  writer_->record([&](int64_t num) { return wandb_log::history_record(num, items, step_); });
  writer_->record([&](int64_t num) { return wandb_log::summary_record(num, items); });
}

void WandBTracker::add_row(const nlohmann::json& values, std::optional<int64_t> step, const char* api) {
  TORCH_CHECK(!finished_, "[", api, "] the run has finished");
  if (step.has_value()) {
    if (*step < step_) {
      detail::warn("accelerate.tracking", "[" + std::string(api) + "] step " + std::to_string(*step) +
                                              " is before the run's current step " + std::to_string(step_) +
                                              "; W&B keeps steps increasing, so these values are dropped",
                   {.once = true});
      return;
    }
    if (*step > step_) {
      commit_row();
      step_ = *step;
    }
  }
  if (row_.empty()) row_time_ = seconds_now();
  for (const auto& [key, value] : values.items()) row_[key] = value;
  if (!step.has_value()) {
    commit_row();
    ++step_;
  }
}

void WandBTracker::log(const nlohmann::json& values, std::optional<int64_t> step) {
  check_log_values(values, "WandBTracker.log");
  add_row(values, step, "WandBTracker.log");
}

void WandBTracker::log_images(const std::map<std::string, at::Tensor>& images, std::optional<int64_t> step) {
  constexpr const char* api = "WandBTracker.log_images";
  TORCH_CHECK(!finished_, "[", api, "] the run has finished");
  // Every image is checked and encoded before anything is written.
  std::vector<std::pair<std::string, std::vector<detail::TrackerImage>>> encoded;
  for (const auto& [key, tensor] : images) {
    TORCH_CHECK_VALUE(tensor.defined() && (tensor.dim() == 3 || tensor.dim() == 4), "[", api, "] '", key,
                      "': expected a [C, H, W] or [N, C, H, W] tensor");
    const at::Tensor batch = tensor.dim() == 3 ? tensor.unsqueeze(0) : tensor;
    std::vector<detail::TrackerImage> list;
    for (int64_t i = 0; i < batch.size(0); ++i) list.push_back(detail::tracker_image(api, key, batch[i]));
    TORCH_CHECK_VALUE(!list.empty(), "[", api, "] '", key, "': no images");
    encoded.emplace_back(key, std::move(list));
  }
  const int64_t at = step.value_or(step_);
  nlohmann::json values = nlohmann::json::object();
  std::vector<std::string> paths;
  for (const auto& [key, list] : encoded) {
    nlohmann::json filenames = nlohmann::json::array();
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string path = "media/images/" + file_part(key) + "_" + std::to_string(at) + "_" + std::to_string(i) + ".png";
      if (writer_) {
        const fs::path file = fs::path(run_dir_) / "files" / path;
        std::error_code error;
        fs::create_directories(file.parent_path(), error);
        TORCH_CHECK_VALUE(!error, "[", api, "] cannot create the folder ", file.parent_path().string(), ": ",
                          error.message());
        detail::write_file_atomically(file.string(), list[i].png);
      }
      filenames.push_back(path);
      paths.push_back(path);
    }
    values[key] = {{"_type", "images/separated"}, {"width", list[0].width}, {"height", list[0].height},
                   {"format", "png"},             {"count", list.size()},   {"filenames", filenames}};
  }
  if (writer_) writer_->record([&](int64_t num) { return wandb_log::files_record(num, paths); });
  add_row(values, step, api);
}

void WandBTracker::finish() {
  if (finished_) return;
  commit_row();
  finished_ = true;
  if (!writer_) return;
  const auto runtime = static_cast<int32_t>(seconds_now() - start_);
  writer_->record([&](int64_t num) { return wandb_log::exit_record(num, 0, runtime); });
  writer_->close(/*sync=*/true);
}

}  // namespace accelerate
