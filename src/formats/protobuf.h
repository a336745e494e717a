// The protobuf wire format, encoded by hand (Note [TensorBoard records without protoc] in
// docs/design.md): the few encodings that the messages of TensorBoard's event files and of W&B's
// run files need.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

namespace accelerate::detail::protobuf {

// Only the encodings the messages written here need: varints, fixed 32/64-bit
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

}  // namespace accelerate::detail::protobuf
