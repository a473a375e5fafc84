"""Weights from a local Hugging Face checkpoint folder (``config.json`` + ``*.safetensors``).

The safetensors format is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw bytes; it is read here with NumPy alone
(bf16 widened to float32), so no extra package is needed. Nothing is ever downloaded.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from .config import ModelConfig, config_from_hf

__all__ = ["load_checkpoint", "read_safetensors", "write_safetensors"]

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
           "I64": np.int64, "I32": np.int32}


def read_safetensors(path) -> dict[str, np.ndarray]:
    """Every tensor of one ``.safetensors`` file as a NumPy array (bf16 as float32)."""
    data = Path(path).read_bytes()
    if len(data) < 8:
        raise ValueError(f"{path}: not a safetensors file (shorter than its header length)")
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
        raise ValueError(f"{path}: header of {n} bytes runs past the end of the file")
    header = json.loads(data[8:8 + n])
    body = memoryview(data)[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        arr = np.frombuffer(body[start:end], dtype=_DTYPES[info["dtype"]])
        if info["dtype"] == "BF16":  # the top half of a float32
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = arr.reshape(info["shape"])
    return out


def write_safetensors(path, tensors: dict) -> None:
    """Write ``tensors`` (name -> float64/32/16 array) as a ``.safetensors`` file (for tests
    and for saving random weights to try the loader)."""
    names = {np.dtype(v): k for k, v in _DTYPES.items() if k != "BF16"}
    header, blobs, pos = {}, [], 0
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        blob = arr.tobytes()
        header[name] = {"dtype": names[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [pos, pos + len(blob)]}
        blobs.append(blob)
        pos += len(blob)
    head = json.dumps(header).encode()
    Path(path).write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def load_checkpoint(folder) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """``(config, weights)`` of a checkpoint folder holding ``config.json`` and one or more
    ``.safetensors`` files (Llama or Qwen2 names)."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"checkpoint {folder}: no config.json")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"checkpoint {folder}: no .safetensors file")
    cfg = config_from_hf(folder / "config.json")
    weights = {}
    for f in files:
        weights.update(read_safetensors(f))
    return cfg, weights
