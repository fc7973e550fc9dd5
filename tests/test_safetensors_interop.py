"""A checkpoint written by nabla opens with the safetensors rules alone.

Runs build/bin/nb_ckpt_sample to write a training checkpoint (every dtype,
odd names and shapes, AdamW state) and to print what it must contain, then
reads the file with nothing but json and struct: the 8-byte little-endian
header length, the UTF-8 JSON header, the 8-byte alignment of the data,
tensors back to back, every element's bits and, for floats, the values they
decode to. If the safetensors package (with torch or numpy) imports, the file
is also loaded with it; failing that, if torch imports, torch builds each
tensor from its bytes with the dtype the header names.

Skipped (exit 77) when neither safetensors nor torch imports; a failure
under CI=true.
"""
import json
import math
import os
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import driver, fail, import_torch  # noqa: E402

# dtype -> (struct code, bytes per element); floats compared by bit pattern
FORMATS = {"F32": ("I", 4), "F64": ("Q", 8), "BF16": ("H", 2), "F16": ("H", 2),
           "I32": ("i", 4), "I64": ("q", 8)}


def decode_floats(dtype, raw, count):
    """Element values by the format's rules: IEEE binary32/64/16, and bfloat16
    as the high half of a binary32."""
    if dtype == "BF16":
        halves = struct.unpack("<%dH" % count, raw)
        return [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in halves]
    code = {"F32": "f", "F64": "d", "F16": "e"}[dtype]
    return list(struct.unpack("<%d%s" % (count, code), raw))


def same_float(a, b):
    return (math.isnan(a) and math.isnan(b)) or a == b


def check_with_json_and_struct(path, expected):
    raw = open(path, "rb").read()
    if len(raw) < 8:
        fail("file shorter than 8 bytes")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > len(raw) - 8:
        fail("header length %d past the end of a %d-byte file" % (n, len(raw)))
    if (8 + n) % 8:
        fail("data section not 8-byte aligned (header length %d)" % n)
    header_text = raw[8:8 + n].decode("utf-8")  # strict: must be UTF-8
    body = header_text.rstrip(" ")
    if not body.endswith("}") or len(header_text) - len(body) >= 8:
        fail("the header must be the JSON object followed by at most 7 spaces of padding")
    header = json.loads(header_text)
    if not isinstance(header, dict):
        fail("header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta != expected["metadata"]:
        fail("metadata %r != expected %r" % (meta, expected["metadata"]))
    data = raw[8 + n:]

    names = [t["name"] for t in expected["tensors"]]
    if sorted(header) != sorted(names):
        fail("tensor names differ: file has %s, expected %s" % (sorted(header), sorted(names)))
    spans = sorted((e["data_offsets"][0], e["data_offsets"][1], k) for k, e in header.items())
    end = 0
    for begin, stop, name in spans:
        if begin != end or stop < begin:
            fail("tensor %r at [%d, %d] does not follow the previous one (ends at %d)"
                 % (name, begin, stop, end))
        end = stop
    if end != len(data):
        fail("tensors end at %d, data section has %d bytes" % (end, len(data)))

    for t in expected["tensors"]:
        e = header[t["name"]]
        if set(e) != {"dtype", "shape", "data_offsets"}:
            fail("entry %r has keys %s" % (t["name"], sorted(e)))
        if e["dtype"] != t["dtype"] or e["shape"] != t["shape"]:
            fail("%r: %s %s, expected %s %s" % (t["name"], e["dtype"], e["shape"],
                                               t["dtype"], t["shape"]))
        code, size = FORMATS[e["dtype"]]
        count = 1
        for d in e["shape"]:
            count *= d
        begin, stop = e["data_offsets"]
        if stop - begin != count * size:
            fail("%r: %d bytes for %d elements of %s" % (t["name"], stop - begin, count, e["dtype"]))
        values = list(struct.unpack("<%d%s" % (count, code), data[begin:stop]))
        if values != t["bits"]:
            fail("%r: values %s, expected %s" % (t["name"], values[:8], t["bits"][:8]))
        if "values" in t:
            decoded = decode_floats(e["dtype"], data[begin:stop], count)
            for got, want in zip(decoded, t["values"]):
                if not same_float(got, want):
                    fail("%r: %s decodes to %r, nabla says %r" % (t["name"], e["dtype"], got, want))
    print("json+struct: %d tensors, %d metadata keys, %d bytes: ok"
          % (len(names), len(meta), len(raw)))


def check_with_torch(path, expected, torch):
    """Without the safetensors package: the header by json, each tensor made by
    torch from its bytes with the dtype the format names."""
    dtypes = {"F32": torch.float32, "F64": torch.float64, "BF16": torch.bfloat16,
              "F16": torch.float16, "I32": torch.int32, "I64": torch.int64}
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    data = bytearray(raw[8 + n:])
    for t in expected["tensors"]:
        e = header[t["name"]]
        begin, stop = e["data_offsets"]
        dt = dtypes[e["dtype"]]
        x = (torch.frombuffer(data[begin:stop], dtype=dt) if stop > begin
             else torch.empty(0, dtype=dt)).reshape(e["shape"])
        if "values" in t:
            got = x.double().flatten().tolist()
            if not all(same_float(a, b) for a, b in zip(got, t["values"])):
                fail("torch reads %r as %s, nabla says %s" % (t["name"], got[:6], t["values"][:6]))
        elif x.flatten().tolist() != t["bits"]:
            fail("torch reads %r as %s" % (t["name"], x.flatten().tolist()[:6]))
    print("torch %s (from the raw bytes): %d tensors: ok" % (torch.__version__,
                                                           len(expected["tensors"])))


def libraries():
    """(torch or None, whether safetensors imports). With neither, torch is
    looked for as test_gpt_names.py does (Debian's python3-torch under the
    system interpreter), and the test is skipped if it is not found: it must
    not pass on json+struct alone."""
    try:
        import torch
    except ImportError:
        torch = None
    try:
        import safetensors  # noqa: F401
        have_safetensors = True
    except ImportError:
        have_safetensors = False
    if torch is None and not have_safetensors:
        torch = import_torch()
    return torch, have_safetensors


def check_with_library(path, expected, torch, have_safetensors):
    if not have_safetensors:
        check_with_torch(path, expected, torch)
        return
    from safetensors import safe_open
    framework = "pt" if torch is not None else "numpy"
    with safe_open(path, framework=framework) as f:
        if f.metadata() != expected["metadata"]:
            fail("safetensors metadata %r" % (f.metadata(),))
        if sorted(f.keys()) != sorted(t["name"] for t in expected["tensors"]):
            fail("safetensors keys %s" % sorted(f.keys()))
        checked = 0
        for t in expected["tensors"]:
            if torch is None and t["dtype"] == "BF16":
                continue  # numpy has no bfloat16
            x = f.get_tensor(t["name"])
            if list(x.shape) != t["shape"]:
                fail("safetensors shape of %r: %s" % (t["name"], list(x.shape)))
            code, size = FORMATS[t["dtype"]]
            if torch is not None:
                raw = x.contiguous().view(torch.uint8).numpy().tobytes() if x.numel() else b""
            else:
                raw = x.tobytes()
            values = list(struct.unpack("<%d%s" % (len(raw) // size, code), raw))
            if values != t["bits"]:
                fail("safetensors values of %r" % t["name"])
            checked += 1
    print("safetensors (%s): %d tensors: ok" % (framework, checked))


def main():
    torch, have_safetensors = libraries()
    tool = driver("nb_ckpt_sample")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "sample.safetensors")
        run = subprocess.run([tool, path], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if run.returncode != 0:
            fail("nb_ckpt_sample exited %d: %s" % (run.returncode, run.stderr.decode()))
        expected = json.loads(run.stdout.decode("utf-8"))
        check_with_json_and_struct(path, expected)
        check_with_library(path, expected, torch, have_safetensors)
        leftovers = [f for f in os.listdir(d) if f != "sample.safetensors"]
        if leftovers:
            fail("temporary files left: %s" % leftovers)
    print("ok")


if __name__ == "__main__":
    main()
