"""An independent reader of TensorBoard event files, run by tests/tracking_test.cpp.

    tensorboard_check.py FOLDER

Reads every events.out.tfevents.* file under FOLDER: checks the TFRecord framing of every record
(the masked CRC-32C of the length and of the data, computed here with its own table), parses each
record as a tensorflow.Event with the protobuf runtime (message classes built at run time from
descriptors written below, so no generated code is needed), decodes hparams plugin data and PNG
images, and prints one JSON object:

    {"runs": {"<folder relative to FOLDER>": {"file": name, "events": [...]}}, "files": [...]}

Exits with status 1 and a message on stderr when anything does not check out.
"""

import json
import os
import struct
import sys
import zlib

from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory, struct_pb2

# ---- CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) -------------------------------------

_TABLE = []
for _n in range(256):
    _c = _n
    for _ in range(8):
        _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1
    _TABLE.append(_c)


def crc32c(data):
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked(crc):
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


assert crc32c(b"123456789") == 0xE3069283

# ---- descriptors ----------------------------------------------------------------------------------

F = descriptor_pb2.FieldDescriptorProto
OPT, REP = F.LABEL_OPTIONAL, F.LABEL_REPEATED


def message(parent, name, fields, oneofs=(), nested=(), map_entry=False):
    m = parent.add(name=name)
    for oneof in oneofs:
        m.oneof_decl.add(name=oneof)
    for field in fields:
        fname, number, ftype = field[:3]
        label = field[3] if len(field) > 3 else OPT
        type_name = field[4] if len(field) > 4 else None
        oneof = field[5] if len(field) > 5 else None
        f = m.field.add(name=fname, number=number, type=ftype, label=label)
        if type_name:
            f.type_name = type_name
        if oneof is not None:
            f.oneof_index = oneof
    for build in nested:
        build(m.nested_type)
    if map_entry:
        m.options.map_entry = True
    return m


def enum(parent, name, values):
    e = parent.add(name=name)
    for value_name, number in values:
        e.value.add(name=value_name, number=number)


def tensorflow_file():
    f = descriptor_pb2.FileDescriptorProto(name="check/tensorflow.proto", package="tensorflow", syntax="proto3")
    T = F
    message(f.message_type, "Event", [
        ("wall_time", 1, T.TYPE_DOUBLE),
        ("step", 2, T.TYPE_INT64),
        ("file_version", 3, T.TYPE_STRING, OPT, None, 0),
        ("graph_def", 4, T.TYPE_BYTES, OPT, None, 0),
        ("summary", 5, T.TYPE_MESSAGE, OPT, ".tensorflow.Summary", 0),
    ], oneofs=["what"])
    message(f.message_type, "Summary", [("value", 1, T.TYPE_MESSAGE, REP, ".tensorflow.Summary.Value")], nested=[
        lambda n: message(n, "Image", [
            ("height", 1, T.TYPE_INT32), ("width", 2, T.TYPE_INT32), ("colorspace", 3, T.TYPE_INT32),
            ("encoded_image_string", 4, T.TYPE_BYTES)]),
        lambda n: message(n, "Value", [
            ("node_name", 7, T.TYPE_STRING),
            ("tag", 1, T.TYPE_STRING),
            ("metadata", 9, T.TYPE_MESSAGE, OPT, ".tensorflow.SummaryMetadata"),
            ("simple_value", 2, T.TYPE_FLOAT, OPT, None, 0),
            ("obsolete_old_style_histogram", 3, T.TYPE_BYTES, OPT, None, 0),
            ("image", 4, T.TYPE_MESSAGE, OPT, ".tensorflow.Summary.Image", 0),
            ("tensor", 8, T.TYPE_MESSAGE, OPT, ".tensorflow.TensorProto", 0),
        ], oneofs=["value"]),
    ])
    message(f.message_type, "SummaryMetadata", [
        ("plugin_data", 1, T.TYPE_MESSAGE, OPT, ".tensorflow.SummaryMetadata.PluginData"),
        ("display_name", 2, T.TYPE_STRING),
        ("summary_description", 3, T.TYPE_STRING),
    ], nested=[lambda n: message(n, "PluginData", [("plugin_name", 1, T.TYPE_STRING), ("content", 2, T.TYPE_BYTES)])])
    message(f.message_type, "TensorShapeProto", [
        ("dim", 2, T.TYPE_MESSAGE, REP, ".tensorflow.TensorShapeProto.Dim"),
        ("unknown_rank", 3, T.TYPE_BOOL),
    ], nested=[lambda n: message(n, "Dim", [("size", 1, T.TYPE_INT64), ("name", 2, T.TYPE_STRING)])])
    message(f.message_type, "TensorProto", [
        ("dtype", 1, T.TYPE_INT32),
        ("tensor_shape", 2, T.TYPE_MESSAGE, OPT, ".tensorflow.TensorShapeProto"),
        ("version_number", 3, T.TYPE_INT32),
        ("tensor_content", 4, T.TYPE_BYTES),
        ("string_val", 8, T.TYPE_BYTES, REP),
    ])
    return f


def hparams_file():
    T = F
    f = descriptor_pb2.FileDescriptorProto(name="check/hparams.proto", package="tensorboard.hparams", syntax="proto3",
                                           dependency=["google/protobuf/struct.proto"])
    enum(f.enum_type, "DataType", [("DATA_TYPE_UNSET", 0), ("DATA_TYPE_STRING", 1), ("DATA_TYPE_BOOL", 2),
                                   ("DATA_TYPE_FLOAT64", 3)])
    enum(f.enum_type, "Status", [("STATUS_UNKNOWN", 0), ("STATUS_SUCCESS", 1), ("STATUS_FAILURE", 2),
                                 ("STATUS_RUNNING", 3)])
    message(f.message_type, "HParamInfo", [
        ("name", 1, T.TYPE_STRING), ("display_name", 2, T.TYPE_STRING), ("description", 3, T.TYPE_STRING),
        ("type", 4, T.TYPE_ENUM, OPT, ".tensorboard.hparams.DataType"),
        ("domain_discrete", 5, T.TYPE_MESSAGE, OPT, ".google.protobuf.ListValue", 0),
    ], oneofs=["domain"])
    message(f.message_type, "MetricName", [("group", 1, T.TYPE_STRING), ("tag", 2, T.TYPE_STRING)])
    message(f.message_type, "MetricInfo", [
        ("name", 1, T.TYPE_MESSAGE, OPT, ".tensorboard.hparams.MetricName"), ("display_name", 3, T.TYPE_STRING),
        ("description", 4, T.TYPE_STRING)])
    message(f.message_type, "Experiment", [
        ("name", 6, T.TYPE_STRING), ("description", 1, T.TYPE_STRING), ("user", 2, T.TYPE_STRING),
        ("time_created_secs", 3, T.TYPE_DOUBLE),
        ("hparam_infos", 4, T.TYPE_MESSAGE, REP, ".tensorboard.hparams.HParamInfo"),
        ("metric_infos", 5, T.TYPE_MESSAGE, REP, ".tensorboard.hparams.MetricInfo")])
    message(f.message_type, "SessionStartInfo", [
        ("hparams", 1, T.TYPE_MESSAGE, REP, ".tensorboard.hparams.SessionStartInfo.HparamsEntry"),
        ("model_uri", 2, T.TYPE_STRING), ("monitor_url", 3, T.TYPE_STRING), ("group_name", 4, T.TYPE_STRING),
        ("start_time_secs", 5, T.TYPE_DOUBLE),
    ], nested=[lambda n: message(n, "HparamsEntry", [
        ("key", 1, T.TYPE_STRING), ("value", 2, T.TYPE_MESSAGE, OPT, ".google.protobuf.Value")], map_entry=True)])
    message(f.message_type, "SessionEndInfo", [
        ("status", 1, T.TYPE_ENUM, OPT, ".tensorboard.hparams.Status"), ("end_time_secs", 2, T.TYPE_DOUBLE)])
    message(f.message_type, "HParamsPluginData", [
        ("version", 1, T.TYPE_INT32),
        ("experiment", 2, T.TYPE_MESSAGE, OPT, ".tensorboard.hparams.Experiment", 0),
        ("session_start_info", 3, T.TYPE_MESSAGE, OPT, ".tensorboard.hparams.SessionStartInfo", 0),
        ("session_end_info", 4, T.TYPE_MESSAGE, OPT, ".tensorboard.hparams.SessionEndInfo", 0),
    ], oneofs=["data"])
    return f


def build_classes():
    pool = descriptor_pool.DescriptorPool()
    struct_file = descriptor_pb2.FileDescriptorProto()
    struct_pb2.DESCRIPTOR.CopyToProto(struct_file)
    pool.Add(struct_file)
    pool.Add(tensorflow_file())
    pool.Add(hparams_file())

    def cls(name):
        desc = pool.FindMessageTypeByName(name)
        if hasattr(message_factory, "GetMessageClass"):
            return message_factory.GetMessageClass(desc)
        return message_factory.MessageFactory(pool).GetPrototype(desc)

    return cls("tensorflow.Event"), cls("tensorboard.hparams.HParamsPluginData")


Event, HParamsPluginData = build_classes()

# ---- PNG ---------------------------------------------------------------------------------------------


def decode_png(data):
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG signature")
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        if zlib.crc32(kind + body) & 0xFFFFFFFF != crc:
            raise ValueError("PNG chunk %r: CRC mismatch" % kind)
        chunks.append((kind, body))
        pos += 12 + length
    if chunks[0][0] != b"IHDR" or chunks[-1][0] != b"IEND":
        raise ValueError("PNG chunks out of order")
    width, height, depth, color_type = struct.unpack(">IIBB", chunks[0][1][:10])
    channels = {2: 3, 6: 4, 0: 1}[color_type]
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    stride = width * channels
    if depth != 8 or len(raw) != height * (stride + 1):
        raise ValueError("PNG: unexpected depth or data size")
    pixels = []
    for y in range(height):
        row = raw[y * (stride + 1):(y + 1) * (stride + 1)]
        if row[0] != 0:
            raise ValueError("PNG: filter %d not expected" % row[0])
        pixels.extend(row[1:])
    return {"width": width, "height": height, "channels": channels, "pixels": list(pixels)}


# ---- records -----------------------------------------------------------------------------------------


def read_records(path):
    with open(path, "rb") as f:
        data = f.read()
    pos, records = 0, []
    while pos < len(data):
        if pos + 12 > len(data):
            raise ValueError("%s: truncated record header at byte %d" % (path, pos))
        header = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
        if masked(crc32c(header)) != length_crc:
            raise ValueError("%s: length CRC mismatch at byte %d" % (path, pos))
        body = data[pos + 12:pos + 12 + length]
        if len(body) != length or pos + 16 + length > len(data):
            raise ValueError("%s: truncated record at byte %d" % (path, pos))
        (data_crc,) = struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])
        if masked(crc32c(body)) != data_crc:
            raise ValueError("%s: data CRC mismatch at byte %d" % (path, pos))
        records.append(body)
        pos += 16 + length
    return records


def describe_value(value):
    out = {"tag": value.tag}
    kind = value.WhichOneof("value")
    plugin = value.metadata.plugin_data.plugin_name if value.HasField("metadata") else ""
    if plugin:
        out["plugin"] = plugin
    if kind == "simple_value":
        out["simple_value"] = value.simple_value
    elif kind == "tensor":
        out["dtype"] = value.tensor.dtype
        out["shape"] = [d.size for d in value.tensor.tensor_shape.dim]
        out["string_val"] = [s.decode("utf-8") for s in value.tensor.string_val]
    elif kind == "image":
        out["image"] = {"height": value.image.height, "width": value.image.width,
                        "colorspace": value.image.colorspace,
                        "png": decode_png(value.image.encoded_image_string)}
    if plugin == "hparams":
        data = HParamsPluginData()
        data.ParseFromString(value.metadata.plugin_data.content)
        if data.SerializeToString(deterministic=True) != value.metadata.plugin_data.content:
            raise ValueError("hparams plugin data is not in protobuf's canonical encoding")
        out["hparams"] = json_format.MessageToDict(data, preserving_proto_field_name=True)
    elif plugin:
        out["plugin_content"] = value.metadata.plugin_data.content.hex()
    return out


def read_events(path):
    events = []
    for body in read_records(path):
        event = Event()
        event.ParseFromString(body)
        if event.SerializeToString() != body:
            raise ValueError("%s: a record holds fields this reader does not know" % path)
        e = {"wall_time": event.wall_time, "step": event.step}
        what = event.WhichOneof("what")
        if what == "file_version":
            e["file_version"] = event.file_version
        elif what == "summary":
            e["values"] = [describe_value(v) for v in event.summary.value]
        else:
            e["what"] = what
        events.append(e)
    return events


def main():
    root = sys.argv[1]
    runs, files = {}, []
    for folder, _, names in sorted(os.walk(root)):
        rel = os.path.relpath(folder, root)
        for name in sorted(names):
            files.append(os.path.normpath(os.path.join(rel, name)))
            if not name.startswith("events.out.tfevents."):
                continue
            if rel in runs:
                raise ValueError("%s holds more than one event file" % folder)
            runs[rel] = {"file": name, "events": read_events(os.path.join(folder, name))}
    print(json.dumps({"runs": runs, "files": files}, sort_keys=True))


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # noqa: BLE001 - every failure is reported the same way
        print("tensorboard_check: %s" % e, file=sys.stderr)
        sys.exit(1)
