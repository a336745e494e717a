// What TensorBoard's event files are made of, encoded by hand (Note [TensorBoard records without
// protoc] in docs/design.md): TFRecord records holding serialised tensorflow.Event messages, the
// first one naming the file version; the protobuf wire format of the Event, Summary and HParams
// messages. The tracker that writes the files is in src/tracking.cpp.
#pragma once

#include "formats/protobuf.h"

#include <cstdint>
#include <string>

namespace accelerate::detail::tensorboard {

using Proto = protobuf::Proto;

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
