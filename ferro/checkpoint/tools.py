"""Looking into a checkpoint and turning it into one file: what ``ferro ckpt inspect`` and ``consolidate`` run."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ferro.checkpoint._format import read_metadata, write_data_file
from ferro.checkpoint._items import STORAGE_DTYPE, TensorItem, decode_value, dotted
from ferro.checkpoint.api import read_tensors

__all__ = ["TensorSummary", "consolidate", "format_inspection", "inspect"]


@dataclass
class TensorSummary:
    """One tensor of a checkpoint: its name, dtype code, shape, bytes, and the files its pieces lie in."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    files: list[str]


def inspect(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Describe a committed checkpoint without reading its data.

    Returns:
        ``{"path", "save_id", "world_size", "tensors": [TensorSummary], "values": {name: value},
        "files": {name: size}, "total_bytes"}``.

    Raises:
        CheckpointError: Nothing committed at ``path``.

    """
    directory = os.fspath(path)
    metadata = read_metadata(directory)
    tensors = [TensorSummary(dotted(meta.path), meta.code, meta.shape, meta.numel * meta.itemsize,
                             sorted({piece.file for piece in meta.pieces}))
               for meta in metadata.tensors.values()]
    return {"path": directory, "save_id": metadata.save_id, "world_size": metadata.world_size,
            "tensors": tensors, "values": {dotted(p): decode_value(v) for p, v in metadata.values.items()},
            "files": dict(metadata.files), "total_bytes": sum(metadata.files.values())}


def consolidate(path: str | os.PathLike[str], out: str | os.PathLike[str]) -> str:
    """Write every tensor of a checkpoint, whole, into one safetensors file that other tools load.

    Tensors are named by their dotted path (``model.fc.weight``); the plain values go
    into the file's ``__metadata__`` as JSON under ``"ferro.values"``. Every chunk read
    is checked against its checksum.

    Returns:
        The output file's path.

    Raises:
        CheckpointError: Nothing committed at ``path``.
        CheckpointCorruptError: A data file missing, truncated or failing its checksum.

    """
    directory = os.fspath(path)
    metadata = read_metadata(directory)
    items = [TensorItem(meta.path, meta.code, meta.shape, 0, meta.numel,
                        np.empty(meta.numel, STORAGE_DTYPE[meta.code])) for meta in metadata.tensors.values()]
    read_tensors(directory, metadata, items)
    values = {dotted(p): json.loads(v) for p, v in metadata.values.items()}
    target = os.path.abspath(os.fspath(out))
    write_data_file(os.path.dirname(target), os.path.basename(target),
                    [(dotted(item.path), item.code, item.values.reshape(item.shape)) for item in items],
                    {"format": "ferro.checkpoint.consolidated", "ferro.values": json.dumps(values)})
    return target


def format_inspection(info: dict[str, Any]) -> str:
    """Return :func:`inspect`'s result as the table ``ferro ckpt inspect`` prints."""
    rows = [(t.name, t.dtype, "x".join(map(str, t.shape)) or "scalar", _size(t.nbytes), ", ".join(t.files))
            for t in info["tensors"]]
    header = ("tensor", "dtype", "shape", "size", "files")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(4)]
    lines = [f"checkpoint {info['path']} (save {info['save_id']}, {info['world_size']} ranks, "
             f"{len(info['files'])} files, {_size(info['total_bytes'])})", ""]
    for row in [header, *rows]:
        lines.append("  ".join(str(cell).ljust(width) for cell, width in zip(row[:4], widths, strict=True))
                     + "  " + row[4])
    if info["values"]:
        lines += ["", "values:"]
        lines += [f"  {name} = {json.dumps(value)[:100]}" for name, value in info["values"].items()]
    return "\n".join(lines)


def _size(nbytes: int) -> str:
    if nbytes < 1024:
        return f"{nbytes} B"
    scale = min(3, (nbytes.bit_length() - 1) // 10)
    return f"{nbytes / (1 << 10 * scale):.1f} {('KiB', 'MiB', 'GiB')[scale - 1]}"
