// Experiment tracking (tracking.h and the Accelerator's init_trackers / log / get_tracker /
// end_training): TensorBoard event files read back by an independent Python reader
// (tests/python/tensorboard_check.py: its own CRC-32C, the protobuf runtime), the exact content
// of the JSONL, CSV and dvclive files, main-process-only writing with two ranks as threads, user
// trackers, and every error a user can cause.
#include "accelerate/tracking.h"

#include "accelerate/accelerator.h"
#include "detail/files.h"
#include "formats/wandb_log.h"
#include "support/accelerators.h"
#include "support/process.h"
#include "support/test_support.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

namespace accelerate::testing {
namespace tracking_test {  // not anonymous: its names must not meet another file's in a unity batch

using ::testing::ElementsAre;
using ::testing::HasSubstr;
namespace fs = std::filesystem;
using json = nlohmann::json;

const char* const kPython = "/usr/bin/python3";

// Sets an environment variable (or removes it, with null) for one test.
class ScopedEnv {
 public:
  ScopedEnv(const char* key, const char* value) : key_(key) {
    if (const char* old = std::getenv(key)) old_ = old;
    if (value != nullptr) {
      ::setenv(key, value, 1);
    } else {
      ::unsetenv(key);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(key_, old_->c_str(), 1);
    } else {
      ::unsetenv(key_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* key_;
  std::optional<std::string> old_;
};

// A one-process accelerator over a state of its own.
Accelerator single(AcceleratorOptions options) {
  options.standalone_state = PartialStateOptions{.process_index = 0, .num_processes = 1};
  return Accelerator(options);
}

std::string read(const fs::path& path) { return detail::read_file(path.string()); }

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

double now() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

// Runs the independent reader on `folder` and returns what it printed.
json read_tensorboard(const fs::path& folder) {
  auto r = run({kPython, built("tests/python/tensorboard_check.py"), folder.string()});
  EXPECT_EQ(r->exit_code(), 0) << r->err;
  if (r->exit_code() != 0) return json::object();
  return json::parse(r->out);
}

// The values of the summary events of one run (the file-version event first, checked).
std::vector<json> summaries(const json& run) {
  std::vector<json> out;
  const auto& events = run.at("events");
  EXPECT_EQ(events.at(0).value("file_version", ""), "brain.Event:2");
  for (size_t i = 1; i < events.size(); ++i) {
    for (const auto& v : events[i].at("values")) {
      json item = v;
      item["step"] = events[i].at("step");
      out.push_back(item);
    }
  }
  return out;
}

// A tracker of the user's that records every call.
class RecordingTracker : public GeneralTracker {
 public:
  explicit RecordingTracker(std::string name, bool main_only = true, bool needs_dir = false)
      : name_(std::move(name)), main_only_(main_only), needs_dir_(needs_dir) {}
  std::string name() const override { return name_; }
  bool requires_logging_directory() const override { return needs_dir_; }
  bool main_process_only() const override { return main_only_; }
  void store_init_configuration(const json& values) override { record("config " + values.dump()); }
  void log(const json& values, std::optional<int64_t> step) override {
    record("log " + values.dump() + " step " + (step ? std::to_string(*step) : "none"));
  }
  void finish() override { record("finish"); }
  std::vector<std::string> calls() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return calls_;
  }

 private:
  void record(const std::string& call) {
    std::lock_guard<std::mutex> lock(mutex_);
    calls_.push_back(call);
  }
  std::string name_;
  bool main_only_, needs_dir_;
  mutable std::mutex mutex_;
  std::vector<std::string> calls_;
};

// ---- CRC-32C ----------------------------------------------------------------------------------

TEST(TrackingCrc32c, MatchesTheCastagnoliCheckValue) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c("", 0), 0u);
  // A known TFRecord value: the CRC-32C of 32 zero bytes (RFC 3720, B.4).
  const std::string zeros(32, '\0');
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
}

// ---- names --------------------------------------------------------------------------------------

TEST(TrackingNames, TheBuiltInTrackersAreAvailable) {
  {
    ScopedEnv no_server("MLFLOW_TRACKING_URI", nullptr);
    EXPECT_THAT(available_trackers(), ElementsAre("tensorboard", "dvclive", "jsonl", "csv", "wandb"));
  }
  // mlflow, as upstream's when its package imports, is available with a server to speak to.
  ScopedEnv server("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000");
  EXPECT_THAT(available_trackers(), ElementsAre("tensorboard", "dvclive", "jsonl", "csv", "wandb", "mlflow"));
}

TEST(TrackingNames, AllExpandsAfterTheUsersTrackersAndRepeatsCountOnce) {
  ScopedEnv no_server("MLFLOW_TRACKING_URI", nullptr);
  auto mine = std::make_shared<RecordingTracker>("mine");
  auto resolved = filter_trackers({"jsonl", "all", mine, "jsonl"}, "logs");
  std::vector<std::string> names;
  for (const auto& t : resolved) names.push_back(t.name());
  EXPECT_THAT(names, ElementsAre("mine", "tensorboard", "dvclive", "jsonl", "csv", "wandb"));
  resolved = filter_trackers({"csv", "jsonl", "csv"}, "logs");
  names.clear();
  for (const auto& t : resolved) names.push_back(t.name());
  EXPECT_THAT(names, ElementsAre("csv", "jsonl"));
}

TEST(TrackingNames, UnknownAndRemoteTrackersAreRefusedNamingTheAvailableOnes) {
  EXPECT_THROWS_WITH(single({.log_with = {"neptune"}, .project_dir = "runs"}),
                     "[Accelerator] log_with: unsupported logging capability 'neptune'; choose between tensorboard, "
                     "dvclive, jsonl, csv, wandb, mlflow, all");
  for (const char* remote : {"comet_ml", "aim", "clearml", "swanlab", "trackio"}) {
    EXPECT_THROWS_WITH(single({.log_with = {remote}, .project_dir = "runs"}),
                       std::string("[Accelerator] log_with: '") + remote +
                           "' needs Python or a remote service and is not available in accelerate-cpp; available "
                           "trackers: tensorboard, dvclive, jsonl, csv, wandb, mlflow, all");
  }
}

// Note [The tracker registry]: every name of upstream's LoggerType is either a built-in tracker
// or refused by name, never taken for another tracker; every built-in is made as the tracker of
// its name, and needs the logging folder exactly when its class says it does.
TEST(TrackingNames, EveryLoggerTypeIsABuiltInOrRefusedByName) {
  TempDir dir;
  ScopedEnv wandb_dir("WANDB_DIR", dir.str().c_str());
  ScopedEnv server("MLFLOW_TRACKING_URI", "http://127.0.0.1:9");  // mlflow is available with a server
  int members = 0;
  for (int i = 0; i < 64; ++i) {
    std::string name;
    try {
      name = to_string(static_cast<LoggerType>(i));
    } catch (const c10::Error&) {
      break;
    }
    ++members;
    if (name == "all") continue;
    const auto available = available_trackers();
    if (std::find(available.begin(), available.end(), name) == available.end()) {
      EXPECT_THROWS_WITH(single({.log_with = {name}, .project_dir = dir.str()}),
                         "' needs Python or a remote service and is not available in accelerate-cpp");
    } else {
      EXPECT_NO_THROW(single({.log_with = {name}, .project_dir = dir.str()})) << name;
    }
  }
  EXPECT_EQ(members, 10);  // upstream's LoggerType
}

TEST(TrackingNames, EveryBuiltInIsMadeAsTheTrackerOfItsName) {
  TempDir dir;
  // mlflow too: a server on a port where none listens (what it logs stays in its pending file).
  ScopedEnv server("MLFLOW_TRACKING_URI", "http://127.0.0.1:9");
  for (const auto& name : available_trackers()) {
    const nlohmann::json kwargs = name == "dvclive" ? json{{"dir", (dir.path() / "dvc").string()}}
                                  : name == "wandb" ? json{{"dir", dir.str()}}
                                  : name == "mlflow" ? json{{"flush_timeout", 0}}
                                                     : json::object();
    auto tracker = make_tracker(name, "run", dir.str(), kwargs);
    ASSERT_NE(tracker, nullptr) << name;
    EXPECT_EQ(tracker->name(), name);
    EXPECT_EQ(tracker->requires_logging_directory(), name != "dvclive" && name != "wandb" && name != "mlflow") << name;
    tracker->log({{"loss", 0.5}}, 1);
    tracker->finish();
  }
}

TEST(TrackingNames, TrackersThatWriteFilesNeedALoggingDir) {
  for (const char* name : {"tensorboard", "jsonl", "csv", "all"}) {
    EXPECT_THROWS_WITH(single({.log_with = {name}}),
                       "requires a logging_dir; set project_dir or "
                       "project_config.logging_dir");
  }
  EXPECT_THROWS_WITH(single({.log_with = {"tensorboard"}}),
                     "[Accelerator] log_with: logging with 'tensorboard' "
                     "requires a logging_dir");
  auto needs_dir = std::make_shared<RecordingTracker>("needs_dir", true, /*needs_dir=*/true);
  EXPECT_THROWS_WITH(single({.log_with = {needs_dir}}), "logging with 'needs_dir' requires a logging_dir");
  // dvclive has a default folder; project_config.logging_dir alone is enough for the others.
  EXPECT_NO_THROW(single({.log_with = {"dvclive"}}));
  TempDir dir;
  EXPECT_NO_THROW(single({.log_with = {"tensorboard"}, .project_config = {.logging_dir = dir.str()}}));
  EXPECT_THROWS_WITH((void)Tracker(std::shared_ptr<GeneralTracker>{}), "[Tracker] expected a tracker, got null");
}

// ---- TensorBoard --------------------------------------------------------------------------------

TEST(TrackingTensorBoard, AnIndependentReaderFindsTheScalarsTextGroupsAndHparamsWeLogged) {
  ASSERT_TRUE(fs::exists(kPython)) << kPython << " is missing; scripts/setup.sh installs python3";
  TempDir dir;
  auto accelerator = single({.log_with = {"tensorboard"}, .project_dir = dir.str()});
  accelerator.init_trackers("proj", {{"lr", 0.001}, {"batch", 32}, {"opt", "adam"}, {"amp", true}, {"none", nullptr}});
  accelerator.log({{"loss", 0.5}, {"note", "hello, world"}}, 1);
  accelerator.log({{"loss", 0.25}, {"acc", {{"train", 0.75}, {"valid", 0.5}}}}, 2);
  accelerator.log({{"zero", 0}});
  accelerator.end_training();

  const json out = read_tensorboard(dir.path() / "proj");
  const auto& runs = out.at("runs");
  ASSERT_EQ(runs.size(), 4u) << out.dump(2);  // the run, two groups, the hparams session

  // File names as SummaryWriter makes them.
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  const std::regex name("events\\.out\\.tfevents\\.[0-9]{10}\\." + std::string(host) + "\\." +
                        std::to_string(::getpid()) + "\\.[0-9]+");
  for (const auto& [folder, run] : runs.items()) {
    EXPECT_TRUE(std::regex_match(run.at("file").get<std::string>(), name)) << run.at("file");
  }

  const auto main = summaries(runs.at("."));
  ASSERT_EQ(main.size(), 4u) << runs.at(".").dump(2);
  EXPECT_EQ(main[0], (json{{"tag", "loss"}, {"simple_value", 0.5}, {"step", 1}}));
  EXPECT_EQ(main[1], (json{{"tag", "note/text_summary"},
                           {"plugin", "text"},
                           {"plugin_content", ""},
                           {"dtype", 7},
                           {"shape", {1}},
                           {"string_val", {"hello, world"}},
                           {"step", 1}}));
  EXPECT_EQ(main[2], (json{{"tag", "loss"}, {"simple_value", 0.25}, {"step", 2}}));
  EXPECT_EQ(main[3], (json{{"tag", "zero"}, {"simple_value", 0.0}, {"step", 0}}));

  // add_scalars: one run per member, tagged with the group's name.
  EXPECT_EQ(summaries(runs.at("acc_train")),
            (std::vector<json>{{{"tag", "acc"}, {"simple_value", 0.75}, {"step", 2}}}));
  EXPECT_EQ(summaries(runs.at("acc_valid")), (std::vector<json>{{{"tag", "acc"}, {"simple_value", 0.5}, {"step", 2}}}));

  // add_hparams(config, metric_dict={}): experiment, session start, session end.
  std::string session;
  for (const auto& [folder, run] : runs.items()) {
    if (folder != "." && folder.rfind("acc_", 0) != 0) session = folder;
  }
  ASSERT_FALSE(session.empty());
  const auto hparams = summaries(runs.at(session));
  ASSERT_EQ(hparams.size(), 3u);
  EXPECT_EQ(hparams[0].at("tag"), "_hparams_/experiment");
  EXPECT_EQ(hparams[0].at("plugin"), "hparams");
  EXPECT_EQ(hparams[0].at("hparams"), json::parse(R"({"experiment": {"hparam_infos": [
      {"name": "amp", "type": "DATA_TYPE_FLOAT64"}, {"name": "batch", "type": "DATA_TYPE_FLOAT64"},
      {"name": "lr", "type": "DATA_TYPE_FLOAT64"}, {"name": "opt", "type": "DATA_TYPE_STRING"}]}})"));
  EXPECT_EQ(hparams[1].at("tag"), "_hparams_/session_start_info");
  EXPECT_EQ(
      hparams[1].at("hparams"),
      json::parse(R"({"session_start_info": {"hparams": {"amp": 1.0, "batch": 32.0, "lr": 0.001, "opt": "adam"}}})"));
  EXPECT_EQ(hparams[2].at("tag"), "_hparams_/session_end_info");
  EXPECT_EQ(hparams[2].at("hparams"), json::parse(R"({"session_end_info": {"status": "STATUS_SUCCESS"}})"));
  EXPECT_EQ(read(dir.path() / "proj" / session / "hparams.yml"),
            "amp: true\nbatch: 32\nlr: 0.001\nnone: null\nopt: adam\n");
}

TEST(TrackingTensorBoard, TheReaderFailsOnACorruptedRecord) {
  ASSERT_TRUE(fs::exists(kPython)) << kPython << " is missing; scripts/setup.sh installs python3";
  TempDir dir;
  TensorBoardTracker tracker("run", dir.str());
  tracker.log({{"loss", 0.5}}, 3);
  tracker.finish();
  fs::path file;
  for (const auto& entry : fs::directory_iterator(dir.path() / "run")) file = entry.path();
  std::string bytes = read(file);
  bytes[bytes.size() - 6] ^= 0x01;  // inside the float of the last record
  detail::write_file(file.string(), bytes);
  auto r = run({kPython, built("tests/python/tensorboard_check.py"), (dir.path() / "run").string()});
  EXPECT_EQ(r->exit_code(), 1);
  EXPECT_THAT(r->err, HasSubstr("data CRC mismatch"));
}

TEST(TrackingTensorBoard, ImagesArePngGridsAsAddImagesMakesThem) {
  ASSERT_TRUE(fs::exists(kPython)) << kPython << " is missing; scripts/setup.sh installs python3";
  TempDir dir;
  TensorBoardTracker tracker("run", dir.str());
  // Two grey 2x2 images side by side; 0.5 * 255 truncates to 127, as numpy's astype does.
  const at::Tensor batch = at::tensor({0.0, 1.0, 0.5, 2.0, 1.0, 0.0, -1.0, 0.25}).view({2, 1, 2, 2});
  const at::Tensor rgba = at::tensor({1, 2, 3, 4}, at::kByte).view({4, 1, 1});
  tracker.log_images({{"grey", batch}, {"rgba", rgba}}, 7);
  tracker.finish();
  const auto values = summaries(read_tensorboard(dir.path() / "run").at("runs").at("."));
  ASSERT_EQ(values.size(), 2u);
  EXPECT_EQ(values[0].at("tag"), "grey");
  EXPECT_EQ(values[0].at("step"), 7);
  const auto& grey = values[0].at("image");
  EXPECT_EQ(grey.at("height"), 2);
  EXPECT_EQ(grey.at("width"), 4);
  EXPECT_EQ(grey.at("colorspace"), 3);
  // Row 0: image 0 (0, 255), image 1 (255, 0); row 1: (127, 255), (0, 63); each grey value as RGB.
  std::vector<int> expected;
  for (int v : {0, 255, 255, 0, 127, 255, 0, 63}) expected.insert(expected.end(), {v, v, v});
  EXPECT_EQ(grey.at("png").at("pixels").get<std::vector<int>>(), expected);
  const auto& color = values[1].at("image");
  EXPECT_EQ(color.at("colorspace"), 4);
  EXPECT_EQ(color.at("png").at("pixels").get<std::vector<int>>(), (std::vector<int>{1, 2, 3, 4}));

  TensorBoardTracker other("other", dir.str());
  EXPECT_THROWS_WITH(other.log_images({{"bad", at::zeros({2, 2, 2})}}, 0),
                     "[TensorBoardTracker.log_images] 'bad': expected 1, 3 or 4 channels, got 2");
  EXPECT_THROWS_WITH(other.log_images({{"bad", at::zeros({4})}}, 0), "expected a [C, H, W] or [N, C, H, W] tensor");
  EXPECT_THROWS_WITH(other.log_images({{"bad", at::zeros({1, 2, 2}, at::kInt)}}, 0),
                     "expected floating values in [0, 1] or uint8");
  EXPECT_THROWS_WITH(other.log_images({{"none", at::Tensor()}}, 0),
                     "[TensorBoardTracker.log_images] 'none': expected a tensor, got an undefined one");
  EXPECT_THROWS_WITH(other.log_images({{"empty", at::zeros({0, 3, 2, 2})}}, 0),
                     "[TensorBoardTracker.log_images] 'empty': the image is empty");
  EXPECT_THROWS_WITH(other.log_images({{"flat", at::zeros({3, 0, 2})}}, 0), "'flat': the image is empty");
}

TEST(TrackingTrackers, AnEmptyLoggingDirIsRefusedByEveryTrackerThatWritesFiles) {
  EXPECT_THROWS_WITH(TensorBoardTracker("run", ""), "[TensorBoardTracker] requires a logging_dir, got an empty one");
  EXPECT_THROWS_WITH(JSONLTracker("run", ""), "[JSONLTracker] requires a logging_dir, got an empty one");
  EXPECT_THROWS_WITH(CSVTracker("run", ""), "[CSVTracker] requires a logging_dir, got an empty one");
}

TEST(TrackingTensorBoard, OptionsComeFromInitKwargs) {
  TempDir dir;
  auto accelerator = single({.log_with = {"tensorboard"}, .project_dir = dir.str()});
  accelerator.init_trackers("proj", json::object(),
                            {{"tensorboard", {{"filename_suffix", ".v2"}, {"flush_secs", 60}}}});
  auto tracker = std::dynamic_pointer_cast<TensorBoardTracker>(accelerator.get_tracker("tensorboard"));
  ASSERT_NE(tracker, nullptr);
  EXPECT_EQ(tracker->logging_dir(), (dir.path() / "proj").string());
  accelerator.end_training();
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir.path() / "proj")) names.push_back(entry.path().filename());
  ASSERT_EQ(names.size(), 1u);
  EXPECT_THAT(names[0], ::testing::EndsWith(".v2"));
}

// ---- JSONL, CSV, dvclive --------------------------------------------------------------------------

TEST(TrackingJSONL, EachLogCallIsOneLineWithStepWallTimeAndTheValues) {
  TempDir dir;
  auto accelerator = single({.log_with = {"jsonl"}, .project_dir = dir.str()});
  accelerator.init_trackers("proj", {{"lr", 0.01}, {"layers", {1, 2}}});
  const double before = now();
  accelerator.log({{"loss", 0.5}, {"note", "a\nb"}}, 1);
  accelerator.log({{"acc", {{"train", 0.75}}}});
  const double after = now();
  accelerator.end_training();
  const auto lines = lines_of(read(dir.path() / "proj" / "log.jsonl"));
  ASSERT_EQ(lines.size(), 2u);
  const json first = json::parse(lines[0]), second = json::parse(lines[1]);
  EXPECT_EQ(first.at("step"), 1);
  EXPECT_EQ(first.at("values"), (json{{"loss", 0.5}, {"note", "a\nb"}}));
  EXPECT_TRUE(second.at("step").is_null());
  EXPECT_EQ(second.at("values"), (json{{"acc", {{"train", 0.75}}}}));
  for (const auto& line : {first, second}) {
    EXPECT_GE(line.at("wall_time").get<double>(), before - 1);
    EXPECT_LE(line.at("wall_time").get<double>(), after + 1);
  }
  EXPECT_THAT(lines[0], ::testing::StartsWith(R"({"step":1,"wall_time":)"));
  EXPECT_EQ(json::parse(read(dir.path() / "proj" / "config.json")), (json{{"lr", 0.01}, {"layers", {1, 2}}}));
}

// The CSV text with every wall_time field replaced by "T".
std::string without_wall_times(const std::string& text) {
  std::string out;
  for (const auto& line : lines_of(text)) {
    const auto first = line.find(',');
    const auto second = line.find(',', first + 1);
    out += line.substr(0, first) + (line.rfind("step,", 0) == 0 ? line.substr(first, second - first) : ",T") +
           line.substr(second) + "\n";
  }
  return out;
}

TEST(TrackingCSV, NewKeysRewriteTheFileWithAnExtendedHeader) {
  TempDir dir;
  auto accelerator = single({.log_with = {"csv"}, .project_dir = dir.str()});
  accelerator.init_trackers("proj", {{"lr", 0.01}});
  accelerator.log({{"loss", 0.5}}, 1);
  accelerator.log({{"loss", 0.25}, {"acc", {{"train", 0.75}}}, {"note", "a,\"b\""}}, 2);
  accelerator.log({{"loss", 0.125}});
  accelerator.end_training();
  const auto path = dir.path() / "proj" / "log.csv";
  EXPECT_EQ(without_wall_times(read(path)),
            "step,wall_time,loss,acc/train,note\n"
            "1,T,0.5,,\n"
            "2,T,0.25,0.75,\"a,\"\"b\"\"\"\n"
            ",T,0.125,,\n");
  EXPECT_EQ(json::parse(read(dir.path() / "proj" / "config.json")), (json{{"lr", 0.01}}));

  // A run continuing in the same folder keeps the columns and appends.
  CSVTracker again("proj", dir.str());
  again.log({{"note", "x"}}, 4);
  again.finish();
  EXPECT_EQ(without_wall_times(read(path)),
            "step,wall_time,loss,acc/train,note\n"
            "1,T,0.5,,\n"
            "2,T,0.25,0.75,\"a,\"\"b\"\"\"\n"
            ",T,0.125,,\n"
            "4,T,,,x\n");
  // Nothing is left behind by the rewrites.
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir.path() / "proj")) names.push_back(entry.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_THAT(names, ElementsAre("config.json", "log.csv"));
}

TEST(TrackingCSV, AFileThatIsNotOurLogIsRefused) {
  TempDir dir;
  fs::create_directories(dir.path() / "proj");
  detail::write_file((dir.path() / "proj" / "log.csv").string(), "a,b\n1,2\n");
  EXPECT_THROWS_WITH(CSVTracker("proj", dir.str()), "exists and is not a log of this tracker");
}

TEST(TrackingDVCLive, TheFilesFollowDvclivesLayout) {
  TempDir dir;
  auto accelerator = single({.log_with = {"dvclive"}, .project_dir = dir.str()});
  accelerator.init_trackers("proj", {{"lr", 0.01}, {"optimizer", {{"name", "adam"}, {"betas", {0.9, 0.999}}}}});
  accelerator.log({{"loss", 0.5}, {"train", {{"acc", 0.75}}}}, 3);
  accelerator.log({{"loss", 0.25}, {"note", "ok"}});
  accelerator.end_training();
  const auto root = dir.path() / "proj";
  EXPECT_EQ(read(root / "params.yaml"), "lr: 0.01\noptimizer:\n  betas:\n    - 0.9\n    - 0.999\n  name: adam\n");
  EXPECT_EQ(read(root / "plots" / "metrics" / "loss.tsv"), "step\tloss\n3\t0.5\n4\t0.25\n");
  EXPECT_EQ(read(root / "plots" / "metrics" / "train" / "acc.tsv"), "step\tacc\n3\t0.75\n");
  EXPECT_EQ(read(root / "plots" / "metrics" / "note.tsv"), "step\tnote\n4\tok\n");
  EXPECT_EQ(json::parse(read(root / "metrics.json")),
            (json{{"loss", 0.25}, {"train", {{"acc", 0.75}}}, {"note", "ok"}, {"step", 4}}));
}

TEST(TrackingDVCLive, NonFiniteNumbersAndBooleansAreWrittenAsPythonWritesThem) {
  TempDir dir;
  auto accelerator = single({.log_with = {"dvclive", "csv", "jsonl"}, .project_dir = dir.str()});
  accelerator.init_trackers("proj");
  const double inf = std::numeric_limits<double>::infinity();
  accelerator.log({{"a", std::nan("")}, {"b", -inf}, {"c", true}}, 0);
  accelerator.end_training();
  const auto root = dir.path() / "proj";
  EXPECT_EQ(read(root / "plots" / "metrics" / "a.tsv"), "step\ta\n0\tnan\n");
  EXPECT_EQ(read(root / "plots" / "metrics" / "b.tsv"), "step\tb\n0\t-inf\n");
  EXPECT_EQ(read(root / "plots" / "metrics" / "c.tsv"), "step\tc\n0\tTrue\n");
  EXPECT_EQ(json::parse(read(root / "metrics.json")), (json{{"a", "nan"}, {"b", "-inf"}, {"c", true}, {"step", 0}}));
  EXPECT_EQ(without_wall_times(read(root / "log.csv")), "step,wall_time,a,b,c\n0,T,nan,-inf,true\n");
  EXPECT_EQ(json::parse(read(root / "log.jsonl")).at("values"), (json{{"a", nullptr}, {"b", nullptr}, {"c", true}}));
}

TEST(TrackingDVCLive, MetricNamesThatLeaveTheFolderAreRefused) {
  TempDir dir;
  DVCLiveTracker tracker("proj", dir.str());
  for (const char* key : {"../up", "/abs", "a/./b", "x/"}) {
    EXPECT_THROWS_WITH(tracker.log({{key, 1}}, 0), "[DVCLiveTracker.log] '" + std::string(key) +
                                                       "': metric names become file paths under " + tracker.dir() +
                                                       "/plots/metrics");
  }
  EXPECT_THROWS_WITH(tracker.log({{"acc", {{"", 1}}}}, 0), "'acc/': metric names become file paths");
  EXPECT_FALSE(fs::exists(dir.path() / "proj" / "metrics.json"));  // nothing of a refused call is written
  EXPECT_FALSE(fs::exists(dir.path() / "up.tsv"));
}

TEST(TrackingDVCLive, TheFolderComesFromInitKwargs) {
  TempDir dir;
  auto accelerator = single({.log_with = {"dvclive"}, .project_dir = dir.str()});
  const auto custom = (dir.path() / "custom").string();
  // Upstream's test: two logs without a step, then step 3.
  accelerator.init_trackers("proj", json::object(),
                            {{"dvclive", {{"dir", custom}, {"save_dvc_exp", false}, {"dvcyaml", nullptr}}}});
  accelerator.log({{"loss", 1}});
  accelerator.log({{"loss", 2}});
  accelerator.log({{"loss", 3}}, 3);
  accelerator.end_training();
  EXPECT_EQ(read(fs::path(custom) / "plots" / "metrics" / "loss.tsv"), "step\tloss\n0\t1\n1\t2\n3\t3\n");
  EXPECT_EQ(json::parse(read(fs::path(custom) / "metrics.json")), (json{{"loss", 3}, {"step", 3}}));
  EXPECT_THROWS_WITH(accelerator.init_trackers("proj", json::object(), {{"dvclive", {{"save_dvc_exp", true}}}}),
                     "[Accelerator.init_trackers] init_kwargs['dvclive']['save_dvc_exp']: only false is supported "
                     "(no DVC experiment is saved), got true");
  EXPECT_THROWS_WITH(accelerator.init_trackers("proj", json::object(), {{"dvclive", {{"dvcyaml", "dvc.yaml"}}}}),
                     "init_kwargs['dvclive']['dvcyaml']: only null or false is supported");
  EXPECT_FALSE(fs::exists(dir.path() / "proj"));
  // Without a logging folder, dvclive's default folder in the working directory.
  const bool existed = fs::exists("dvclive");
  EXPECT_EQ(DVCLiveTracker("proj", "").dir(), "dvclive");
  if (!existed) fs::remove_all("dvclive");
}

// ---- the Accelerator ------------------------------------------------------------------------------

TEST(TrackingAccelerator, AUserTrackerReceivesTheConfigTheLogsAndFinish) {
  auto mine = std::make_shared<RecordingTracker>("mine");
  auto accelerator = single({.log_with = {mine}});
  accelerator.init_trackers("proj", {{"lr", 0.5}});
  accelerator.log({{"loss", 1.5}}, 4);
  accelerator.log({{"text", "hi"}});
  EXPECT_EQ(accelerator.get_tracker("mine"), mine);
  ASSERT_EQ(accelerator.trackers().size(), 1u);
  EXPECT_EQ(accelerator.trackers()[0], mine);
  accelerator.end_training();
  EXPECT_THAT(mine->calls(), ElementsAre("config {\"lr\":0.5}", "log {\"loss\":1.5} step 4",
                                         "log {\"text\":\"hi\"} step none", "finish"));
  EXPECT_THROWS_WITH(mine->log_images({}, 0), "[GeneralTracker.log_images] the tracker 'mine' does not log images");
}

TEST(TrackingAccelerator, OnlyTheMainProcessWritesWithTwoRanks) {
  TempDir dir;
  auto everywhere = std::make_shared<RecordingTracker>("everywhere", /*main_only=*/false);
  std::vector<std::shared_ptr<RecordingTracker>> main_only = {std::make_shared<RecordingTracker>("main_only"),
                                                              std::make_shared<RecordingTracker>("main_only")};
  std::vector<std::string> kinds(2);
  std::mutex mutex;
  Store store = Store::in_memory();
  ScopedEnv wandb_dir("WANDB_DIR", dir.str().c_str());
  ScopedEnv no_server("MLFLOW_TRACKING_URI", nullptr);
  run_threads(2, [&](int rank) {
    AcceleratorOptions options{.log_with = {"all", everywhere, main_only[rank]}, .project_dir = dir.str()};
    options.standalone_state = rank_options(PartialStateOptions{}, rank, 2, store);
    Accelerator accelerator(options);
    accelerator.init_trackers("proj", {{"lr", 0.5}});
    for (int step = 0; step < 3; ++step) accelerator.log({{"loss", 1.0 / (step + 1)}}, step);
    const bool real = std::dynamic_pointer_cast<TensorBoardTracker>(accelerator.get_tracker("tensorboard")) != nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex);
      kinds[rank] = std::string(real ? "real" : "blank") + " " + std::to_string(accelerator.trackers().size());
    }
    // A process that does not run a tracker holds one of the same name that does nothing.
    EXPECT_EQ(accelerator.get_tracker("jsonl")->name(), "jsonl");
    accelerator.get_tracker("jsonl")->log({{"direct", 1}}, 9);
    accelerator.end_training();
  });
  EXPECT_THAT(kinds, ElementsAre("real 7", "blank 7"));
  size_t wandb_runs = 0;
  for (const auto& entry : fs::directory_iterator(dir.path() / "wandb")) {
    wandb_runs += entry.path().filename().string().rfind("offline-run-", 0) == 0;
  }
  EXPECT_EQ(wandb_runs, 1u);
  EXPECT_EQ(lines_of(read(dir.path() / "proj" / "log.jsonl")).size(), 4u);  // three logs and one direct call
  EXPECT_EQ(lines_of(read(dir.path() / "proj" / "log.csv")).size(), 4u);
  EXPECT_EQ(read(dir.path() / "proj" / "plots" / "metrics" / "loss.tsv"),
            "step\tloss\n0\t1.0\n1\t0.5\n2\t0.3333333333333333\n");
  size_t event_files = 0;
  for (const auto& entry : fs::directory_iterator(dir.path() / "proj")) {
    event_files += entry.path().filename().string().rfind("events.out.tfevents.", 0) == 0;
  }
  EXPECT_EQ(event_files, 1u);
  // The main process's user tracker gets every call; the other one's none. A tracker that runs
  // everywhere is configured and finished on both, and logs on the main process only (upstream's
  // `log` runs on the main process).
  EXPECT_EQ(main_only[0]->calls().size(), 5u);
  EXPECT_TRUE(main_only[1]->calls().empty());
  const auto calls = everywhere->calls();
  EXPECT_EQ(std::count(calls.begin(), calls.end(), "config {\"lr\":0.5}"), 2);
  EXPECT_EQ(std::count(calls.begin(), calls.end(), "finish"), 2);
  EXPECT_EQ(std::count_if(calls.begin(), calls.end(), [](const std::string& c) { return c.rfind("log ", 0) == 0; }), 3);
}

TEST(TrackingAccelerator, EndTrainingClosesTheFiles) {
  TempDir dir;
  auto accelerator = single({.log_with = {"tensorboard", "jsonl", "csv"}, .project_dir = dir.str()});
  accelerator.init_trackers("proj");
  accelerator.log({{"loss", 0.5}}, 1);
  accelerator.end_training();
  EXPECT_THROWS_WITH(accelerator.log({{"loss", 0.5}}, 2), "[TensorBoardTracker] the tracker is finished");
  EXPECT_THROWS_WITH(accelerator.get_tracker("jsonl")->log({{"loss", 0.5}}, 2),
                     "[JSONLTracker.log] the tracker is "
                     "finished");
  EXPECT_THROWS_WITH(accelerator.get_tracker("csv")->log({{"loss", 0.5}}, 2),
                     "[CSVTracker.log] the tracker is "
                     "finished");
  EXPECT_EQ(lines_of(read(dir.path() / "proj" / "log.jsonl")).size(), 1u);
  // After end_training a new run can start.
  accelerator.init_trackers("second");
  accelerator.log({{"loss", 0.25}}, 1);
  accelerator.end_training();
  EXPECT_EQ(lines_of(read(dir.path() / "second" / "log.jsonl")).size(), 1u);
}

TEST(TrackingAccelerator, GetTrackerWithoutTrackersGivesOneThatDoesNothing) {
  auto accelerator = single({});
  auto blank = accelerator.get_tracker("tensorboard");
  ASSERT_NE(blank, nullptr);
  EXPECT_EQ(blank->name(), "tensorboard");
  EXPECT_NO_THROW(blank->log({{"loss", 1}}, 0));
  EXPECT_NO_THROW(accelerator.init_trackers("proj", {{"lr", 1}}));
  EXPECT_NO_THROW(accelerator.log({{"loss", 1}}, 0));
  EXPECT_TRUE(accelerator.trackers().empty());
  EXPECT_NO_THROW(accelerator.end_training());
}

TEST(TrackingAccelerator, ArgumentMistakesAreRefusedNamingWhatIsWrong) {
  TempDir dir;
  auto mine = std::make_shared<RecordingTracker>("mine");
  auto accelerator = single({.log_with = {"tensorboard", "jsonl", mine}, .project_dir = dir.str()});
  const char* init = "[Accelerator.init_trackers]";
  EXPECT_THROWS_WITH(accelerator.init_trackers("p", json::object(), {{"wandb", json::object()}}),
                     std::string(init) +
                         " init_kwargs: no tracker named 'wandb' in log_with (tensorboard, jsonl, "
                         "mine)");
  EXPECT_THROWS_WITH(accelerator.init_trackers("p", json::object(), {{"tensorboard", {{"log_dir", "x"}}}}),
                     std::string(init) +
                         " init_kwargs['tensorboard']: unknown option 'log_dir'; tensorboard accepts "
                         "filename_suffix, flush_secs, max_queue");
  EXPECT_THROWS_WITH(accelerator.init_trackers("p", json::object(), {{"jsonl", {{"filename", 3}}}}),
                     "init_kwargs['jsonl']['filename']: expected a string, got 3");
  EXPECT_THROWS_WITH(accelerator.init_trackers("p", json::object(), {{"jsonl", {{"filename", "a/b"}}}}),
                     "init_kwargs['jsonl']['filename']: expected a file name without folders, got 'a/b'");
  EXPECT_THROWS_WITH(accelerator.init_trackers("p", json::object(), {{"jsonl", 1}}),
                     "init_kwargs['jsonl']: expected a JSON object of options, got 1");
  EXPECT_THROWS_WITH(accelerator.init_trackers("p", json::object(), {{"mine", json::object()}}),
                     "init_kwargs['mine']: 'mine' is a tracker you constructed; pass its options to its constructor");
  EXPECT_THROWS_WITH(accelerator.init_trackers("p", json::object(), json::array({1})),
                     std::string(init) + " init_kwargs: expected a JSON object keyed by tracker name, got array");
  EXPECT_THROWS_WITH(accelerator.init_trackers("p", json::array()), std::string(init) +
                                                                        " config: expected a JSON "
                                                                        "object, got array");
  EXPECT_THROWS_WITH(accelerator.init_trackers("p", {{"layers", {1, 2}}}),
                     std::string(init) +
                         " 'layers': TensorBoard hyperparameters are numbers, booleans, strings or "
                         "null, got array ([1,2])");
  EXPECT_TRUE(accelerator.trackers().empty());  // nothing was started by the refused calls
  EXPECT_TRUE(mine->calls().empty());

  accelerator.init_trackers("p");
  EXPECT_THROWS_WITH(accelerator.init_trackers("p"), std::string(init) +
                                                         " the trackers are already running; call "
                                                         "end_training() before starting new runs");
  const char* log = "[Accelerator.log]";
  EXPECT_THROWS_WITH(accelerator.log({{"x", {1, 2}}}), std::string(log) +
                                                           " 'x': expected a number, a string or an "
                                                           "object of numbers, got array ([1,2])");
  EXPECT_THROWS_WITH(accelerator.log({{"x", nullptr}}),
                     "'x': expected a number, a string or an object of numbers, "
                     "got null");
  EXPECT_THROWS_WITH(accelerator.log({{"acc", {{"train", "high"}}}}),
                     std::string(log) + " 'acc/train': a group of scalars holds numbers, got string (\"high\")");
  EXPECT_THROWS_WITH(accelerator.log(json::array({1})), std::string(log) +
                                                            " expected a JSON object of values, got "
                                                            "array");
  EXPECT_THROWS_WITH(accelerator.log({{"loss", 1}}, 0, {{"tensorboard", {{"walltime", 1}}}}),
                     std::string(log) + " log_kwargs['tensorboard']: the trackers take no log options");
  EXPECT_THROWS_WITH(accelerator.log({{"loss", 1}}, 0, json::array({1})),
                     std::string(log) + " log_kwargs: expected a JSON object keyed by tracker name, got array");
  EXPECT_THROWS_WITH(accelerator.log({{"loss", 1}}, 0, {{"csv", json::object()}}),
                     std::string(log) + " log_kwargs: no tracker named 'csv' in log_with (tensorboard, jsonl, mine)");
  EXPECT_NO_THROW(accelerator.log({{"loss", 1}}, 0, {{"jsonl", json::object()}}));
  EXPECT_THROWS_WITH(accelerator.get_tracker("csv"),
                     "[Accelerator.get_tracker] 'csv' is not an available tracker "
                     "stored inside the Accelerator (trackers: tensorboard, jsonl, "
                     "mine)");
  accelerator.end_training();
  // A refused log reached no tracker.
  EXPECT_EQ(lines_of(read(dir.path() / "p" / "log.jsonl")).size(), 1u);
}

TEST(TrackingAccelerator, AnUnwritableFolderIsRefusedNamingIt) {
  TempDir dir;
  detail::write_file((dir.path() / "file").string(), "x");
  const auto below_a_file = (dir.path() / "file" / "logs").string();
  for (const char* name : {"tensorboard", "jsonl", "csv", "dvclive"}) {
    auto accelerator = single({.log_with = {name}, .project_dir = below_a_file});
    EXPECT_THROWS_WITH(accelerator.init_trackers("proj"), "cannot create the folder " + below_a_file + "/proj");
  }
  // A log file that cannot be opened (a folder of that name is in the way).
  fs::create_directories(dir.path() / "ok" / "proj" / "log.jsonl");
  auto accelerator = single({.log_with = {"jsonl"}, .project_dir = (dir.path() / "ok").string()});
  EXPECT_THROWS_WITH(accelerator.init_trackers("proj"),
                     "[JSONLTracker] cannot open " + (dir.path() / "ok" / "proj" / "log.jsonl").string());
}

TEST(TrackingAccelerator, EveryTrackerIsFinishedEvenWhenOneFails) {
  class FailingTracker : public RecordingTracker {
   public:
    FailingTracker() : RecordingTracker("failing") {}
    void finish() override { throw std::runtime_error("disk full"); }
  };
  auto failing = std::make_shared<FailingTracker>();
  auto after = std::make_shared<RecordingTracker>("after");
  auto accelerator = single({.log_with = {failing, after}});
  accelerator.init_trackers("proj");
  EXPECT_THROWS_WITH(accelerator.end_training(), "disk full");
  EXPECT_THAT(after->calls(), ElementsAre("finish"));
}

// ---- W&B ----------------------------------------------------------------------------------------
// What a run file holds is read back by W&B's own reader in tests/packages/trackers_check.py; here
// the framing's rules and the refusals.

// zlib's CRC-32 of `bytes`, computed by Python's zlib (an independent implementation).
uint32_t python_crc32(const std::string& bytes) {
  TempDir dir;
  const auto file = dir.path() / "bytes";
  std::ofstream(file, std::ios::binary) << bytes;
  auto r = run({kPython, "-c", "import sys, zlib; print(zlib.crc32(open(sys.argv[1], 'rb').read()))", file.string()});
  EXPECT_EQ(r->exit_code(), 0) << r->err;
  return static_cast<uint32_t>(std::stoul(r->out));
}

struct Chunk {
  uint32_t crc;
  size_t length;
  int type;
  std::string data;
};

// The chunks of a framed record, read with the format's rules: padding (a block's last < 7 bytes)
// skipped, then a 7-byte header (crc, length, type) and the data.
std::vector<Chunk> chunks_of(const std::string& framed, uint64_t offset) {
  std::vector<Chunk> out;
  size_t at = 0;
  while (at < framed.size()) {
    const uint64_t room = 32768 - (offset + at) % 32768;
    if (room < 7) {
      EXPECT_EQ(framed.substr(at, room), std::string(room, '\0'));
      at += room;
      continue;
    }
    const auto byte = [&](size_t i) { return static_cast<uint32_t>(static_cast<unsigned char>(framed[at + i])); };
    Chunk c{byte(0) | byte(1) << 8 | byte(2) << 16 | byte(3) << 24, byte(4) | byte(5) << 8,
            static_cast<int>(byte(6)), ""};
    c.data = framed.substr(at + 7, c.length);
    EXPECT_LE(7 + c.length, room) << "a chunk crosses a block boundary";
    at += 7 + c.length;
    out.push_back(c);
  }
  return out;
}

TEST(TrackingWandB, RecordsAreFramedAsWandbsLevelDbLogAcrossBlocks) {
  ASSERT_TRUE(fs::exists(kPython)) << kPython << " is missing; scripts/setup.sh installs python3";
  namespace wandb_log = detail::wandb_log;
  EXPECT_EQ(wandb_log::file_header(), std::string(":W&B\xe1\xbe\x00", 7));
  // A small record: one FULL chunk, its checksum zlib's CRC-32 of the type byte and the data.
  const std::string small = "a record";
  auto chunks = chunks_of(wandb_log::frame(small, 7), 7);
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_EQ(chunks[0].type, 1);
  EXPECT_EQ(chunks[0].data, small);
  EXPECT_EQ(chunks[0].crc, python_crc32(std::string(1, '\x01') + small));
  // 70 000 bytes from just after the header: FIRST fills the block, MIDDLE a whole one, LAST the rest.
  std::string big(70000, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 7 % 251);
  chunks = chunks_of(wandb_log::frame(big, 7), 7);
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_EQ(chunks[0].type, 2);
  EXPECT_EQ(chunks[1].type, 3);
  EXPECT_EQ(chunks[2].type, 4);
  EXPECT_EQ(chunks[0].length, 32768u - 7 - 7);
  EXPECT_EQ(chunks[1].length, 32768u - 7);
  EXPECT_EQ(chunks[0].data + chunks[1].data + chunks[2].data, big);
  EXPECT_EQ(chunks[2].crc, python_crc32(std::string(1, '\x04') + chunks[2].data));
  // Less room than a chunk header at the end of a block: zeros, then the record in the next block.
  const std::string padded = wandb_log::frame(small, 32768 - 5);
  EXPECT_EQ(padded.substr(0, 5), std::string(5, '\0'));
  chunks = chunks_of(padded, 32768 - 5);
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_EQ(chunks[0].data, small);
}

TEST(TrackingWandB, OnlineModeAndBadOptionsAreRefusedNamingTheFix) {
  TempDir dir;
  ScopedEnv no_mode("WANDB_MODE", nullptr);
  EXPECT_THROWS_WITH(WandBTracker("p", {.dir = dir.str(), .mode = "online"}),
                     "[WandBTracker] mode 'online': accelerate-cpp writes W&B runs in offline mode only");
  EXPECT_THROWS_WITH(WandBTracker("p", {.dir = dir.str(), .mode = "online"}),
                     "upload the run afterwards with `wandb sync <dir>/wandb/offline-run-*`");
  {
    ScopedEnv online("WANDB_MODE", "online");
    EXPECT_THROWS_WITH(WandBTracker("p", {.dir = dir.str()}), "mode 'online'");
  }
  EXPECT_THROWS_WITH(WandBTracker("p", {.dir = dir.str(), .mode = "sometimes"}),
                     "mode 'sometimes': expected offline, dryrun or disabled");
  EXPECT_THROWS_WITH(WandBTracker("p", {.dir = dir.str(), .id = "a/b"}),
                     "run id 'a/b': W&B run ids are letters, digits, '_' and '-'");
  auto accelerator = single({.log_with = {"wandb"}, .project_dir = dir.str()});
  EXPECT_THROWS_WITH(accelerator.init_trackers("p", json::object(), {{"wandb", {{"resume", "allow"}}}}),
                     "init_kwargs['wandb']: unknown option 'resume'; wandb accepts name, notes, tags");
  EXPECT_THROWS_WITH(accelerator.init_trackers("p", json::object(), {{"wandb", {{"tags", "a,b"}}}}),
                     "init_kwargs['wandb']['tags']: expected a list of strings, got \"a,b\"");
  EXPECT_THROWS_WITH(accelerator.init_trackers("p", json::object(), {{"wandb", {{"name", 3}}}}),
                     "init_kwargs['wandb']['name']: expected a string, got 3");
  EXPECT_FALSE(fs::exists(dir.path() / "wandb"));  // nothing was made by a refused call
}

TEST(TrackingWandB, TheRunGoesToItsFolderAndDisabledModeWritesNothing) {
  TempDir dir;
  ScopedEnv no_mode("WANDB_MODE", nullptr);
  {
    ScopedEnv wandb_dir("WANDB_DIR", dir.str().c_str());
    ScopedEnv id("WANDB_RUN_ID", "fixed-id_1");
    WandBTracker tracker("p");
    EXPECT_EQ(tracker.run_id(), "fixed-id_1");
    EXPECT_TRUE(std::regex_match(tracker.run_dir(),
                                 std::regex(std::regex_replace(dir.str(), std::regex("[.^$|()\\[\\]{}*+?\\\\]"), "\\$&") +
                                            "/wandb/offline-run-[0-9]{8}_[0-9]{6}-fixed-id_1")))
        << tracker.run_dir();
    tracker.log({{"loss", 1.0}}, 0);
    tracker.finish();
    const auto file = fs::path(tracker.run_dir()) / "run-fixed-id_1.wandb";
    ASSERT_TRUE(fs::exists(file));
    EXPECT_EQ(read(file).substr(0, 7), std::string(":W&B\xe1\xbe\x00", 7));
    EXPECT_EQ(fs::read_symlink(dir.path() / "wandb" / "latest-run"), fs::path(tracker.run_dir()).filename());
    EXPECT_THROWS_WITH(tracker.log({{"loss", 1.0}}, 1), "[WandBTracker.log] the run has finished");
  }
  TempDir other;
  WandBTracker disabled("p", {.dir = other.str(), .mode = "disabled"});
  disabled.log({{"loss", 1.0}}, 0);
  disabled.finish();
  EXPECT_TRUE(disabled.run_dir().empty());
  EXPECT_FALSE(fs::exists(other.path() / "wandb"));
}

// ---- MLflow -------------------------------------------------------------------------------------
// A real server reads the runs back in tests/packages/trackers_check.py; here what needs none.

// A port of loopback where nothing listens (bound, then closed).
int closed_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  socklen_t size = sizeof(address);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &size);
  ::close(fd);
  return ntohs(address.sin_port);
}

TEST(TrackingMLflow, OnlyATrackingServerOverHttpIsSpokenTo) {
  {
    ScopedEnv no_server("MLFLOW_TRACKING_URI", nullptr);
    EXPECT_THROWS_WITH(MLflowTracker("e"), "[MLflowTracker] MLFLOW_TRACKING_URI is not set: accelerate-cpp logs to an "
                                           "MLflow tracking server through its REST API; start one (`mlflow server");
  }
  for (const char* uri : {"file:./mlruns", "sqlite:///mlflow.db", "databricks"}) {
    ScopedEnv server("MLFLOW_TRACKING_URI", uri);
    EXPECT_THROWS_WITH(MLflowTracker("e"), std::string("MLFLOW_TRACKING_URI '") + uri +
                                               "': accelerate-cpp speaks to an MLflow tracking server over HTTP(S) only");
  }
  ScopedEnv server("MLFLOW_TRACKING_URI", ("http://127.0.0.1:" + std::to_string(closed_port())).c_str());
  EXPECT_THROWS_WITH(MLflowTracker("e", "", {.nested_run = true}),
                     "nested_run: a nested run is started inside a parent run active in the same program");
  {
    ScopedEnv nested("MLFLOW_NESTED_RUN", "true");
    EXPECT_THROWS_WITH(MLflowTracker("e"), "nested_run");
  }
  {
    ScopedEnv tags("MLFLOW_TAGS", "[1, 2]");
    EXPECT_THROWS_WITH(MLflowTracker("e"), "MLFLOW_TAGS: expected a JSON object's text, got '[1, 2]'");
  }
  {
    ScopedEnv timeout("MLFLOW_HTTP_REQUEST_TIMEOUT", "soon");
    EXPECT_THROWS_WITH(MLflowTracker("e"), "MLFLOW_HTTP_REQUEST_TIMEOUT: expected seconds > 0, got 'soon'");
  }
  EXPECT_THROWS_WITH(MLflowTracker("e", "", {.tags = {{"bad*tag", 1}}}), "tag name 'bad*tag'");
  TempDir dir;
  auto accelerator = single({.log_with = {"mlflow"}, .project_dir = dir.str()});
  EXPECT_THROWS_WITH(accelerator.init_trackers("e", json::object(), {{"mlflow", {{"artifact_location", "x"}}}}),
                     "init_kwargs['mlflow']: unknown option 'artifact_location'; mlflow accepts run_id, tags");
  EXPECT_THROWS_WITH(accelerator.init_trackers("e", json::object(), {{"mlflow", {{"nested_run", "yes"}}}}),
                     "init_kwargs['mlflow']['nested_run']: expected a boolean, got \"yes\"");
}

TEST(TrackingMLflow, WithoutAServerTrainingGoesOnAndFinishNamesWhatIsKeptAndWhere) {
  TempDir dir;
  ScopedEnv server("MLFLOW_TRACKING_URI", ("http://127.0.0.1:" + std::to_string(closed_port())).c_str());
  ScopedEnv experiment("MLFLOW_EXPERIMENT_NAME", "from_env");
  CapturedLines warnings;
  MLflowTracker tracker("from_argument", dir.str(), {.run_name = "r", .flush_timeout = 0.5});
  tracker.store_init_configuration({{"lr", 0.001}, {"amp", true}, {"none", nullptr}, {"long", std::string(7000, 'x')}});
  for (int step = 0; step < 3; ++step) tracker.log({{"loss", 1.0 / (step + 1)}, {"note", "text"}}, step);
  // Names MLflow would refuse are refused when logged, before anything is queued.
  EXPECT_THROWS_WITH(tracker.log({{"bad*name", 1.0}}, 3), "[MLflowTracker.log] metric name 'bad*name'");
  EXPECT_THROWS_WITH(tracker.log({{"../up", 1.0}}, 3), "metric name '../up'");
  tracker.finish();
  EXPECT_TRUE(tracker.run_id().empty());
  ASSERT_TRUE(fs::exists(tracker.pending_file())) << tracker.pending_file();
  EXPECT_EQ(fs::path(tracker.pending_file()).parent_path(), dir.path());
  const auto lines = lines_of(read(tracker.pending_file()));
  ASSERT_EQ(lines.size(), tracker.pending());
  ASSERT_EQ(lines.size(), 6u);  // the start, the params, three logs, the end
  const json start = json::parse(lines[0]);
  EXPECT_EQ(start.at("request"), "start");
  EXPECT_EQ(start.at("run").at("experiment_name"), "from_env");  // MLFLOW_EXPERIMENT_NAME wins, as upstream
  const json params = json::parse(lines[1]).at("body").at("params");
  EXPECT_EQ(params, (json{{{"key", "amp"}, {"value", "True"}}, {{"key", "lr"}, {"value", "0.001"}},
                          {{"key", "none"}, {"value", "None"}}}));  // 7000 characters are too many: dropped
  for (int step = 0; step < 3; ++step) {
    const json metrics = json::parse(lines[2 + step]).at("body").at("metrics");
    ASSERT_EQ(metrics.size(), 1u);  // the text is no metric
    EXPECT_EQ(metrics[0].at("key"), "loss");
    EXPECT_EQ(metrics[0].at("step"), step);
    EXPECT_DOUBLE_EQ(metrics[0].at("value").get<double>(), 1.0 / (step + 1));
  }
  EXPECT_EQ(json::parse(lines[5]).at("body").at("status"), "FINISHED");
  EXPECT_TRUE(warnings.saw("[MLflowTracker] cannot reach the tracking server: GET http://127.0.0.1:"));
  EXPECT_TRUE(warnings.saw("[MLflowTracker.finish] 6 request(s) (3 metric value(s), 3 param(s), the run's start) "
                           "did not reach http://127.0.0.1:"));
  EXPECT_TRUE(warnings.saw("they are kept in " + tracker.pending_file()));
  EXPECT_TRUE(warnings.saw("'long' has 7000 characters; MLflow's params hold at most 6000, so it is dropped"));
  EXPECT_THROWS_WITH(tracker.log({{"loss", 1.0}}, 4), "[MLflowTracker] the run has finished");
}

}  // namespace tracking_test
}  // namespace accelerate::testing
