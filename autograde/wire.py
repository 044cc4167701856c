"""Data between the grading process and the worker: `.npy` arrays and small JSON, never pickle.

What the worker writes is untrusted: a file is read only if neither it nor its folder is a
symbolic link and it is a regular file, its size is checked before it is read, an array's
header (dtype, shape) is checked before its values are loaded, and `numpy.load` runs with
`allow_pickle=False`. Anything malformed raises `WireError`.
"""

from __future__ import annotations

import io
import json
import math
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np
import torch

from autograde.cases import Inputs
from autograde.observe import Failure, OtherValue, TensorValue

MAX_JSON_BYTES = 4 * 2**20
MAX_ARRAY_BYTES = 256 * 2**20
ARRAY_KINDS = "biuf"  # bool, signed and unsigned integers, floats


class WireError(Exception):
    pass


def write_json(path: Path, data: Any) -> None:
    """Written whole, then renamed, so that a reader never sees half a file."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(data))
    partial.replace(path)


def read_bytes(path: Path, limit: int) -> bytes:
    """The whole file, opened without following a link in its name or its folder's."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        folder = os.open(path.parent, flags | os.O_DIRECTORY)
        try:
            descriptor = os.open(path.name, flags, dir_fd=folder)
        finally:
            os.close(folder)
    except OSError as exc:
        raise WireError(f"{path.name} cannot be opened ({exc.strerror})") from None
    with os.fdopen(descriptor, "rb") as file:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise WireError(f"{path.name} is not a regular file")
        if status.st_size > limit:
            raise WireError(f"{path.name} is larger than {limit} bytes")
        return file.read(limit + 1)[:limit]


def read_json(path: Path) -> Any:
    try:
        return json.loads(read_bytes(path, MAX_JSON_BYTES).decode("utf-8"))
    except ValueError as exc:  # not UTF-8, not JSON, or a number too long to read
        raise WireError(f"{path.name} is not valid JSON: {exc}") from None


def _npy(path: Path) -> tuple[tuple[int, ...], np.dtype, bytes]:
    """Shape, dtype and bytes of an `.npy` file, after checking its size agrees with them."""
    data = read_bytes(path, MAX_ARRAY_BYTES)
    file = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(file)
        reader = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
        shape, _, dtype = reader[version](file, max_header_size=10_000)
    except (ValueError, KeyError, EOFError) as exc:
        raise WireError(f"{path.name} is not an .npy array: {exc}") from None
    if dtype.kind not in ARRAY_KINDS or dtype.hasobject or len(shape) > 16:
        raise WireError(f"{path.name} holds dtype {dtype}, which is not a plain numeric dtype")
    if file.tell() + math.prod(shape) * dtype.itemsize != len(data):
        raise WireError(f"{path.name}: its size does not match its header")
    return tuple(shape), dtype, data


def read_header(path: Path) -> tuple[tuple[int, ...], np.dtype]:
    shape, dtype, _ = _npy(path)
    return shape, dtype


def _load(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def read_array(path: Path) -> np.ndarray:
    return _load(_npy(path)[2])


# Inputs: trusted process -> worker.

def encode_inputs(inputs: Inputs, folder: Path, prefix: str) -> dict:
    encoded = {}
    for index, (key, value) in enumerate(inputs.values.items()):
        if isinstance(value, torch.Tensor):
            name = f"{prefix}-{index}.npy"
            np.save(folder / name, value.detach().cpu().numpy(), allow_pickle=False)
            encoded[key] = {"tensor": name}
        else:
            encoded[key] = {"value": value}
    return encoded


def decode_inputs(encoded: dict, folder: Path) -> Inputs:
    return Inputs({
        key: torch.from_numpy(read_array(folder / item["tensor"])) if "tensor" in item else item["value"]
        for key, item in encoded.items()
    })


# Observations: worker -> trusted process.

def encode_observations(observed: dict | Failure, folder: Path, prefix: str) -> dict:
    if isinstance(observed, Failure):
        return {"failure": [observed.kind, observed.type_name, observed.message, observed.where]}
    encoded = {}
    for index, (key, value) in enumerate(observed.items()):
        if isinstance(value, TensorValue):
            name = f"{prefix}-{index}.npy"
            np.save(folder / name, value.array, allow_pickle=False)
            encoded[key] = {"tensor": name, "dtype": value.dtype, "device": value.device}
        elif isinstance(value, OtherValue):
            encoded[key] = {"other": value.type_name}
        else:
            encoded[key] = {"value": value}
    return {"outputs": encoded}


def _text(value: Any, limit: int = 2000) -> str:
    if not isinstance(value, str):
        raise WireError(f"expected text, found {type(value).__name__}")
    return value[:limit]


def decode_observations(encoded: Any, folder: Path, expected: dict) -> dict | Failure:
    """The worker's observations of one case; arrays are read only where their shape is the expected one."""
    if not isinstance(encoded, dict):
        raise WireError("a case result is not an object")
    if "failure" in encoded:
        failure = encoded["failure"]
        if not (isinstance(failure, list) and len(failure) == 4):
            raise WireError("a failure is malformed")
        return Failure(*(_text(part) for part in failure))
    outputs = encoded.get("outputs")
    if not isinstance(outputs, dict):
        raise WireError("a case result has no outputs")
    observed: dict[str, Any] = {}
    for key, item in outputs.items():
        if not isinstance(item, dict) or len(item) not in (1, 3):
            raise WireError(f"output {key!r} is malformed")
        if "tensor" in item:
            name = _text(item["tensor"])
            if Path(name).name != name or not name.endswith(".npy"):
                raise WireError(f"output {key!r} names a file outside the result folder")
            shape, _, data = _npy(folder / name)
            want = expected.get(key)
            array = _load(data) if isinstance(want, TensorValue) and shape == want.shape else None
            observed[key] = TensorValue(shape, _text(item["dtype"], 40), _text(item["device"], 40), array)
        elif "other" in item:
            observed[key] = OtherValue(_text(item["other"], 200))
        elif "value" in item and (item["value"] is None or isinstance(item["value"], (bool, int, float, str))):
            observed[key] = item["value"]
        else:
            raise WireError(f"output {key!r} is malformed")
    return observed
