// TensorBoard's records; see tensorboard.h.
#include "formats/tensorboard.h"

#include "formats/checksums.h"

namespace accelerate::detail::tensorboard {
namespace {

// TFRecord's masked CRC: rotate right by 15 bits and add a constant.
uint32_t masked_crc32c(const std::string& bytes) {
  const uint32_t crc = checksums::reflected_crc32<0x82F63B78u>(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size());
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

void put_le(std::string& out, uint64_t v, int size) {
  for (int i = 0; i < size; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

}  // namespace

// tensorflow.Summary.Value with the given tag.
Proto summary_value(const std::string& tag) { return std::move(Proto().bytes(1, tag)); }

Proto plugin_metadata(const std::string& plugin_name, const std::string& content) {
  return std::move(Proto().message(1, std::move(Proto().bytes(1, plugin_name).bytes(2, content))));
}

Proto scalar_summary(const std::string& tag, double value) {
  return std::move(Proto().message(1, summary_value(tag).fixed32_always(2, static_cast<float>(value))));
}

Proto text_summary(const std::string& tag, const std::string& text) {
  constexpr int kDtString = 7;
  Proto shape = std::move(Proto().message(2, std::move(Proto().varint(1, 1))));
  Proto tensor = std::move(Proto().varint(1, kDtString).message(2, shape).bytes_always(8, text));
  // The text plugin's content is TextPluginData{version: 0}, which serialises to nothing.
  Proto value = summary_value(tag + "/text_summary");
  value.message(8, tensor).message(9, plugin_metadata("text", ""));  // fields in number order, as protobuf writes
  return std::move(Proto().message(1, value));
}

Proto hparams_summary(const std::string& tag, const Proto& plugin_data) {
  Proto value = summary_value(tag);
  value.message(9, plugin_metadata("hparams", plugin_data.str()));
  return std::move(Proto().message(1, value));
}

std::string tfrecord(const std::string& data) {
  std::string record;
  std::string length;
  put_le(length, data.size(), 8);
  record += length;
  put_le(record, masked_crc32c(length), 4);
  record += data;
  put_le(record, masked_crc32c(data), 4);
  return record;
}

std::string file_version_event(double wall_time) {
  return tfrecord(Proto().fixed64(1, wall_time).bytes(3, "brain.Event:2").str());
}

std::string summary_event(const Proto& summary, int64_t step, double wall_time) {
  return tfrecord(Proto().fixed64(1, wall_time).varint(2, static_cast<uint64_t>(step)).message(5, summary).str());
}

}  // namespace accelerate::detail::tensorboard
