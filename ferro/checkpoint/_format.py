"""The files of a checkpoint: per-rank safetensors data files and the JSON metadata that commits them.

A checkpoint directory holds ``data-<save id>-r<rank>.safetensors`` files and one
``metadata.json``. The metadata is written last, under a temporary name, fsynced
and renamed into place: that rename is the commit. It names the save id, so data
files left by a save that died (or by the save this one replaced) are never read.
Every piece carries a CRC-32 per :data:`CHUNK_BYTES` of its bytes, so a load that
needs part of a piece verifies only the chunks it reads.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import re
import stat
import struct
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ferro.checkpoint._items import STORAGE_DTYPE, Path, dotted, numpy_name
from ferro.errors import CheckpointCorruptError, CheckpointError

__all__ = ["CHUNK_BYTES", "METADATA", "DataFile", "Metadata", "PieceMeta", "TensorMeta", "chunk_crcs",
           "open_regular", "read_metadata", "write_data_file", "write_metadata"]

FORMAT = "ferro.checkpoint"
VERSION = 1
METADATA = "metadata.json"
# Checksum granularity: small enough that a load reading part of a piece verifies little more than it reads,
# large enough that the metadata stays small (256 numbers per GiB).
CHUNK_BYTES = 4 << 20
_MAX_HEADER = 1 << 28
# A save id is a token of letters and digits (a save makes 12 hex digits); data file names are built from it.
_SAVE_ID = re.compile(r"[A-Za-z0-9]{1,64}")
_SHOWN_NAME_CHARS = 80  # of a file name the metadata gives: enough to recognise, not a dump of foreign text


def data_file_name(save_id: str, rank: int) -> str:
    """Return the data file name of one rank's part of one save."""
    return f"data-{save_id}-r{rank:05d}.safetensors"


def _check_file_name(name: str, save_id: str, world_size: int) -> None:
    """Refuse a data file name a save of ``save_id`` would not write: above all one that leaves the directory.

    Names come from ``metadata.json``, which anyone who can write the directory can edit: an absolute path,
    ``..`` or a separator would make a load read another job's checkpoint or any file on the machine.
    """
    if not any(name == data_file_name(save_id, rank) for rank in range(world_size)):
        shown = name[:_SHOWN_NAME_CHARS] + ("..." if len(name) > _SHOWN_NAME_CHARS else "")
        raise ValueError(f"data file name {shown!r} is not one this save writes (data-{save_id}-r<rank>.safetensors "
                         f"for a rank below {world_size}): a load reads only its own files inside the directory")


def open_regular(path: str) -> int:
    """Open ``path`` for reading, refusing what is not a regular file: a symlink, FIFO, device or directory.

    ``O_NOFOLLOW`` refuses a symlink (a save never writes one; it could point anywhere), and ``O_NONBLOCK``
    keeps ``open()`` itself from blocking forever on a FIFO no one writes; the type is then checked on the
    open descriptor, so it cannot change in between.

    Returns:
        The open file descriptor (the caller closes it).

    Raises:
        FileNotFoundError: Nothing is there.
        CheckpointCorruptError: Something is there, but it is not a regular file.

    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise  # the callers say what was missing
    except OSError as exc:  # ELOOP: a symlink; ENXIO: a socket or a device without a driver
        what = "a symlink" if os.path.islink(path) else f"not openable ({os.strerror(exc.errno or 0)})"
        raise CheckpointCorruptError(f"{path}: {what}, not a regular file; a load reads only the regular files a "
                                     f"save wrote") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else
                "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else
                "not a regular file")
        raise CheckpointCorruptError(f"{path}: {kind}, not a regular file; a load reads only the regular files a "
                                     f"save wrote")
    return fd


@dataclass
class PieceMeta:
    """Where elements ``[start, stop)`` of a tensor lie: a file, a byte offset in it, and their checksums."""

    start: int
    stop: int
    file: str
    offset: int
    crc32: list[int]


@dataclass
class TensorMeta:
    """A tensor of the checkpoint: its path, dtype code, global shape and pieces (covering it once)."""

    path: Path
    code: str
    shape: tuple[int, ...]
    pieces: list[PieceMeta] = field(default_factory=list)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return STORAGE_DTYPE[self.code].itemsize

    @property
    def numel(self) -> int:
        """Elements of the global tensor."""
        return math.prod(self.shape)


@dataclass
class Metadata:
    """A committed checkpoint's description (the contents of ``metadata.json``)."""

    save_id: str
    world_size: int
    chunk_bytes: int
    files: dict[str, int]
    tensors: dict[Path, TensorMeta]
    values: dict[Path, Any]

    def to_json(self) -> str:
        """Return the metadata as JSON text."""
        return json.dumps({
            "format": FORMAT, "version": VERSION, "save_id": self.save_id, "world_size": self.world_size,
            "chunk_bytes": self.chunk_bytes,
            "files": {name: {"size": size} for name, size in sorted(self.files.items())},
            "tensors": [{"path": list(t.path), "dtype": t.code, "shape": list(t.shape),
                         "pieces": [{"start": p.start, "stop": p.stop, "file": p.file, "offset": p.offset,
                                     "crc32": p.crc32} for p in t.pieces]} for t in self.tensors.values()],
            "values": [{"path": list(path), "value": json.loads(text)} for path, text in self.values.items()],
        }, indent=1)


def write_metadata(directory: str, metadata: Metadata) -> None:
    """Commit a checkpoint: write its metadata under a temporary name, fsync it, rename it into place."""
    temporary = os.path.join(directory, f".{METADATA}.{metadata.save_id}.tmp")
    with open(temporary, "w", encoding="utf-8") as f:
        f.write(metadata.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, os.path.join(directory, METADATA))
    fsync_directory(directory)


def fsync_directory(directory: str) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_metadata(directory: str) -> Metadata:
    """Read and check a checkpoint's metadata.

    Raises:
        CheckpointError: Nothing was committed at ``directory``.
        CheckpointCorruptError: The metadata is not what a save writes.

    """
    where = os.path.join(directory, METADATA)
    try:
        with open(open_regular(where), encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        if not os.path.isdir(directory):
            raise CheckpointError(f"no checkpoint at {directory}: the directory does not exist") from None
        raise CheckpointError(f"no committed checkpoint at {directory}: {METADATA} is missing (a save that did "
                              f"not finish leaves none)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointCorruptError(f"{where}: not valid JSON ({exc})") from None
    try:
        if raw["format"] != FORMAT:
            raise ValueError(f"format {raw['format']!r}")
        if raw["version"] != VERSION:
            raise ValueError(f"version {raw['version']} (this ferro reads version {VERSION})")
        save_id, world_size = raw["save_id"], int(raw["world_size"])
        if not isinstance(save_id, str) or not _SAVE_ID.fullmatch(save_id):
            raise ValueError("the save id is not a token of letters and digits")
        files = {str(name): int(entry["size"]) for name, entry in raw["files"].items()}
        for name in files:
            _check_file_name(name, save_id, world_size)
        tensors: dict[Path, TensorMeta] = {}
        for entry in raw["tensors"]:
            meta = TensorMeta(tuple(entry["path"]), str(entry["dtype"]), tuple(int(n) for n in entry["shape"]),
                              [PieceMeta(int(p["start"]), int(p["stop"]), str(p["file"]), int(p["offset"]),
                                         [int(c) for c in p["crc32"]]) for p in entry["pieces"]])
            if meta.code not in STORAGE_DTYPE:
                raise ValueError(f"{dotted(meta.path)} has unknown dtype {meta.code}")
            _check_cover(meta, files)
            tensors[meta.path] = meta
        values = {tuple(entry["path"]): json.dumps(entry["value"]) for entry in raw["values"]}
        return Metadata(save_id, world_size, int(raw["chunk_bytes"]), files, tensors, values)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointCorruptError(f"{where}: not a ferro checkpoint's metadata ({type(exc).__name__}: "
                                     f"{exc})") from None


def _check_cover(meta: TensorMeta, files: dict[str, int]) -> None:
    """Refuse metadata whose pieces do not cover the tensor exactly once, or that point outside their files."""
    position = 0
    for piece in sorted(meta.pieces, key=lambda p: p.start):
        if piece.start != position or piece.stop <= piece.start:
            raise ValueError(f"{dotted(meta.path)}: pieces do not cover it once (a piece starts at {piece.start}, "
                             f"expected {position})")
        if piece.file not in files:
            raise ValueError(f"{dotted(meta.path)}: a piece lies in {piece.file[:_SHOWN_NAME_CHARS]!r}, which the "
                             f"checkpoint does not list")
        position = piece.stop
    if position != meta.numel:
        raise ValueError(f"{dotted(meta.path)}: pieces cover {position} of {meta.numel} elements")


def chunk_crcs(data: np.ndarray, chunk_bytes: int = CHUNK_BYTES) -> list[int]:
    """Return the CRC-32 of each ``chunk_bytes`` of an array's bytes (zlib releases the GIL while it runs)."""
    view = data.reshape(-1).view(np.uint8).data
    return [zlib.crc32(view[i:i + chunk_bytes]) for i in range(0, len(view), chunk_bytes)]


def _safetensors() -> Any:
    try:
        import safetensors
        import safetensors.numpy
    except ImportError:
        raise CheckpointError("saving a checkpoint writes safetensors files, and the safetensors package is not "
                              "installed: pip install 'ferro[checkpoint]' (or pip install safetensors)") from None
    return safetensors


def write_data_file(directory: str, name: str, pieces: Iterable[tuple[str, str, np.ndarray]],
                    metadata: dict[str, str]) -> tuple[int, dict[str, int]]:
    """Write one rank's pieces as a safetensors file and fsync it.

    Args:
        directory: The checkpoint directory.
        name: The file's name in it.
        pieces: ``(tensor name, dtype code, 1-d values)``; the values are written without a copy.
        metadata: The file header's ``__metadata__`` strings.

    Returns:
        The file's size and each tensor's absolute byte offset in it.

    """
    safetensors = _safetensors()
    spec = safetensors.numpy.TensorSpec
    keep = []
    tensors = {}
    for tensor_name, code, values in pieces:
        keep.append(values)
        tensors[tensor_name] = spec(dtype=numpy_name(code), shape=values.shape, data_ptr=values.ctypes.data,
                                    data_len=values.nbytes)
    target = os.path.join(directory, name)
    safetensors.serialize_file(tensors, target, metadata=metadata)
    with open(target, "rb") as f:
        os.fsync(f.fileno())
        size = os.fstat(f.fileno()).st_size
        header, data_start = _read_header(f.read(8), f, target, size)
    del keep
    return size, {tensor_name: data_start + int(header[tensor_name]["data_offsets"][0]) for tensor_name in tensors}


def _read_header(prefix: bytes, f: Any, where: str, size: int) -> tuple[dict[str, Any], int]:
    if len(prefix) < 8:
        raise CheckpointCorruptError(f"{where}: truncated ({size} bytes, shorter than a safetensors header)")
    (length,) = struct.unpack("<Q", prefix)
    if length > min(size - 8, _MAX_HEADER):  # the length is foreign bytes: not shown
        raise CheckpointCorruptError(f"{where}: truncated or not a safetensors file (its first 8 bytes do not give "
                                     f"the length of a header that fits in its {size} bytes)")
    try:
        header = json.loads(f.read(length))
    except (ValueError, UnicodeDecodeError):
        raise CheckpointCorruptError(f"{where}: the safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise CheckpointCorruptError(f"{where}: the safetensors header is not a JSON object")
    return header, 8 + length


class DataFile:
    """A data file opened for reading: its size checked, its header's save id checked, its bytes memory-mapped."""

    def __init__(self, directory: str, name: str, size: int, save_id: str) -> None:
        self.path = os.path.join(directory, name)
        try:
            f = open(open_regular(self.path), "rb")
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{self.path}: missing (the checkpoint's metadata lists it)") from None
        with f:
            actual = os.fstat(f.fileno()).st_size
            if actual != size:
                raise CheckpointCorruptError(f"{self.path}: {actual} bytes, the checkpoint wrote {size} "
                                             f"({'truncated' if actual < size else 'grown'})")
            header, _ = _read_header(f.read(8), f, self.path, actual)
            written_by = header.get("__metadata__", {}).get("save_id")
            if written_by != save_id:
                raise CheckpointCorruptError(f"{self.path}: written by save {written_by!r}, the metadata is of save "
                                             f"{save_id!r}")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        self.bytes = np.frombuffer(self._map, np.uint8) if self._map is not None else np.empty(0, np.uint8)

    def close(self) -> None:
        """Unmap the file (views of it must be gone)."""
        self.bytes = np.empty(0, np.uint8)
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()


@dataclass
class ChunkCheck:
    """One checksummed chunk a load reads: which file, tensor and bytes, and the CRC it must have."""

    file: DataFile
    path: Path
    begin: int
    end: int
    crc32: int

    def verify(self) -> None:
        """Raise if the chunk's bytes differ from what was saved."""
        if zlib.crc32(self.file.bytes[self.begin:self.end].data) != self.crc32:
            raise CheckpointCorruptError(
                f"{self.file.path}: bytes {self.begin}-{self.end} of tensor {dotted(self.path)} fail their checksum "
                f"(the file changed after it was saved)")


def chunks_touched(file: DataFile, path: Path, piece: PieceMeta, itemsize: int, chunk_bytes: int,
                   first: int, last: int) -> Iterator[ChunkCheck]:
    """Yield the chunks of ``piece`` that hold its elements ``[first, last)`` (global element indices)."""
    low = (first - piece.start) * itemsize
    high = (last - piece.start) * itemsize
    length = (piece.stop - piece.start) * itemsize
    for index in range(low // chunk_bytes, (high + chunk_bytes - 1) // chunk_bytes):
        if index >= len(piece.crc32):
            raise CheckpointCorruptError(f"{file.path}: tensor {dotted(path)} lists {len(piece.crc32)} checksums "
                                         f"for {length} bytes")
        begin = piece.offset + index * chunk_bytes
        yield ChunkCheck(file, path, begin, min(begin + chunk_bytes, piece.offset + length), piece.crc32[index])
