// MLflow through a tracking server's REST API (upstream: MLflowTracker); see
// include/accelerate/tracking.h and Note [MLflow without losing data] in docs/design.md.
#include "accelerate/tracking.h"

#include "detail/files.h"
#include "detail/http.h"
#include "detail/warn.h"
#include "tracking_impl.h"

#include <c10/util/Exception.h>
#include <pwd.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <exception>
#include <filesystem>
#include <mutex>
#include <thread>

namespace accelerate {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kMlflowLogger = "accelerate.tracking";
// MLflow's limits (mlflow.utils.validation): one log-batch request, a param's value, a name.
constexpr size_t kMaxMetricsPerBatch = 1000;
constexpr size_t kMaxParamsTagsPerBatch = 100;
constexpr size_t kMaxParamValueLength = 6000;
constexpr size_t kMaxNameLength = 250;

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string mlflow_env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "";
}

// A value as Python's str() writes it (MLflow stores params and tags as text).
std::string python_text(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_null()) return "None";
  if (v.is_boolean()) return v.get<bool>() ? "True" : "False";
  if (v.is_number_float() && !std::isfinite(v.get<double>())) {
    const double d = v.get<double>();
    return std::isnan(d) ? "nan" : d > 0 ? "inf" : "-inf";
  }
  return v.dump();
}

// A metric's value in MLflow's JSON (protobuf's JSON mapping spells the non-finite ones).
json metric_value(double d) {
  if (std::isnan(d)) return "NaN";
  if (std::isinf(d)) return d > 0 ? "Infinity" : "-Infinity";
  return d;
}

// MLflow's rule for metric, param and tag names: letters, digits, '_', '-', '.', ' ', ':', '/',
// at most 250 characters, and no path that climbs out ('..', a leading '/').
void check_name(const std::string& api, const std::string& what, const std::string& name) {
  bool ok = !name.empty() && name.size() <= kMaxNameLength && name.front() != '/';
  for (char c : name) {
    ok = ok && (std::isalnum(static_cast<unsigned char>(c)) || std::string("_-. :/").find(c) != std::string::npos);
  }
  ok = ok && name != ".." && name.rfind("../", 0) != 0 && name.find("/../") == std::string::npos &&
       (name.size() < 3 || name.compare(name.size() - 3, 3, "/..") != 0);
  TORCH_CHECK_VALUE(ok, "[", api, "] ", what, " name '", name,
                    "': MLflow names are 1 to 250 letters, digits, '_', '-', '.', ' ', ':' or '/', and no path "
                    "outside the run ('..', a leading '/')");
}

json tag_list(const json& tags) {
  json out = json::array();
  for (const auto& [key, value] : tags.items()) out.push_back({{"key", key}, {"value", python_text(value)}});
  return out;
}

std::string user_name() {
  if (const passwd* pw = ::getpwuid(::getuid()); pw != nullptr && pw->pw_name != nullptr) return pw->pw_name;
  return mlflow_env("USER");
}

std::string program_path() {
  std::error_code error;
  const fs::path exe = fs::read_symlink("/proc/self/exe", error);
  return error ? std::string() : exe.string();
}

}  // namespace

// Note [MLflow without losing data]
// Every request the tracker makes goes through one queue, sent in order by this thread, so that
// training never waits for the server and nothing is reordered. A request the server cannot take
// now (no connection, a timeout, a 5xx, 429) stays at the front: the queue is written to the
// pending file, the tracker warns once, pauses (0.25 s doubling to 5 s) and tries again. A request
// the server refuses for what it says (4xx) is dropped with a warning naming the server's reason,
// except the run's start: then nothing can be logged, and everything stays in the file.
class MLflowTracker::Sender {
 public:
  enum class Kind { kStart, kBatch, kEnd };
  struct Op {
    Kind kind;
    json body;
  };

  Sender(std::string uri, std::string file, double timeout_s) : uri_(std::move(uri)), file_(std::move(file)) {
    while (!uri_.empty() && uri_.back() == '/') uri_.pop_back();
    timeout_s_ = timeout_s;
    if (const std::string token = mlflow_env("MLFLOW_TRACKING_TOKEN"); !token.empty()) {
      headers_.push_back("Authorization: Bearer " + token);
    }
    if (!mlflow_env("MLFLOW_TRACKING_USERNAME").empty()) {
      user_password_ = mlflow_env("MLFLOW_TRACKING_USERNAME") + ":" + mlflow_env("MLFLOW_TRACKING_PASSWORD");
    }
    const std::string insecure = mlflow_env("MLFLOW_TRACKING_INSECURE_TLS");
    verify_tls_ = !(insecure == "true" || insecure == "True" || insecure == "1");
    headers_.push_back("Content-Type: application/json");
  }

  ~Sender() { stop(); }

  void start() { thread_ = std::thread([this] { loop(); }); }

  void push(Op op) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      TORCH_CHECK(!ended_, "[MLflowTracker] the run has finished");
      queue_.push_back(std::move(op));
    }
    wake_.notify_all();
  }

  // Queues the run's end, waits up to `seconds` for the queue to empty, then stops the thread.
  void finish(double seconds, const char* status = "FINISHED") {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (ended_) return;
      queue_.push_back({Kind::kEnd, {{"status", status}, {"end_time", now_ms()}}});
      ended_ = true;
    }
    wake_.notify_all();
    {
      std::unique_lock<std::mutex> lock(mutex_);
      done_.wait_for(lock, std::chrono::duration<double>(seconds), [&] { return queue_.empty() || dead_; });
    }
    stop();
    std::lock_guard<std::mutex> lock(mutex_);
    if (queue_.empty()) {
      std::error_code error;
      fs::remove(file_, error);
      return;
    }
    persist_locked();
    size_t metrics = 0, params = 0, requests = queue_.size();
    for (const auto& op : queue_) {
      if (op.kind == Kind::kBatch) {
        metrics += op.body.value("metrics", json::array()).size();
        params += op.body.value("params", json::array()).size();
      }
    }
    detail::warn(kMlflowLogger, "[MLflowTracker.finish] " + std::to_string(requests) + " request(s) (" +
                              std::to_string(metrics) + " metric value(s), " + std::to_string(params) +
                              " param(s)" + (queue_.front().kind == Kind::kStart ? ", the run's start" : "") +
                              ") did not reach " + uri_ + (last_error_.empty() ? "" : " (" + last_error_ + ")") +
                              "; they are kept in " + file_ + ", one REST request a line");
  }

  std::string run_id() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return run_id_;
  }
  size_t pending() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return queue_.size();
  }
  const std::string& file() const { return file_; }

 private:
  enum class Outcome { kSent, kRetry, kRefused };
  struct Result {
    Outcome outcome;
    std::string error;
  };

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  void loop() {
    auto pause = std::chrono::milliseconds(250);
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      wake_.wait(lock, [&] { return stopping_ || (!queue_.empty() && !dead_); });
      if (stopping_) return;
      // The front request, with the batches behind it merged up to MLflow's limits.
      Op op = queue_.front();
      size_t taken = 1;
      if (op.kind == Kind::kBatch) {
        for (; taken < queue_.size() && queue_[taken].kind == Kind::kBatch; ++taken) {
          const json& next = queue_[taken].body;
          if (op.body["metrics"].size() + next["metrics"].size() > kMaxMetricsPerBatch ||
              op.body["params"].size() + next["params"].size() > kMaxParamsTagsPerBatch ||
              op.body["tags"].size() + next["tags"].size() > kMaxParamsTagsPerBatch) {
            break;
          }
          for (const char* field : {"metrics", "params", "tags"}) {
            for (const auto& item : next[field]) op.body[field].push_back(item);
          }
        }
      }
      const std::string run_id = run_id_;
      lock.unlock();
      Result result = send(op, run_id);
      lock.lock();
      if (result.outcome == Outcome::kRetry) {
        last_error_ = result.error;
        persist_locked();
        if (!failing_) {
          failing_ = true;
          detail::warn(kMlflowLogger, "[MLflowTracker] cannot reach the tracking server: " + result.error +
                                    "; training goes on, what is not sent is kept in " + file_ +
                                    " and retried",
                       {.use_process_state = false});
        }
        wake_.wait_for(lock, pause, [&] { return stopping_; });
        pause = std::min<std::chrono::milliseconds>(pause * 2, std::chrono::seconds(5));
        continue;
      }
      pause = std::chrono::milliseconds(250);
      if (result.outcome == Outcome::kRefused) {
        last_error_ = result.error;
        if (op.kind == Kind::kStart) {
          dead_ = true;
          persist_locked();
          detail::warn(kMlflowLogger, "[MLflowTracker] the tracking server refused the run's start: " + result.error +
                                    "; nothing more is sent, everything is kept in " + file_,
                       {.use_process_state = false});
          done_.notify_all();
          continue;
        }
        detail::warn(kMlflowLogger, "[MLflowTracker] the tracking server refused a request, which is dropped: " + result.error,
                     {.use_process_state = false});
      }
      if (op.kind == Kind::kStart && result.outcome == Outcome::kSent) run_id_ = started_run_id_;
      queue_.erase(queue_.begin(), queue_.begin() + static_cast<std::ptrdiff_t>(taken));
      if (failing_) {
        failing_ = false;
        detail::warn(kMlflowLogger,
                     "[MLflowTracker] the tracking server " + uri_ + " is reachable again; sending what was kept",
                     {.use_process_state = false});
        if (queue_.empty()) {
          std::error_code error;
          fs::remove(file_, error);
        }
      }
      if (queue_.empty()) done_.notify_all();
    }
  }

  // What the queue holds, as REST requests (run ids filled in where known), written whole.
  void persist_locked() {
    std::string text;
    for (const auto& op : queue_) {
      json line;
      if (op.kind == Kind::kStart) {
        line = {{"request", "start"}, {"tracking_uri", uri_}, {"run", op.body}};
      } else {
        json body = op.body;
        body["run_id"] = run_id_.empty() ? json(nullptr) : json(run_id_);
        line = {{"request", op.kind == Kind::kBatch ? "POST /api/2.0/mlflow/runs/log-batch"
                                                    : "POST /api/2.0/mlflow/runs/update"},
                {"body", body}};
      }
      text += line.dump() + "\n";
    }
    try {
      std::error_code error;
      fs::create_directories(fs::path(file_).parent_path(), error);
      detail::write_file_atomically(file_, text);
    } catch (const std::exception& e) {
      detail::warn(kMlflowLogger, std::string("[MLflowTracker] cannot keep the unsent requests: ") + e.what(),
                   {.once = true, .use_process_state = false});
    }
  }

  detail::http::Response call(const std::string& method, const std::string& endpoint, const json& body) {
    detail::http::Request request;
    request.method = method;
    request.url = uri_ + "/api/2.0/mlflow/" + endpoint;
    if (method != "GET") request.body = body.dump();
    request.headers = headers_;
    request.timeout_s = timeout_s_;
    request.connect_timeout_s = std::min(10.0, timeout_s_);
    request.verify_tls = verify_tls_;
    request.user_password = user_password_;
    return detail::http::perform(request);
  }

  static json reply(const detail::http::Response& r) {
    json out = json::parse(r.body, nullptr, /*allow_exceptions=*/false);
    return out.is_discarded() ? json::object() : out;
  }

  static Result outcome(const detail::http::Response& r, const std::string& what) {
    if (r.ok()) return {Outcome::kSent, ""};
    if (!r.error.empty()) return {Outcome::kRetry, r.error};
    const json body = reply(r);
    const std::string message = what + ": HTTP " + std::to_string(r.status) + " " +
                                body.value("error_code", std::string()) + " " +
                                body.value("message", r.body.substr(0, 200));
    if (r.status >= 500 || r.status == 429 || r.status == 408) return {Outcome::kRetry, message};
    return {Outcome::kRefused, message};
  }

  Result send(const Op& op, const std::string& run_id) {
    switch (op.kind) {
      case Kind::kStart:
        return start_run(op.body);
      case Kind::kBatch: {
        json body = op.body;
        body["run_id"] = run_id;
        return outcome(call("POST", "runs/log-batch", body), "runs/log-batch");
      }
      case Kind::kEnd: {
        json body = op.body;
        body["run_id"] = run_id;
        return outcome(call("POST", "runs/update", body), "runs/update");
      }
    }
    return {Outcome::kRefused, "unknown request"};
  }

  Result start_run(const json& run) {
    if (!run.value("run_id", std::string()).empty()) {
      const std::string id = run.at("run_id").get<std::string>();
      auto r = call("GET", "runs/get?run_id=" + detail::http::escape(id), json());
      if (Result res = outcome(r, "runs/get (run " + id + ")"); res.outcome != Outcome::kSent) return res;
      // Upstream's resumed run: status back to RUNNING, its tags set.
      r = call("POST", "runs/update", {{"run_id", id}, {"status", "RUNNING"}});
      if (Result res = outcome(r, "runs/update"); res.outcome != Outcome::kSent) return res;
      if (!run.at("tags").empty()) {
        r = call("POST", "runs/log-batch", {{"run_id", id}, {"tags", run.at("tags")}});
        if (Result res = outcome(r, "runs/log-batch"); res.outcome != Outcome::kSent) return res;
      }
      started_run_id_ = id;
      return {Outcome::kSent, ""};
    }
    const std::string name = run.at("experiment_name").get<std::string>();
    std::string experiment_id;
    for (int attempt = 0; attempt < 2 && experiment_id.empty(); ++attempt) {
      auto r = call("GET", "experiments/get-by-name?experiment_name=" + detail::http::escape(name), json());
      if (r.ok()) {
        experiment_id = reply(r)["experiment"].value("experiment_id", std::string());
        break;
      }
      if (!(r.error.empty() && r.status == 404)) return outcome(r, "experiments/get-by-name (" + name + ")");
      r = call("POST", "experiments/create", {{"name", name}});
      if (r.ok()) {
        experiment_id = reply(r).value("experiment_id", std::string());
      } else if (reply(r).value("error_code", std::string()) != "RESOURCE_ALREADY_EXISTS") {
        return outcome(r, "experiments/create (" + name + ")");
      }
    }
    if (experiment_id.empty()) return {Outcome::kRetry, "experiment '" + name + "' could not be found nor created"};
    json body = {{"experiment_id", experiment_id}, {"start_time", run.at("start_time")}, {"tags", run.at("tags")},
                 {"user_id", run.at("user_id")}};
    if (!run.value("run_name", std::string()).empty()) body["run_name"] = run.at("run_name");
    auto r = call("POST", "runs/create", body);
    if (Result res = outcome(r, "runs/create"); res.outcome != Outcome::kSent) return res;
    started_run_id_ = reply(r)["run"]["info"].value("run_id", std::string());
    if (started_run_id_.empty()) return {Outcome::kRetry, "runs/create answered without a run id: " + r.body.substr(0, 200)};
    return {Outcome::kSent, ""};
  }

  std::string uri_;
  std::string file_;
  double timeout_s_ = 120;
  std::vector<std::string> headers_;
  std::string user_password_;
  bool verify_tls_ = true;

  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::deque<Op> queue_;
  std::string run_id_;
  std::string started_run_id_;  // written by the sending thread only
  std::string last_error_;
  bool failing_ = false;
  bool dead_ = false;
  bool ended_ = false;
  bool stopping_ = false;
  std::thread thread_;
};

MLflowTracker::MLflowTracker(const std::string& experiment_name, const std::string& logging_dir,
                             const MLflowTrackerOptions& options) {
  constexpr const char* api = "MLflowTracker";
  const std::string uri = mlflow_env("MLFLOW_TRACKING_URI");
  TORCH_CHECK_VALUE(!uri.empty(), "[", api,
                    "] MLFLOW_TRACKING_URI is not set: accelerate-cpp logs to an MLflow tracking server through its "
                    "REST API; start one (`mlflow server --host 127.0.0.1 --port 5000`) and set "
                    "MLFLOW_TRACKING_URI=http://127.0.0.1:5000");
  TORCH_CHECK_VALUE(uri.rfind("http://", 0) == 0 || uri.rfind("https://", 0) == 0, "[", api, "] MLFLOW_TRACKING_URI '",
                    uri,
                    "': accelerate-cpp speaks to an MLflow tracking server over HTTP(S) only (no local file or "
                    "database store); start `mlflow server` on that store and point MLFLOW_TRACKING_URI at it");
  std::string experiment = mlflow_env("MLFLOW_EXPERIMENT_NAME");
  if (experiment.empty()) experiment = experiment_name;
  TORCH_CHECK_VALUE(!experiment.empty(), "[", api, "] the experiment's name is empty (init_trackers' project_name, or "
                    "MLFLOW_EXPERIMENT_NAME)");
  std::string run_id = mlflow_env("MLFLOW_RUN_ID");
  if (run_id.empty()) run_id = options.run_id;
  json tags = options.tags;
  if (const std::string text = mlflow_env("MLFLOW_TAGS"); !text.empty()) {
    tags = json::parse(text, nullptr, /*allow_exceptions=*/false);
    TORCH_CHECK_VALUE(tags.is_object(), "[", api, "] MLFLOW_TAGS: expected a JSON object's text, got '", text, "'");
  }
  TORCH_CHECK_VALUE(tags.is_object(), "[", api, "] tags: expected a JSON object, got ", tags.dump());
  const std::string nested = mlflow_env("MLFLOW_NESTED_RUN");
  const bool nested_run = nested.empty() ? options.nested_run : (nested == "true" || nested == "True" || nested == "1");
  TORCH_CHECK_VALUE(!nested_run, "[", api,
                    "] nested_run: a nested run is started inside a parent run active in the same program, which "
                    "an accelerate-cpp program has not; pass the parent's id as a tag (mlflow.parentRunId) instead");
  TORCH_CHECK_VALUE(options.flush_timeout >= 0, "[", api, "] flush_timeout: expected seconds >= 0, got ",
                    options.flush_timeout);
  for (const auto& [key, value] : tags.items()) check_name(api, "tag", key);
  double timeout = 120;
  if (const std::string t = mlflow_env("MLFLOW_HTTP_REQUEST_TIMEOUT"); !t.empty()) {
    char* end = nullptr;
    timeout = std::strtod(t.c_str(), &end);
    TORCH_CHECK_VALUE(end != t.c_str() && *end == '\0' && timeout > 0, "[", api,
                      "] MLFLOW_HTTP_REQUEST_TIMEOUT: expected seconds > 0, got '", t, "'");
  }

  json all_tags = tags;
  if (!options.description.empty()) all_tags["mlflow.note.content"] = options.description;
  json run = {{"experiment_name", experiment}, {"run_id", run_id}, {"start_time", now_ms()}};
  if (run_id.empty()) {
    if (!options.run_name.empty()) all_tags["mlflow.runName"] = options.run_name;
    all_tags["mlflow.user"] = user_name();
    all_tags["mlflow.source.name"] = program_path();
    all_tags["mlflow.source.type"] = "LOCAL";
    run["run_name"] = options.run_name;
    run["user_id"] = user_name();
  }
  run["tags"] = tag_list(all_tags);
  const fs::path folder = logging_dir.empty() ? fs::path(".") : fs::path(logging_dir);
  const std::string file =
      (folder / ("mlflow-pending-" + std::to_string(::getpid()) + "-" + std::to_string(now_ms()) + ".jsonl")).string();
  sender_ = std::make_unique<Sender>(uri, file, timeout);
  sender_->push({Sender::Kind::kStart, run});
  sender_->start();
  flush_timeout_ = options.flush_timeout;
}

// A run the program leaves without `finish` is ended too (upstream: mlflow's exit hook): FAILED
// while an exception unwinds the stack, else FINISHED.
MLflowTracker::~MLflowTracker() {
  try {
    if (sender_) sender_->finish(flush_timeout_, std::uncaught_exceptions() > 0 ? "FAILED" : "FINISHED");
  } catch (const std::exception& e) {
    detail::warn(kMlflowLogger, std::string("[MLflowTracker] ") + e.what(), {.use_process_state = false});
  }
}

void MLflowTracker::store_init_configuration(const nlohmann::json& values) {
  constexpr const char* api = "MLflowTracker.store_init_configuration";
  TORCH_CHECK_VALUE(values.is_object(), "[", api, "] expected a JSON object, got ", values.type_name());
  json params = json::array();
  for (const auto& [key, value] : values.items()) {
    check_name(api, "param", key);
    std::string text = python_text(value);
    if (text.size() > kMaxParamValueLength) {
      detail::warn(kMlflowLogger, "[" + std::string(api) + "] the value of '" + key + "' has " + std::to_string(text.size()) +
                                " characters; MLflow's params hold at most 6000, so it is dropped",
                   {.once = true});
      continue;
    }
    params.push_back({{"key", key}, {"value", std::move(text)}});
  }
  for (size_t i = 0; i < params.size(); i += kMaxParamsTagsPerBatch) {
    json part = json::array();
    for (size_t j = i; j < std::min(params.size(), i + kMaxParamsTagsPerBatch); ++j) part.push_back(params[j]);
    sender_->push({Sender::Kind::kBatch, {{"metrics", json::array()}, {"params", part}, {"tags", json::array()}}});
  }
}

void MLflowTracker::log(const nlohmann::json& values, std::optional<int64_t> step) {
  constexpr const char* api = "MLflowTracker.log";
  check_log_values(values, api);
  const int64_t at = now_ms();
  json metrics = json::array();
  for (const auto& [key, value] : values.items()) {
    if (!value.is_number() && !value.is_boolean()) {
      detail::warn(kMlflowLogger, "[" + std::string(api) + "] '" + key + "' is not a number (" + value.type_name() +
                                      "); MLflow's metrics are numbers, so it is dropped",
                   {.once = true});
      continue;
    }
    check_name(api, "metric", key);
    const double d = value.is_boolean() ? (value.get<bool>() ? 1.0 : 0.0) : value.get<double>();
    metrics.push_back({{"key", key}, {"value", metric_value(d)}, {"timestamp", at}, {"step", step.value_or(0)}});
  }
  if (metrics.empty()) return;
  for (size_t i = 0; i < metrics.size(); i += kMaxMetricsPerBatch) {
    json part = json::array();
    for (size_t j = i; j < std::min(metrics.size(), i + kMaxMetricsPerBatch); ++j) part.push_back(metrics[j]);
    sender_->push({Sender::Kind::kBatch, {{"metrics", part}, {"params", json::array()}, {"tags", json::array()}}});
  }
}

void MLflowTracker::finish() {
  if (sender_) sender_->finish(flush_timeout_);
}

std::string MLflowTracker::run_id() const { return sender_->run_id(); }
size_t MLflowTracker::pending() const { return sender_->pending(); }
const std::string& MLflowTracker::pending_file() const { return sender_->file(); }

}  // namespace accelerate
