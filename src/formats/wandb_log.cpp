// W&B run files: the LevelDB log framing and the records of formats/wandb_log.h.
#include "formats/wandb_log.h"

#include "formats/checksums.h"
#include "formats/protobuf.h"

#include <cmath>

namespace accelerate::detail::wandb_log {

namespace {

using protobuf::Proto;

constexpr uint64_t kBlock = 32768;
constexpr uint64_t kChunkHeader = 7;
enum ChunkType : unsigned char { kFull = 1, kFirst = 2, kMiddle = 3, kLast = 4 };

void put_le(std::string& out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

void chunk(std::string& out, const char* data, size_t size, ChunkType type) {
  std::string typed(1, static_cast<char>(type));
  typed.append(data, size);
  const uint32_t crc = checksums::reflected_crc32<0xEDB88320u>(reinterpret_cast<const unsigned char*>(typed.data()),
                                                              typed.size());
  put_le(out, crc, 4);
  put_le(out, size, 2);
  out.push_back(static_cast<char>(type));
  out.append(data, size);
}

// wandb_internal.Record's fields (wandb_internal.proto).
enum RecordField {
  kNum = 1, kHistory = 2, kSummary = 3, kConfig = 5, kFiles = 6, kRun = 17, kExit = 18, kHeader = 21
};

std::string record(int64_t num, int field, const Proto& body) {
  return Proto().varint(kNum, static_cast<uint64_t>(num)).message(field, body).str();
}

// ConfigItem / HistoryItem / SummaryItem: key = 1, nested_key = 2, value_json = 16.
Proto item(const Item& item, bool flat_key) {
  Proto p;
  if (flat_key && item.path.size() == 1) {
    p.bytes(1, item.path[0]);
  } else {
    for (const auto& part : item.path) p.bytes_always(2, part);
  }
  p.bytes(16, item.value_json);
  return p;
}

Proto items(int field, const std::vector<Item>& list, bool flat_key) {
  Proto p;
  for (const auto& i : list) p.message(field, item(i, flat_key));
  return p;
}

Proto timestamp(double seconds) {
  const double whole = std::floor(seconds);
  return std::move(Proto()
                       .varint(1, static_cast<uint64_t>(whole))
                       .varint(2, static_cast<uint64_t>((seconds - whole) * 1e9)));
}

}  // namespace

std::string file_header() {
  std::string out = ":W&B";
  put_le(out, 0xBEE1, 2);
  out.push_back('\0');
  return out;
}

std::string frame(const std::string& record, uint64_t offset) {
  std::string out;
  uint64_t room = kBlock - offset % kBlock;
  if (room < kChunkHeader) {
    out.append(room, '\0');
    room = kBlock;
  }
  if (record.size() + kChunkHeader <= room) {
    chunk(out, record.data(), record.size(), kFull);
    return out;
  }
  size_t used = room - kChunkHeader;
  chunk(out, record.data(), used, kFirst);
  while (record.size() - used > kBlock - kChunkHeader) {
    chunk(out, record.data() + used, kBlock - kChunkHeader, kMiddle);
    used += kBlock - kChunkHeader;
  }
  chunk(out, record.data() + used, record.size() - used, kLast);
  return out;
}

std::string header_record(int64_t num, const std::string& producer) {
  // HeaderRecord.version_info (1): VersionInfo.producer (1).
  return record(num, kHeader, std::move(Proto().message(1, std::move(Proto().bytes(1, producer)))));
}

std::string run_record(int64_t num, const Run& run) {
  Proto p;
  p.bytes(1, run.run_id).bytes(2, run.entity).bytes(3, run.project);
  if (!run.config.empty()) p.message(4, items(1, run.config, /*flat_key=*/true));
  p.bytes(6, run.run_group).bytes(7, run.job_type).bytes(8, run.display_name).bytes(9, run.notes);
  for (const auto& tag : run.tags) p.bytes_always(10, tag);
  p.bytes(13, run.host);
  p.message(17, timestamp(run.start_time));
  return record(num, kRun, p);
}

std::string config_record(int64_t num, const std::vector<Item>& update) {
  return record(num, kConfig, items(1, update, /*flat_key=*/true));
}

std::string history_record(int64_t num, const std::vector<Item>& list, int64_t step) {
  Proto p = items(1, list, /*flat_key=*/false);
  p.message(2, std::move(Proto().varint(1, static_cast<uint64_t>(step))));
  return record(num, kHistory, p);
}

std::string summary_record(int64_t num, const std::vector<Item>& update) {
  return record(num, kSummary, items(1, update, /*flat_key=*/false));
}

std::string files_record(int64_t num, const std::vector<std::string>& paths) {
  Proto p;
  for (const auto& path : paths) p.message(1, std::move(Proto().bytes(1, path)));
  return record(num, kFiles, p);
}

std::string exit_record(int64_t num, int32_t exit_code, int32_t runtime_s) {
  return record(num, kExit,
                std::move(Proto()
                              .varint(1, static_cast<uint64_t>(static_cast<int64_t>(exit_code)))
                              .varint(2, static_cast<uint64_t>(static_cast<int64_t>(runtime_s)))));
}

}  // namespace accelerate::detail::wandb_log
