// Experiment tracking (upstream: accelerate/tracking.py): the `GeneralTracker` interface user
// trackers implement, and the built-in trackers that write local files with no Python and no
// remote service — `TensorBoardTracker` (event files TensorBoard opens), `DVCLiveTracker`
// (dvclive's folder layout), `JSONLTracker` and `CSVTracker`. An `Accelerator` creates them from
// `AcceleratorOptions::log_with` in `init_trackers`; see accelerator.h. Trackers that need a
// remote service or a Python package (wandb, comet_ml, aim, mlflow, clearml, swanlab, trackio)
// are not provided: implement `GeneralTracker` to bridge to one.
//
// Values a tracker logs are a JSON object: numbers (and booleans, as 0/1) are scalars, strings
// are text, and an object of numbers is a group of scalars (TensorBoard's `add_scalars`; the
// other trackers flatten it to `main/sub` keys). Anything else is refused naming its key.
//
// Example:
//   accelerate::Accelerator accelerator({.log_with = {"tensorboard", "jsonl"}, .project_dir = "runs"});
//   accelerator.init_trackers("my_project", {{"learning_rate", 1e-3}, {"batch_size", 32}});
//   accelerator.log({{"loss", 0.5}, {"accuracy", 0.9}}, /*step=*/10);
//   accelerator.end_training();
#pragma once

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace accelerate {

/// The base class of every tracker (upstream: `GeneralTracker`). A tracker object is one run:
/// it starts when constructed and ends with `finish`.
class GeneralTracker {
 public:
  virtual ~GeneralTracker();
  /// The tracker's name, as used in `log_with`, `init_kwargs`, `log_kwargs` and `get_tracker`.
  virtual std::string name() const = 0;
  /// Whether the tracker writes under the accelerator's `logging_dir` (and so needs one).
  virtual bool requires_logging_directory() const = 0;
  /// Whether only the main process uses the tracker; on the other processes the `Accelerator`
  /// replaces it by a tracker that does nothing.
  virtual bool main_process_only() const { return true; }
  /// Records `values` (a JSON object) as the run's hyperparameters.
  virtual void store_init_configuration(const nlohmann::json& values) = 0;
  /// Records `values` (a JSON object, see the file comment) at `step`.
  virtual void log(const nlohmann::json& values, std::optional<int64_t> step) = 0;
  /// Records images (`[C, H, W]` or `[N, C, H, W]` tensors, see `TensorBoardTracker::log_images`)
  /// at `step`. The default refuses, naming the tracker.
  virtual void log_images(const std::map<std::string, at::Tensor>& images, std::optional<int64_t> step);
  /// Ends the run: flushes and closes what the tracker writes. Called by `end_training`.
  virtual void finish() {}
};

/// Options of `TensorBoardTracker` (`init_kwargs["tensorboard"]`; upstream passes these to
/// `SummaryWriter`).
struct TensorBoardTrackerOptions {
  /// Appended to the name of every event file.
  std::string filename_suffix{};
};

/// Writes TensorBoard event files (upstream: `TensorBoardTracker` over `SummaryWriter`) to
/// `<logging_dir>/<run_name>/events.out.tfevents.<secs>.<host>.<pid>.<n><suffix>`:
/// numbers as scalars, strings as text (tag `<key>/text_summary`), an object of numbers as
/// `add_scalars` writes it (one event file per member in `<run>/<key>_<member>/`, tag `<key>`),
/// images as PNG. `store_init_configuration` writes the hparams plugin's experiment, session start
/// and session end records to `<run>/<time>/events.out.tfevents…`, and `hparams.yml` beside them.
/// Every record is flushed to the operating system when written (a crash of the program loses
/// nothing logged before it); `finish` flushes the files to the disk and closes them.
///
/// Example (open with `tensorboard --logdir <logging_dir>`):
///   auto tracker = std::make_shared<accelerate::TensorBoardTracker>("run", "logs");
///   tracker->log({{"loss", 0.25}}, 1);
class TensorBoardTracker : public GeneralTracker {
 public:
  TensorBoardTracker(const std::string& run_name, const std::string& logging_dir,
                     const TensorBoardTrackerOptions& options = {});
  ~TensorBoardTracker() override;
  std::string name() const override { return "tensorboard"; }
  bool requires_logging_directory() const override { return true; }
  void store_init_configuration(const nlohmann::json& values) override;
  void log(const nlohmann::json& values, std::optional<int64_t> step) override;
  /// Writes each tensor as one image (upstream: `add_images`): `[C, H, W]`, or `[N, C, H, W]`
  /// tiled in a grid of up to 8 columns; C is 1 (grey), 3 (RGB) or 4 (RGBA); floating values in
  /// [0, 1], uint8 values as they are.
  void log_images(const std::map<std::string, at::Tensor>& images, std::optional<int64_t> step) override;
  void finish() override;
  /// The folder of this run's event files.
  const std::string& logging_dir() const { return run_dir_; }

 private:
  class EventWriter;
  EventWriter& writer_for(const std::string& folder);

  std::string run_dir_;
  TensorBoardTrackerOptions options_;
  std::unique_ptr<EventWriter> main_;
  std::map<std::string, std::unique_ptr<EventWriter>> scalars_writers_;
};

/// Options of `DVCLiveTracker` (`init_kwargs["dvclive"]`; upstream passes these to `dvclive.Live`).
/// `init_kwargs` also accepts dvclive's `"save_dvc_exp": false` and `"dvcyaml": null` (or false),
/// which describe what this tracker does: it saves no DVC experiment and writes no dvc.yaml.
struct DVCLiveTrackerOptions {
  /// The output folder; empty: `<logging_dir>/<run_name>` with a logging folder, else "dvclive"
  /// (dvclive's default).
  std::string dir{};
};

/// Writes dvclive's folder layout without dvclive (upstream: `DVCLiveTracker`): every `log` call
/// appends one row per value to `<dir>/plots/metrics/<key>.tsv` (`step\t<basename of key>`),
/// rewrites `<dir>/metrics.json` with the latest value of every metric (keys with `/` nest) and
/// `"step"`, then advances the step as dvclive's `next_step` does; `store_init_configuration`
/// writes `<dir>/params.yaml`. Numbers and strings are metrics; non-finite numbers and booleans
/// are written as Python's dvclive writes them (`nan`, `True`). Metric names must stay inside the
/// folder (no absolute names, no `.` or `..` parts).
class DVCLiveTracker : public GeneralTracker {
 public:
  DVCLiveTracker(const std::string& run_name, const std::string& logging_dir,
                 const DVCLiveTrackerOptions& options = {});
  std::string name() const override { return "dvclive"; }
  bool requires_logging_directory() const override { return false; }
  void store_init_configuration(const nlohmann::json& values) override;
  void log(const nlohmann::json& values, std::optional<int64_t> step) override;
  /// The output folder.
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  int64_t step_ = 0;
  nlohmann::json summary_ = nlohmann::json::object();
  nlohmann::json params_ = nlohmann::json::object();
};

/// Options of `JSONLTracker` (`init_kwargs["jsonl"]`).
struct JSONLTrackerOptions {
  /// The log file's name inside `<logging_dir>/<run_name>`.
  std::string filename = "log.jsonl";
};

/// Appends one JSON object per `log` call, one per line, to `<logging_dir>/<run_name>/log.jsonl`:
/// `{"step":<step or null>,"wall_time":<seconds since the epoch>,"values":{…as logged…}}`
/// (JSON has no NaN or infinity: such values are written as null).
/// `store_init_configuration` writes `<logging_dir>/<run_name>/config.json`. Each line is flushed
/// to the operating system when written.
class JSONLTracker : public GeneralTracker {
 public:
  JSONLTracker(const std::string& run_name, const std::string& logging_dir, const JSONLTrackerOptions& options = {});
  ~JSONLTracker() override;
  std::string name() const override { return "jsonl"; }
  bool requires_logging_directory() const override { return true; }
  void store_init_configuration(const nlohmann::json& values) override;
  void log(const nlohmann::json& values, std::optional<int64_t> step) override;
  void finish() override;
  /// The log file.
  const std::string& path() const { return path_; }

 private:
  std::string dir_;
  std::string path_;
  std::FILE* file_ = nullptr;
};

/// Options of `CSVTracker` (`init_kwargs["csv"]`).
struct CSVTrackerOptions {
  /// The log file's name inside `<logging_dir>/<run_name>`.
  std::string filename = "log.csv";
};

/// Writes one row per `log` call to `<logging_dir>/<run_name>/log.csv` (RFC 4180: comma
/// separated, `\n` line ends, fields with a comma, quote or line break quoted): the header is
/// `step,wall_time` then every key in the order it first appeared (an object of numbers gives
/// `key/member` columns); a value not logged in a row is an empty field, as is a missing step.
/// Numbers are written in JSON's shortest round-trip form (`nan`, `inf`, `-inf` for non-finite ones).
/// When a row brings a new key, the file is rewritten with the extended header (old rows get
/// empty fields) into a temporary file that is then renamed over the old one, so the file is
/// always a complete, rectangular CSV. `store_init_configuration` writes `config.json` beside.
class CSVTracker : public GeneralTracker {
 public:
  CSVTracker(const std::string& run_name, const std::string& logging_dir, const CSVTrackerOptions& options = {});
  ~CSVTracker() override;
  std::string name() const override { return "csv"; }
  bool requires_logging_directory() const override { return true; }
  void store_init_configuration(const nlohmann::json& values) override;
  void log(const nlohmann::json& values, std::optional<int64_t> step) override;
  void finish() override;
  /// The log file.
  const std::string& path() const { return path_; }

 private:
  void open_for_append();
  std::string dir_;
  std::string path_;
  std::vector<std::string> columns_;
  std::FILE* file_ = nullptr;
};

/// Options of `WandBTracker` (`init_kwargs["wandb"]`; upstream passes these to `wandb.init`).
/// An empty field falls back to W&B's environment variable, as `wandb.init` does.
struct WandBTrackerOptions {
  std::string name{};      // the run's display name (WANDB_NAME)
  std::string notes{};     // WANDB_NOTES
  std::vector<std::string> tags{};  // WANDB_TAGS (comma separated)
  std::string group{};     // WANDB_RUN_GROUP
  std::string job_type{};  // WANDB_JOB_TYPE
  std::string entity{};    // WANDB_ENTITY
  std::string dir{};       // the folder that holds `wandb/` (WANDB_DIR, else the current folder)
  std::string id{};        // the run's id (WANDB_RUN_ID, else 8 random letters and digits)
  std::string mode{};      // "offline" (the default) or "disabled" (WANDB_MODE); "online" is refused
  nlohmann::json config = nlohmann::json::object();  // the run's configuration at its start
};

/// Writes a W&B offline run (upstream: `WandBTracker` over `wandb.init` in offline mode, the usual
/// way on compute nodes without internet) that `wandb sync <folder>` uploads later:
/// `<dir>/wandb/offline-run-<YYYYmmdd_HHMMSS>-<id>/run-<id>.wandb` (W&B's transaction log), with
/// images under its `files/media/images/` and `<dir>/wandb/latest-run` pointing at it. The project
/// is `init_trackers`' name (WANDB_PROJECT only when that is empty, as `wandb.init(project=...)`).
/// `store_init_configuration` updates the run's config; `log` follows `wandb.log`'s steps: a call
/// without a step commits a row at the current step and moves to the next, a call at a later step
/// commits the pending row and starts one there, a call at the same step adds to it, an earlier
/// step is dropped with a warning; every committed row also updates the summary (the latest value
/// of each key, with `_step`, `_runtime`, `_timestamp`). An object of numbers is logged as W&B's
/// nested keys. `finish` commits the pending row and writes the run's exit (code 0). Every record
/// is flushed to the operating system when written; a run ended by a crash syncs as far as it got.
/// Online mode is refused: it needs W&B's own service; write offline and run `wandb sync`.
///
/// Example:
///   auto tracker = std::make_shared<accelerate::WandBTracker>("my_project", accelerate::WandBTrackerOptions{.name = "baseline"});
///   tracker->log({{"loss", 0.25}}, 1);
///   tracker->finish();  // then: wandb sync wandb/offline-run-*
class WandBTracker : public GeneralTracker {
 public:
  WandBTracker(const std::string& run_name, const WandBTrackerOptions& options = {});
  ~WandBTracker() override;
  std::string name() const override { return "wandb"; }
  bool requires_logging_directory() const override { return false; }
  void store_init_configuration(const nlohmann::json& values) override;
  void log(const nlohmann::json& values, std::optional<int64_t> step) override;
  /// Each tensor is a list of images as upstream's `log_images` logs it (`wandb.Image` each,
  /// W&B's "images/separated"): `[C, H, W]` one image, `[N, C, H, W]` N images, as PNG files;
  /// C is 1, 3 or 4, floating values in [0, 1] or uint8.
  void log_images(const std::map<std::string, at::Tensor>& images, std::optional<int64_t> step) override;
  void finish() override;
  /// The offline run's folder (empty when the mode is "disabled").
  const std::string& run_dir() const { return run_dir_; }
  /// The run's id.
  const std::string& run_id() const { return run_id_; }

 private:
  struct Writer;
  void add_row(const nlohmann::json& values, std::optional<int64_t> step, const char* api);
  void commit_row();
  std::string run_dir_;
  std::string run_id_;
  std::unique_ptr<Writer> writer_;
  int64_t step_ = 0;
  nlohmann::json row_ = nlohmann::json::object();
  nlohmann::json summary_ = nlohmann::json::object();
  double start_ = 0;
  double row_time_ = 0;
  bool finished_ = false;
};

/// Options of `MLflowTracker` (`init_kwargs["mlflow"]`; upstream's `MLflowTracker` arguments).
struct MLflowTrackerOptions {
  /// Log into this existing run instead of creating one (MLFLOW_RUN_ID wins, as upstream).
  std::string run_id{};
  /// Tags of the run, a JSON object (MLFLOW_TAGS, a JSON object's text, wins, as upstream).
  nlohmann::json tags = nlohmann::json::object();
  /// Only false: a nested run needs a parent run active in the same program (MLFLOW_NESTED_RUN).
  bool nested_run = false;
  /// The new run's name (the `mlflow.runName` tag).
  std::string run_name{};
  /// The run's description (the `mlflow.note.content` tag).
  std::string description{};
  /// accelerate-cpp's own: how long `finish` waits for the server to take what is still queued.
  double flush_timeout = 60;
};

/// Logs to an MLflow tracking server through its REST API (upstream: `MLflowTracker` over the
/// `mlflow` client), with libcurl: the server is `MLFLOW_TRACKING_URI` (http:// or https://;
/// `MLFLOW_TRACKING_TOKEN` or `MLFLOW_TRACKING_USERNAME`/`MLFLOW_TRACKING_PASSWORD` authenticate,
/// `MLFLOW_TRACKING_INSECURE_TLS=true` skips the certificate check, `MLFLOW_HTTP_REQUEST_TIMEOUT`
/// bounds each request). The experiment is `init_trackers`' name unless `MLFLOW_EXPERIMENT_NAME`
/// is set; it is created when missing. `store_init_configuration` logs params (values as Python's
/// `str` writes them; longer than 6000 characters dropped with a warning, as upstream);
/// `log` logs numbers (and booleans as 0/1) as metrics at `step` (0 without one) with the time of
/// the call, and drops other values with a warning, as upstream; `finish` ends the run (FINISHED).
///
/// Training never waits for the server: every request is queued and sent in order by a thread of
/// the tracker (metrics batched, up to 1000 a request). When the server cannot be reached, the
/// tracker warns once, keeps what is not yet sent in `pending_file()` (one JSON request a line),
/// retries with a growing pause, and says when it gets through again; `finish` waits up to
/// `flush_timeout` seconds, then names what is left and where it is kept.
///
/// Example (with `mlflow server --host 127.0.0.1 --port 5000` running):
///   setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000", 1);
///   auto tracker = std::make_shared<accelerate::MLflowTracker>("my_experiment");
///   tracker->log({{"loss", 0.25}}, 1);
///   tracker->finish();
class MLflowTracker : public GeneralTracker {
 public:
  MLflowTracker(const std::string& experiment_name, const std::string& logging_dir = "",
                const MLflowTrackerOptions& options = {});
  ~MLflowTracker() override;
  std::string name() const override { return "mlflow"; }
  bool requires_logging_directory() const override { return false; }
  void store_init_configuration(const nlohmann::json& values) override;
  void log(const nlohmann::json& values, std::optional<int64_t> step) override;
  void finish() override;
  /// The run's id once the server made it (or the one given); empty before.
  std::string run_id() const;
  /// The requests not yet taken by the server.
  size_t pending() const;
  /// The file that holds them while the server cannot be reached.
  const std::string& pending_file() const;

 private:
  class Sender;
  std::unique_ptr<Sender> sender_;
  double flush_timeout_ = 60;
};

/// One element of `AcceleratorOptions::log_with`: the name of a built-in tracker ("tensorboard",
/// "dvclive", "jsonl", "csv", "wandb", "mlflow", or "all" for every one of them) or a tracker of
/// the user's.
///
/// Example:
///   accelerate::Accelerator accelerator({.log_with = {"tensorboard", my_tracker}, .project_dir = "runs"});
struct Tracker {
  Tracker(const char* name) : name_(name) {}             // NOLINT(google-explicit-constructor)
  Tracker(std::string name) : name_(std::move(name)) {}  // NOLINT(google-explicit-constructor)
  Tracker(std::shared_ptr<GeneralTracker> tracker);      // NOLINT(google-explicit-constructor)
  template <typename T, typename = std::enable_if_t<std::is_base_of_v<GeneralTracker, T>>>
  Tracker(std::shared_ptr<T> tracker)  // NOLINT(google-explicit-constructor)
      : Tracker(std::static_pointer_cast<GeneralTracker>(std::move(tracker))) {}

  /// Whether this names a built-in tracker (else it holds a user tracker).
  bool is_name() const { return tracker_ == nullptr; }
  /// The built-in name, or the user tracker's `name()`.
  std::string name() const;
  /// The user tracker (null for a built-in name).
  const std::shared_ptr<GeneralTracker>& tracker() const { return tracker_; }

 private:
  std::string name_;
  std::shared_ptr<GeneralTracker> tracker_;
};

/// The built-in trackers: "tensorboard", "dvclive", "jsonl", "csv", "wandb", "mlflow" (upstream:
/// `get_available_trackers`).
std::vector<std::string> available_trackers();

/// Checks `log_with` and resolves it (upstream: `filter_trackers`): "all" becomes every available
/// tracker, repeated names count once, and a tracker that requires a logging folder needs a
/// non-empty `logging_dir`. Unknown names and trackers that need Python or a remote service are
/// refused, naming the available ones.
std::vector<Tracker> filter_trackers(const std::vector<Tracker>& log_with, const std::string& logging_dir);

/// Creates the built-in tracker `name` for the run `run_name`, with its options from
/// `init_kwargs` (a JSON object of the option fields of that tracker; unknown fields are
/// refused).
std::shared_ptr<GeneralTracker> make_tracker(const std::string& name, const std::string& run_name,
                                             const std::string& logging_dir,
                                             const nlohmann::json& init_kwargs = nlohmann::json::object());

/// Checks that `values` can be logged (see the file comment); `api` starts the error message.
void check_log_values(const nlohmann::json& values, const char* api);

/// CRC-32C (Castagnoli) of `size` bytes, as TFRecord framing uses it.
uint32_t crc32c(const void* data, size_t size);

}  // namespace accelerate
