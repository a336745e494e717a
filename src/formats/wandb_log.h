// W&B's run file (`run-<id>.wandb`), the transaction log `wandb sync` uploads: a 7-byte header
// (":W&B", magic 0xBEE1, version 0), then LevelDB log framing in 32 KiB blocks (each chunk: zlib's
// CRC-32 of its type byte and data, its length, its type FULL/FIRST/MIDDLE/LAST), each record a
// serialised wandb_internal.Record message. Only the records a tracker writes are encoded here:
// header, run, config, history, summary, files and exit (Note [W&B offline runs] in
// docs/design.md). Torch-free: bytes in, bytes out.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace accelerate::detail::wandb_log {

/// The file's first 7 bytes.
std::string file_header();

/// `record` framed for a file that already holds `offset` bytes (header included): the padding
/// that ends a block with too little room, then one FULL chunk, or FIRST, MIDDLE…, LAST chunks
/// across blocks.
std::string frame(const std::string& record, uint64_t offset);

/// A key and its value as JSON text (ConfigItem, HistoryItem and SummaryItem alike): `path` of one
/// element is written as `key` in config items and as `nested_key` otherwise, as W&B does.
struct Item {
  std::vector<std::string> path;
  std::string value_json;
};

/// What the run record says of the run.
struct Run {
  std::string run_id, entity, project, display_name, notes, run_group, job_type, host;
  std::vector<std::string> tags;
  double start_time = 0;      // seconds since the epoch
  std::vector<Item> config;   // the run's configuration at its start
};

std::string header_record(int64_t num, const std::string& producer);
std::string run_record(int64_t num, const Run& run);
std::string config_record(int64_t num, const std::vector<Item>& update);
std::string history_record(int64_t num, const std::vector<Item>& items, int64_t step);
std::string summary_record(int64_t num, const std::vector<Item>& update);
/// Files the run holds under its `files/` folder (media written beside the run file).
std::string files_record(int64_t num, const std::vector<std::string>& paths);
std::string exit_record(int64_t num, int32_t exit_code, int32_t runtime_s);

}  // namespace accelerate::detail::wandb_log
