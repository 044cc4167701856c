"""Data between the grading process and the worker: `.npy` arrays and small JSON, never pickle.

What the worker writes is untrusted: a file is read only if neither it nor its folder is a
symbolic link and it is a regular file, its size is checked before it is read, and an array's
header (a plain numeric dtype, never objects; its shape) is checked before its values are read
as raw bytes. Anything malformed raises `WireError`.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from autograde.cases import Inputs
from autograde.observe import WIDENED, OtherValue, TensorValue

MAX_JSON_BYTES = 4 * 2**20
MAX_ARRAY_BYTES = 256 * 2**20
ARRAY_KINDS = "biuf"  # bool, signed and unsigned integers, floats


class WireError(Exception):
    pass


def entries(message: dict, key: str) -> list:
    """`message[key]`, a list (empty if absent)."""
    found = message.get(key, [])
    if not isinstance(found, list):
        raise WireError(f"{key} is malformed")
    return found


def strings(item: Any, count: int) -> list[str]:
    """`item`, a list of `count` strings or ints, as bounded strings."""
    if not (isinstance(item, list) and len(item) == count and all(isinstance(x, (str, int)) for x in item)):
        raise WireError("an entry is malformed")
    return [str(x)[:2000] for x in item]


def write_json(path: Path, data: Any) -> None:
    """Written whole, then renamed, so that a reader never sees half a file."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(data))
    partial.replace(path)


def _open_regular(path: Path):
    """`path` opened for reading without following a link in its name or its folder's; a regular file."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        folder = os.open(path.parent, flags | os.O_DIRECTORY)
        try:
            descriptor = os.open(path.name, flags, dir_fd=folder)
        finally:
            os.close(folder)
    except OSError as exc:
        raise WireError(f"{path.name} cannot be opened ({exc.strerror})") from None
    file = os.fdopen(descriptor, "rb")
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        file.close()
        raise WireError(f"{path.name} is not a regular file")
    return file


def read_bytes(path: Path, limit: int) -> bytes:
    """The whole file, at most `limit` bytes, opened as `_open_regular` does."""
    with _open_regular(path) as file:
        if os.fstat(file.fileno()).st_size > limit:
            raise WireError(f"{path.name} is larger than {limit} bytes")
        return file.read(limit + 1)[:limit]


def read_json(path: Path) -> Any:
    try:
        return json.loads(read_bytes(path, MAX_JSON_BYTES).decode("utf-8"))
    except ValueError as exc:  # not UTF-8, not JSON, or a number too long to read
        raise WireError(f"{path.name} is not valid JSON: {exc}") from None


# Arrays travel as .npy files (format 1.0) in C order, their header as numpy writes it, which
# `read_array` parses alone: numpy's own reader evaluates the header as a Python literal (about
# 0.1 ms of an array's 0.2 ms), and `np.save` rebuilds it through repr (most of 0.25 ms).
_NPY_PREAMBLE = b"\x93NUMPY\x01\x00"
_NPY_HEADER = re.compile(rb"\{'descr': '([<>|][biuf][1-8])', 'fortran_order': False, "
                         rb"'shape': \((|[0-9]{1,12},|[0-9]{1,12}(?:, [0-9]{1,12}){1,15})\), \} *\n")


def npy_header(array: np.ndarray) -> bytes:
    """The preamble and header of a C-ordered `array`'s .npy file, byte for byte as `np.save` writes them."""
    header = "{'descr': '%s', 'fortran_order': False, 'shape': %r, }" % (array.dtype.str, array.shape)
    header += " " * (21 - len(str(array.shape[0])) if array.shape else 0)  # numpy's room to grow the first axis
    padding = -(len(_NPY_PREAMBLE) + 2 + len(header) + 1) % 64
    text = f"{header}{' ' * padding}\n".encode("latin1")
    return _NPY_PREAMBLE + len(text).to_bytes(2, "little") + text


def read_array(path: Path, budget: "_Budget | None" = None) -> np.ndarray:
    """The array of an `.npy` file. The header is read and checked first: a plain numeric dtype, C
    order, at most 16 axes, and that the file's size agrees with it; the values are read only if
    `budget` allows them, and into an array directly."""
    with _open_regular(path) as file:
        preamble = file.read(len(_NPY_PREAMBLE) + 2)
        match = None
        if preamble[:-2] == _NPY_PREAMBLE and len(preamble) == len(_NPY_PREAMBLE) + 2:
            match = _NPY_HEADER.fullmatch(file.read(int.from_bytes(preamble[-2:], "little")))
        if match is None:
            raise WireError(f"{path.name} is not an .npy array in C order, or holds what is not a plain numeric dtype")
        dtype = np.dtype(match[1].decode())
        shape = tuple(int(n) for n in match[2].split(b",") if n.strip())
        size = math.prod(shape) * dtype.itemsize
        if file.tell() + size != os.fstat(file.fileno()).st_size or size > MAX_ARRAY_BYTES:
            raise WireError(f"{path.name}: its size does not match its header, or is over the limit")
        if budget is not None:
            budget.take(size)
        values = bytearray(size)
        if file.readinto(values) != size:
            raise WireError(f"{path.name} changed while it was read")
    return np.frombuffer(values, dtype=dtype).reshape(shape)


# Calls: the trusted process sends a call's arguments, the worker sends back what it returned.

MAX_DEPTH = 6
MAX_ITEMS = 256
MAX_ARRAYS_PER_REPLY = 128
MAX_BYTES_PER_REPLY = 512 * 2**20


def save_array(folder: int | None, name: str | Path, array: np.ndarray) -> None:
    """A new .npy file `name` in the folder open as `folder` (None: `name` is a path): never
    through a link, never over a file."""
    array = array if array.flags.c_contiguous else array.copy(order="C")
    descriptor = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=folder)
    with os.fdopen(descriptor, "wb") as file:
        file.write(npy_header(array))
        array.tofile(file)


def encode_arguments(value: Any, folder: int, names: Iterator[str], depth: int = 0) -> Any:
    """Arguments (tensors, plain values, Inputs, and dicts, lists and tuples of them) as JSON and
    .npy files in the folder open as `folder` (a descriptor: the worker may move the folder's name)."""
    if depth > MAX_DEPTH:
        raise ValueError("arguments nested too deeply")
    if isinstance(value, torch.Tensor):
        name = f"{next(names)}.npy"
        tensor = value.detach().cpu()
        save_array(folder, name, tensor.to(WIDENED.get(tensor.dtype, tensor.dtype)).numpy())
        return {"tensor": name, "dtype": str(tensor.dtype), "grad": value.requires_grad}
    if isinstance(value, Inputs):
        return {"inputs": encode_arguments(dict(value.values), folder, names, depth + 1), "note": value.note}
    if isinstance(value, dict):
        return {"dict": [[key, encode_arguments(item, folder, names, depth + 1)] for key, item in value.items()]}
    if isinstance(value, (list, tuple)):
        kind = "list" if isinstance(value, list) else "tuple"
        return {kind: [encode_arguments(item, folder, names, depth + 1) for item in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise TypeError(f"cannot send a {type(value).__name__} to the submission")


def decode_arguments(encoded: Any, folder: Path) -> Any:
    """In the worker: the arguments as torch tensors and plain values (they come from the trusted process)."""
    if "tensor" in encoded:
        tensor = torch.from_numpy(read_array(folder / encoded["tensor"]))
        dtype = getattr(torch, encoded["dtype"].removeprefix("torch."))
        return tensor.to(dtype).requires_grad_(encoded["grad"])
    if "inputs" in encoded:
        return Inputs(decode_arguments(encoded["inputs"], folder), encoded["note"])
    if "dict" in encoded:
        return {key: decode_arguments(item, folder) for key, item in encoded["dict"]}
    if "list" in encoded:
        return [decode_arguments(item, folder) for item in encoded["list"]]
    if "tuple" in encoded:
        return tuple(decode_arguments(item, folder) for item in encoded["tuple"])
    return encoded["value"]


def encode_result(observed: Any, folder: Path, names: Iterator[str]) -> Any:
    """In the worker: an observation (`observe.observe`) as JSON and .npy files."""
    if isinstance(observed, TensorValue):
        name = f"{next(names)}.npy"
        save_array(None, folder / name, observed.array)
        return {"tensor": name, "dtype": observed.dtype, "device": observed.device}
    if isinstance(observed, OtherValue):
        return {"other": observed.type_name}
    if isinstance(observed, dict):
        return {"dict": [[key, encode_result(item, folder, names)] for key, item in observed.items()]}
    if isinstance(observed, (list, tuple)):
        return {"list" if isinstance(observed, list) else "tuple": [encode_result(i, folder, names) for i in observed]}
    return {"value": observed}


def _text(value: Any, limit: int = 2000) -> str:
    if not isinstance(value, str):
        raise WireError(f"expected text, found {type(value).__name__}")
    return value[:limit]


class _Budget:
    """What one reply may make the trusted process read: a number of arrays and of bytes."""

    def __init__(self):
        self.arrays, self.bytes = MAX_ARRAYS_PER_REPLY, MAX_BYTES_PER_REPLY

    def take(self, size: int) -> None:
        self.arrays -= 1
        self.bytes -= size
        if self.arrays < 0 or self.bytes < 0:
            raise WireError(f"a reply names more than {MAX_ARRAYS_PER_REPLY} arrays or "
                            f"{MAX_BYTES_PER_REPLY // 2**20} MiB")


# The dtype an array travels as, for each dtype a tensor may claim to have had.
_CARRIED = {"torch.bfloat16": np.dtype("float32")}


def _tensor_value(item: dict, folder: Path, budget: _Budget) -> TensorValue:
    name = _text(item.get("tensor"), 200)
    if Path(name).name != name or not name.endswith(".npy"):
        raise WireError("a result names a file outside the result folder")
    array = read_array(folder / name, budget)
    claimed = _text(item.get("dtype"), 40)
    # The header says what the array holds; a label is believed only where numpy has no such dtype.
    carried = claimed in _CARRIED and _CARRIED[claimed] == array.dtype
    actual = claimed if carried else f"torch.{_TORCH_NAMES.get(array.dtype.str[1:], array.dtype.name)}"
    return TensorValue(array.shape, actual, _text(item.get("device"), 40), array)


_TORCH_NAMES = {"b1": "bool", "f2": "float16", "f4": "float32", "f8": "float64", "i1": "int8", "i2": "int16",
                "i4": "int32", "i8": "int64", "u1": "uint8"}


# The keys of each kind of encoded result; anything else is refused.
_RESULT_KEYS = {frozenset({"tensor", "dtype", "device"}), frozenset({"other"}), frozenset({"value"}),
                frozenset({"dict"}), frozenset({"list"}), frozenset({"tuple"})}


def decode_result(encoded: Any, folder: Path, budget: _Budget | None = None, depth: int = 0) -> Any:
    """In the trusted process: what the worker says a call returned, checked as it is read."""
    budget = budget or _Budget()
    if depth > MAX_DEPTH or not isinstance(encoded, dict) or frozenset(encoded) not in _RESULT_KEYS:
        raise WireError("a result is malformed")
    if "tensor" in encoded:
        return _tensor_value(encoded, folder, budget)
    if "other" in encoded:
        return OtherValue(_text(encoded["other"], 200))
    if "value" in encoded:
        value = encoded["value"]
        if value is None or isinstance(value, (bool, int, float)):
            return value
        return _text(value)
    for kind in ("dict", "list", "tuple"):
        items = encoded.get(kind)
        if items is None:
            continue
        if not isinstance(items, list) or len(items) > MAX_ITEMS:
            raise WireError(f"a result's {kind} is malformed or too long")
        if kind == "dict":
            if not all(isinstance(pair, list) and len(pair) == 2 for pair in items):
                raise WireError("a result's dict is malformed")
            return {_text(key, 200): decode_result(item, folder, budget, depth + 1) for key, item in items}
        decoded = [decode_result(item, folder, budget, depth + 1) for item in items]
        return decoded if kind == "list" else tuple(decoded)
    raise WireError("a result is malformed")


# The call channel: one JSON object per line over a Unix socket.

MAX_MESSAGE_BYTES = 4 * 2**20


def send_message(channel, message: dict) -> None:
    channel.sendall(json.dumps(message).encode() + b"\n")


class MessageReader:
    """Lines from an untrusted peer: each at most MAX_MESSAGE_BYTES, each a JSON object."""

    def __init__(self, channel):
        self.channel = channel
        self.pending = b""

    def read(self) -> dict | None:
        """The next message, or None when the peer has closed the channel (`socket.timeout` passes up)."""
        while b"\n" not in self.pending:
            if len(self.pending) > MAX_MESSAGE_BYTES:
                raise WireError("a message is too long")
            chunk = self.channel.recv(65536)
            if not chunk:
                return None
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        try:
            message = json.loads(line.decode("utf-8"))
        except ValueError as exc:
            raise WireError(f"a message is not valid JSON: {exc}") from None
        if not isinstance(message, dict):
            raise WireError("a message is not an object")
        return message
