// What TensorBoard's event files are made of, encoded by hand (Note [TensorBoard records without
// protoc] in docs/design.md): TFRecord records holding serialised tensorflow.Event messages, the
// first one naming the file version; the protobuf wire format of the Event, Summary and HParams
// messages. The tracker that writes the files is in src/tracking.cpp.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

namespace accelerate::detail::tensorboard {

// Only the encodings the Event, Summary and HParams messages need: varints, fixed 32/64-bit
// numbers and length-delimited fields. Fields at their proto3 default are left out, as protobuf
// does.
class Proto {
 public:
  Proto& varint(int field, uint64_t value) {
    if (value != 0) {
      key(field, 0);
      raw_varint(value);
    }
    return *this;
  }
  Proto& fixed64(int field, double value) { return value != 0 ? fixed64_always(field, value) : *this; }
  // For oneof members, which are written even at their default.
  Proto& fixed64_always(int field, double value) {
    key(field, 1);
    uint64_t bits = 0;
    std::memcpy(&bits, &value, sizeof(bits));
    for (int i = 0; i < 8; ++i) bytes_.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
    return *this;
  }
  // Always written: a scalar of 0 is still a value the reader must see.
  Proto& fixed32_always(int field, float value) {
    key(field, 5);
    uint32_t bits = 0;
    std::memcpy(&bits, &value, sizeof(bits));
    for (int i = 0; i < 4; ++i) bytes_.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
    return *this;
  }
  Proto& bytes(int field, const std::string& value) {
    if (!value.empty()) bytes_always(field, value);
    return *this;
  }
  // For oneof members and repeated elements, which are written even when empty.
  Proto& bytes_always(int field, const std::string& value) {
    key(field, 2);
    raw_varint(value.size());
    bytes_ += value;
    return *this;
  }
  Proto& message(int field, const Proto& value) { return bytes_always(field, value.str()); }
  const std::string& str() const { return bytes_; }

 private:
  void key(int field, int wire_type) { raw_varint((static_cast<uint64_t>(field) << 3) | wire_type); }
  void raw_varint(uint64_t value) {
    while (value >= 0x80) {
      bytes_.push_back(static_cast<char>((value & 0x7f) | 0x80));
      value >>= 7;
    }
    bytes_.push_back(static_cast<char>(value));
  }
  std::string bytes_;
};

/// tensorflow.Summary.Value with the given tag.
Proto summary_value(const std::string& tag);
/// A SummaryMetadata.PluginData for plugin `plugin_name` with `content`.
Proto plugin_metadata(const std::string& plugin_name, const std::string& content);
/// A Summary of one scalar.
Proto scalar_summary(const std::string& tag, double value);
/// A Summary of one text (the text plugin's string tensor).
Proto text_summary(const std::string& tag, const std::string& text);
/// A Summary of the hparams plugin's `plugin_data`.
Proto hparams_summary(const std::string& tag, const Proto& plugin_data);

/// The first record of an event file: an Event naming the file version, at `wall_time`.
std::string file_version_event(double wall_time);
/// The record of an Event holding `summary`, at `step` and `wall_time`.
std::string summary_event(const Proto& summary, int64_t step, double wall_time);

/// `data` framed as one TFRecord record: its length, the masked CRC-32C of the length, the data
/// and the masked CRC-32C of the data (the records of a TensorBoard event file).
std::string tfrecord(const std::string& data);

}  // namespace accelerate::detail::tensorboard
