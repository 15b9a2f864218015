#!/usr/bin/env python3
"""Writes the corpus inputs of issue 28 (deep nesting, a "meta" device) into tests/fuzz/corpus.

Each is tests/fuzz/corpus/seed-checkpoint-adam-gradscaler with one pickle or record changed, the
archive rewritten by Python's zipfile (valid zip CRCs: the fuzz target seals it). The pickles that
crashed the loader nest ~300,000 levels (hundreds of KB): they are stored deflated, which zip
readers accept, so each file stays a few KB. Run from anywhere: python3 tests/fuzz/make_nesting_inputs.py
"""
import io
import os
import struct
import zipfile

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
DEEP = 300_000
KEY = b"X\x04\x00\x00\x00deep"  # BINUNICODE "deep"


def nested(kind, depth):
    """Pickle opcodes for `depth` containers, each inside the next, as LibTorch's unpickler reads them."""
    if kind == "list":  # EMPTY_LIST MARK ... APPENDS
        return b"](" * (depth - 1) + b"]" + b"e" * (depth - 1)
    if kind == "dict":  # EMPTY_DICT MARK BININT1 0 ... SETITEMS
        return b"}(K\x00" * (depth - 1) + b"}" + b"u" * (depth - 1)
    return b"(" * depth + b"t" * depth  # MARK ... TUPLE


def nested_by_memo(depth):
    """Empty lists in the memo, each then appended to the one before it (already inside a list)."""
    index = lambda i: struct.pack("<i", i)
    text = b"".join(b"]r" + index(i) + b"0" for i in range(depth))
    text += b"".join(b"j" + index(i) + b"(j" + index(i + 1) + b"e0" for i in range(depth - 1))
    return text + b"j" + index(0)


def rewritten(zip_bytes, name, edit, deflate):
    """The archive with record `name` ("ddp_optimizer_state/data.pkl": inside a record) edited."""
    head, _, rest = name.partition("/")
    source = zipfile.ZipFile(io.BytesIO(zip_bytes))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as target:
        for info in source.infolist():
            data = source.read(info)
            method = zipfile.ZIP_STORED
            if info.filename.split("/", 1)[1] == head:
                data = rewritten(data, rest, edit, deflate) if rest else edit(data)
                method = zipfile.ZIP_DEFLATED if deflate and not rest else zipfile.ZIP_STORED
            entry = zipfile.ZipInfo(info.filename, date_time=(1980, 1, 1, 0, 0, 0))  # the same bytes every run
            target.writestr(entry, data, compress_type=method)
    return out.getvalue()


def insert_after(opening, value):
    return lambda pickle: pickle.replace(opening, opening + KEY + value, 1)


MODEL_DICT, OBJECT_DICT = b"}(", b")\x81}("
INPUTS = {
    # (record, edit, deflate): what crashed the loader with SIGSEGV before the depth bound
    "regression-deep-nesting-model-root": ("data.pkl", lambda p: b"\x80\x02" + nested("list", DEEP) + b".", True),
    "regression-deep-nesting-dict-value": ("data.pkl", insert_after(MODEL_DICT, nested("dict", DEEP)), True),
    "regression-deep-nesting-training-state":
        ("ddp_training_state/data.pkl", insert_after(OBJECT_DICT, nested("tuple", DEEP)), True),
    "regression-deep-nesting-optimizer":
        ("ddp_optimizer_state/data.pkl", insert_after(OBJECT_DICT, nested("list", DEEP)), True),
    # stored, small: starts for mutations around the checks. One level past the bound (the root
    # dict and 1000 lists), and lists filled after they went inside others (refused at the second
    # such APPEND, however deep; deflate does not shrink this one: 300,000 levels are 1.5 MB)
    "nesting-one-past-the-bound": ("data.pkl", insert_after(MODEL_DICT, nested("list", 1000)), False),
    "nesting-filled-after-nesting": ("data.pkl", insert_after(MODEL_DICT, nested_by_memo(100)), False),
    # a tensor placed on the meta device: LibTorch's NotImplementedError escaped load_checkpoint
    "regression-device-meta": ("ddp_devices", lambda d: d.replace(b"cpu linear.weight", b"meta linear.weight", 1), False),
}

if __name__ == "__main__":
    with open(os.path.join(CORPUS, "seed-checkpoint-adam-gradscaler"), "rb") as f:
        seed = f.read()
    for file_name, (record, edit, deflate) in INPUTS.items():
        data = rewritten(seed, record, edit, deflate)
        with open(os.path.join(CORPUS, file_name), "wb") as f:
            f.write(data)
        print(f"{file_name}: {len(data)} bytes")
