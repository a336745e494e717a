#!/usr/bin/python3
"""An independent reader and writer of safetensors files, using only json and struct, that the
C++ tests (tests/safetensors_test.cpp) run to cross-check accelerate-cpp's format.

  safetensors_check.py read PATH    checks a file the C++ side wrote with the values of EXPECTED;
                                    prints "ok", or an error and exits non-zero
  safetensors_check.py write PATH   writes WRITTEN with layout choices of its own (unpadded,
                                    misaligned data, shuffled keys) for the C++ side to check
"""
import json
import math
import struct
import sys

# dtype -> (element size, struct format of one element, or None for the 16-bit floats decoded by hand)
DTYPES = {
    "BOOL": (1, "?"), "U8": (1, "B"), "I8": (1, "b"), "I16": (2, "h"), "I32": (4, "i"),
    "I64": (8, "q"), "F16": (2, "e"), "BF16": (2, None), "F32": (4, "f"), "F64": (8, "d"),
    "C64": (8, None),
}

# What the C++ test writes: name -> (dtype, shape, flat values).
EXPECTED = {
    "bool": ("BOOL", [4], [True, False, False, True]),
    "u8": ("U8", [3], [0, 7, 255]),
    "i8": ("I8", [3], [-128, -1, 127]),
    "i16": ("I16", [2], [-32768, 12345]),
    "i32": ("I32", [2, 2], [-2147483648, 1, 2, 2147483647]),
    "i64": ("I64", [3], [-1, 0, 2**40 + 3]),
    "f16": ("F16", [3], [1.0, -2.5, 65504.0]),
    "bf16": ("BF16", [2], [1.0, -3.0]),
    "f32": ("F32", [2, 3], [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]),
    "f64": ("F64", [], [math.pi]),
    "c64": ("C64", [2], [complex(1, 2), complex(-3.5, 0.25)]),
    "empty": ("F32", [0, 3], []),
}
EXPECTED_METADATA = {"format": "pt", "source": "accelerate-cpp \u2713"}

# What this script writes for the C++ test, in this data order.
WRITTEN = [
    ("a_u8", "U8", [2, 2], [1, 2, 3, 4]),
    ("z_f32", "F32", [3], [1.5, -2.0, 3.25]),
    ("m_i64", "I64", [2], [-5, 2**62]),
    ("flag", "BOOL", [2], [True, False]),
    ("h", "F16", [1], [0.5]),
    ("bf", "BF16", [2], [1.0, -2.0]),
    ("c", "C64", [1], [complex(0.5, -1.0)]),
    ("d", "F64", [], [2.0**-30]),
    ("e", "I32", [0], []),
]
WRITTEN_METADATA = {"writer": "python", "note": "\u00fcn\u00efcode"}


def fail(message):
    print("safetensors_check: " + message, file=sys.stderr)
    sys.exit(1)


def encode(dtype, values):
    if dtype == "BF16":
        return b"".join(struct.pack("<f", v)[2:] for v in values)
    if dtype == "C64":
        return b"".join(struct.pack("<2f", v.real, v.imag) for v in values)
    return struct.pack("<%d%s" % (len(values), DTYPES[dtype][1]), *values)


def decode(dtype, raw):
    size = DTYPES[dtype][0]
    count = len(raw) // size
    if dtype == "BF16":
        return [struct.unpack("<f", b"\0\0" + raw[i:i + 2])[0] for i in range(0, len(raw), 2)]
    if dtype == "C64":
        pairs = struct.unpack("<%df" % (2 * count), raw)
        return [complex(pairs[i], pairs[i + 1]) for i in range(0, len(pairs), 2)]
    return list(struct.unpack("<%d%s" % (count, DTYPES[dtype][1]), raw))


def read(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    raw_header = blob[8:8 + n]
    if (8 + n) % 8 != 0:
        fail("the data starts at %d, not a multiple of 8" % (8 + n))
    text = raw_header.decode("utf-8")
    stripped = text.rstrip(" ")
    if not stripped.endswith("}") or len(text) - len(stripped) >= 8:
        fail("the header is not a JSON object padded with fewer than 8 spaces: %r" % text[-10:])
    header = json.loads(text)
    if list(header)[0] != "__metadata__":
        fail("__metadata__ is not the first key")
    metadata = header.pop("__metadata__")
    if metadata != EXPECTED_METADATA:
        fail("metadata %r, expected %r" % (metadata, EXPECTED_METADATA))
    if set(header) != set(EXPECTED):
        fail("tensors %s, expected %s" % (sorted(header), sorted(EXPECTED)))
    data = blob[8 + n:]
    position = 0
    previous_size = None
    for name, info in header.items():  # the header lists tensors in data order
        if set(info) != {"dtype", "shape", "data_offsets"}:
            fail("%s has keys %s" % (name, sorted(info)))
        begin, end = info["data_offsets"]
        if begin != position:
            fail("%s begins at %d, expected %d" % (name, begin, position))
        size = DTYPES[info["dtype"]][0]
        if previous_size is not None and size > previous_size:
            fail("%s (element size %d) follows a smaller element size" % (name, size))
        if (8 + n + begin) % size != 0:
            fail("%s is not aligned to %d bytes" % (name, size))
        dtype, shape, values = EXPECTED[name]
        if info["dtype"] != dtype or info["shape"] != shape:
            fail("%s is %s %s, expected %s %s" % (name, info["dtype"], info["shape"], dtype, shape))
        got = decode(dtype, data[begin:end])
        if got != values:
            fail("%s holds %r, expected %r" % (name, got, values))
        position = end
        previous_size = size
    if position != len(data):
        fail("the tensors end at %d but the data has %d bytes" % (position, len(data)))
    print("ok")


def write(path):
    header = {}
    data = b""
    for name, dtype, shape, values in WRITTEN:
        raw = encode(dtype, values)
        header[name] = {"shape": shape, "data_offsets": [len(data), len(data) + len(raw)], "dtype": dtype}
        data += raw
    # Reverse alphabetical keys, metadata last, spaces after separators, and no padding to 8:
    # instead the header is padded so that the data starts 2 bytes past a multiple of 4, which
    # leaves the 4- and 8-byte tensors misaligned.
    ordered = {name: header[name] for name in sorted(header, reverse=True)}
    ordered["__metadata__"] = WRITTEN_METADATA
    text = json.dumps(ordered, ensure_ascii=False).encode("utf-8")
    text += b" " * ((2 - (8 + len(text))) % 4)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)
    print("ok")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("read", "write"):
        fail("usage: safetensors_check.py read|write PATH")
    (read if sys.argv[1] == "read" else write)(sys.argv[2])
