"""``save``, ``async_save``, ``load`` and ``latest``: distributed checkpoints that reshard and commit atomically."""

from __future__ import annotations

import concurrent.futures
import os
import re
import secrets
import stat
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from ferro.backend.base import Backend
from ferro.checkpoint._format import (
    CHUNK_BYTES,
    METADATA,
    ChunkCheck,
    DataFile,
    Metadata,
    PieceMeta,
    TensorMeta,
    chunk_crcs,
    chunks_touched,
    data_file_name,
    read_metadata,
    write_data_file,
    write_metadata,
)
from ferro.checkpoint._items import STORAGE_DTYPE, Path, TensorItem, decode_value, dotted, flatten, put_values
from ferro.checkpoint._plan import Description, SavePlan, describe, plan_save
from ferro.collective import all_gather_object, broadcast_object
from ferro.collective.process_group import get_default_group, is_initialized, new_group
from ferro.errors import CheckpointCorruptError, CheckpointError

__all__ = ["async_save", "latest", "load", "read_tensors", "save", "step_path"]

_T = TypeVar("_T")
_STEP_DIR = re.compile(r"step_(\d+)")
_WRITER_THREAD = "ferro-checkpoint-writer"

# The async saves not yet committed, one per group at most (None: a single process). A save waits for the one
# before it, so commits happen in call order; the entry goes when its save ends. This is a registry of work in
# flight, not configuration: it is empty whenever no save is running.
_in_flight: dict[Backend | None, concurrent.futures.Future[str]] = {}
_in_flight_lock = threading.Lock()


def step_path(root: str | os.PathLike[str], step: int) -> str:
    """Return the directory of a run's checkpoint at ``step``: ``root/step_<step>`` (what :func:`latest` finds)."""
    return os.path.join(os.fspath(root), f"step_{int(step)}")


def save(state_dict: dict[Any, Any], path: str | os.PathLike[str], group: Backend | None = None, *,
         timeout: float | None = None) -> str:
    """Save a state dict from every rank of ``group`` into the checkpoint directory ``path``.

    Collective: every rank calls it with its own state dict. Values may be NumPy
    arrays, CPU torch tensors, FSDP :class:`~ferro.parallel.fsdp.ShardedEntry`
    pieces (``FSDP.sharded_state_dict()``), :class:`~ferro.dtensor.DTensor` pieces
    (Shard or Replicate; a Partial is refused) and plain values (numbers, strings,
    lists, tuples, dicts: the step, RNG and data-loader state). A tensor held by
    several ranks (replicated under DDP) is written once, by one of them; plain
    values must be equal on every rank that has them (give per-rank values
    per-rank keys).

    Each rank writes its pieces into its own safetensors file and fsyncs it; then
    rank 0 writes ``metadata.json`` and renames it into place. Until that rename
    the previous checkpoint at ``path`` (if any) is the one that loads; after it,
    the new one does. Saving into an existing checkpoint replaces it the same way.

    Args:
        state_dict: The nested state to save.
        path: The checkpoint directory (created if needed); see :func:`step_path`.
        group: The ranks saving together (default: the default group, or this process alone
            when there is none).
        timeout: Seconds each exchange between ranks may take (default: the group's).

    Returns:
        ``path``, once the checkpoint is committed.

    Raises:
        CheckpointError: A value that cannot be stored, ranks that disagree (naming the key and
            ranks), or a rank whose writing failed (naming it). Nothing is committed then.

    Example:
        Every rank runs::

            state = {"model": fsdp.sharded_state_dict(), "optim": fsdp.sharded_optim_state_dict(opt),
                     "step": step, "rng": rng.bit_generator.state if rank == 0 else None}
            ferro.checkpoint.save(state, ferro.checkpoint.step_path("ckpt", step))

    """
    group = _resolve(group)
    _wait_for_previous(group)
    job = _prepare(state_dict, os.fspath(path), group, timeout, stage=False)
    return job.write_and_commit(group)


def async_save(state_dict: dict[Any, Any], path: str | os.PathLike[str], group: Backend | None = None, *,
               timeout: float | None = None) -> concurrent.futures.Future[str]:
    """Save like :func:`save`, returning once this rank's share of the state is copied to staging memory.

    The copy is the blocking part: values changed after the call returns never
    reach the files. A background thread then writes and commits, over a group
    of its own (created here, collectively), so the caller's collectives carry
    on undisturbed. A second ``async_save`` (or ``save``, or ``load``) on the
    same group waits until this one has finished.

    Returns:
        A future whose ``result()`` is ``path`` once committed, or raises what the writers met.

    Example:
        Every rank runs::

            pending = ferro.checkpoint.async_save(state, step_path("ckpt", step))
            optimizer.step()          # safe: the checkpoint holds the values from before this line
            ...
            pending.result()          # before exit, or let the next save wait for it

    """
    group = _resolve(group)
    _wait_for_previous(group)
    job = _prepare(state_dict, os.fspath(path), group, timeout, stage=True)
    writers = None
    if group is not None and group.world_size > 1:
        writers = new_group(range(group.world_size), group, timeout=timeout)
    future: concurrent.futures.Future[str] = concurrent.futures.Future()
    future.set_running_or_notify_cancel()
    with _in_flight_lock:
        _in_flight[group] = future

    def write() -> None:
        try:
            future.set_result(job.write_and_commit(writers))
        except BaseException as exc:  # the future carries it to the caller
            future.set_exception(exc)
        finally:
            if writers is not None:
                writers.close()
            with _in_flight_lock:
                if _in_flight.get(group) is future:
                    del _in_flight[group]

    # Not a daemon: a rank whose main code ends still finishes (or fails) its save before the process exits.
    threading.Thread(target=write, name=_WRITER_THREAD).start()
    return future


def _resolve(group: Backend | None) -> Backend | None:
    if group is not None:
        return group
    return get_default_group() if is_initialized() else None


def _wait_for_previous(group: Backend | None) -> None:
    with _in_flight_lock:
        previous = _in_flight.get(group)
    if previous is not None:
        concurrent.futures.wait([previous])  # its own future reports its outcome


@dataclass
class _Piece:
    item: TensorItem
    name: str
    values: np.ndarray


class _SaveJob:
    """One rank's part of one save, planned: what it writes, and (on rank 0) what the metadata will say."""

    def __init__(self, directory: str, plan: SavePlan, rank: int, pieces: list[_Piece], timeout: float | None):
        self.directory = directory
        self.plan = plan
        self.rank = rank
        self.pieces = pieces
        self.timeout = timeout

    def write_and_commit(self, group: Backend | None) -> str:
        outcome: tuple[str, int, list[tuple[Path, int, int, int, list[int]]]] | str
        try:
            outcome = self._write()
        except Exception as exc:  # every rank must reach the exchange below, or the others would wait for it
            outcome = f"{type(exc).__name__}: {exc}"
        outcomes = [outcome] if group is None else all_gather_object(outcome, group=group, timeout=self.timeout)
        failed = [(rank, o) for rank, o in enumerate(outcomes) if isinstance(o, str)]
        if failed:
            rank, reason = failed[0]
            raise CheckpointError(f"save to {self.directory}: rank {rank} could not write its part ({reason}); "
                                  f"nothing was committed")
        verdict = ""
        if self.rank == 0:
            try:
                self._commit([o for o in outcomes if not isinstance(o, str)])
            except Exception as exc:
                verdict = f"{type(exc).__name__}: {exc}"
        if group is not None:
            verdict = broadcast_object(verdict, 0, group=group, timeout=self.timeout)
        if verdict:
            raise CheckpointError(f"save to {self.directory}: rank 0 could not commit the metadata ({verdict})")
        return self.directory

    def _write(self) -> tuple[str, int, list[tuple[Path, int, int, int, list[int]]]]:
        if not self.pieces:
            return "", 0, []
        name = data_file_name(self.plan.save_id, self.rank)
        with _pool(len(self.pieces)) as pool:
            crcs = pool.map(lambda piece: chunk_crcs(piece.values), self.pieces)
            size, offsets = write_data_file(
                self.directory, name, ((p.name, p.item.code, p.values) for p in self.pieces),
                {"format": "ferro.checkpoint", "save_id": self.plan.save_id, "rank": str(self.rank)})
            checksums = list(crcs)
        return name, size, [(p.item.path, p.item.start, p.item.stop, offsets[p.name], crc)
                            for p, crc in zip(self.pieces, checksums, strict=True)]

    def _commit(self, outcomes: list[tuple[str, int, list[tuple[Path, int, int, int, list[int]]]]]) -> None:
        plan = self.plan
        tensors = {path: TensorMeta(path, code, shape) for path, (code, shape) in plan.tensors.items()}
        files: dict[str, int] = {}
        for name, size, pieces in outcomes:
            if name:
                files[name] = size
            for path, start, stop, offset, crc in pieces:
                tensors[path].pieces.append(PieceMeta(start, stop, name, offset, crc))
        for meta in tensors.values():
            meta.pieces.sort(key=lambda p: p.start)
        write_metadata(self.directory, Metadata(plan.save_id, plan.world_size, CHUNK_BYTES, files, tensors,
                                                plan.values))
        _remove_stale_files(self.directory, files)


def _remove_stale_files(directory: str, keep: dict[str, int]) -> None:
    """Delete data files of earlier or failed saves into this directory (the new metadata names none of them)."""
    for name in os.listdir(directory):
        stale = (name.startswith("data-") and name.endswith(".safetensors")) or \
                (name.startswith(f".{METADATA}.") and name.endswith(".tmp"))
        if stale and name not in keep:
            try:
                os.remove(os.path.join(directory, name))
            except FileNotFoundError:
                pass


def _prepare(state_dict: dict[Any, Any], directory: str, group: Backend | None, timeout: float | None,
             stage: bool) -> _SaveJob:
    """Describe this rank's state, agree on a plan with the other ranks, and pick (or stage) what it writes."""
    rank = 0 if group is None else group.rank
    description: Description | str
    tensors: list[TensorItem] = []
    try:
        os.makedirs(directory, exist_ok=True)
        tensors, plain = flatten(state_dict, writable=False)
        description = describe(secrets.token_hex(6), tensors, plain)
    except Exception as exc:  # still take part in the exchange, so every rank hears why
        description = f"{type(exc).__name__}: {exc}"
    descriptions = [description] if group is None else all_gather_object(description, group=group,
                                                                          timeout=timeout)
    for other, described in enumerate(descriptions):
        if isinstance(described, str):
            raise CheckpointError(f"save to {directory}: rank {other} could not describe its state: {described}")
    plan = plan_save([d for d in descriptions if not isinstance(d, str)])
    pieces = []
    for item in tensors:
        if plan.writer.get((item.path, item.start, item.stop)) == rank:
            values = item.values.copy() if stage else item.values
            pieces.append(_Piece(item, f"{dotted(item.path)}[{item.start}:{item.stop}]", values))
    return _SaveJob(directory, plan, rank, pieces, timeout)


def _pool(tasks: int) -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1, tasks)),
                                                 thread_name_prefix="ferro-checkpoint-io")


# --- load ------------------------------------------------------------------------------------------------------

def load(state_dict: dict[Any, Any], path: str | os.PathLike[str], group: Backend | None = None, *,
         timeout: float | None = None) -> None:
    """Fill ``state_dict`` in place from the checkpoint at ``path``, whatever layout saved it.

    Allocate the target layout first (as torch's DCP asks): arrays and tensors
    are filled in place, FSDP sharded entries with this rank's range only; plain
    values are replaced in their containers. Any world size loads any other: each
    rank reads, memory-mapped, only the byte ranges its targets need, and checks
    each chunk it reads against its checksum. Keys in the checkpoint that the
    state dict lacks are ignored.

    Collective when there is a group: the ranks first check everything they will
    read, then agree; if any rank found a problem, every rank raises and nothing
    is written into any caller's state.

    Args:
        state_dict: The state to fill, laid out as this run wants it.
        path: A committed checkpoint directory.
        group: The ranks loading together (default: the default group, or this process alone).
        timeout: Seconds the agreement between ranks may take.

    Raises:
        CheckpointError: Nothing committed at ``path``; a key missing from it; a dtype or shape
            that differs (naming the tensor); another rank's failure (naming the rank).
        CheckpointCorruptError: A file missing, truncated, or failing its checksum (naming the file
            and the tensor).

    Example:
        Every rank of a job of any size runs::

            state = {"model": fsdp.sharded_state_dict(), "optim": fsdp.sharded_optim_state_dict(opt),
                     "step": 0}
            ferro.checkpoint.load(state, ferro.checkpoint.latest("ckpt"))
            fsdp.load_sharded_optim_state_dict(opt, state["optim"])

    """
    group = _resolve(group)
    _wait_for_previous(group)
    directory = os.fspath(path)
    reads = _Reads(directory)
    values: dict[Path, Any] = {}
    problem: CheckpointError | None = None
    try:
        metadata = read_metadata(directory)
        tensors, plain = flatten(state_dict, writable=True)
        reads.plan(metadata, tensors)
        for entry in plain:
            values[entry.path] = _saved_value(entry.path, metadata, directory)
        reads.verify()
    except CheckpointError as exc:
        problem = exc
    except Exception as exc:  # an unreadable file, a tensor that cannot be viewed: every rank must still agree
        problem = CheckpointError(f"load from {directory}: {type(exc).__name__}: {exc}")
        problem.__cause__ = exc
    try:
        if group is not None and group.world_size > 1:
            verdicts = all_gather_object(None if problem is None else f"{type(problem).__name__}: {problem}",
                                         group=group, timeout=timeout)
            failed = [(rank, v) for rank, v in enumerate(verdicts) if v]
            if failed and problem is None:
                rank, reason = failed[0]
                raise CheckpointError(f"load from {directory}: rank {rank} cannot load it ({reason}); nothing was "
                                      f"loaded on any rank")
        if problem is not None:
            raise problem
        reads.copy()
        put_values(state_dict, values)
    finally:
        reads.close()


def _saved_value(path: Path, metadata: Metadata, directory: str) -> Any:
    """Return the value saved at ``path``; plain values saved below it come back as a dict."""
    if path in metadata.values:
        return decode_value(metadata.values[path])
    below = {p[len(path):]: text for p, text in metadata.values.items() if p[:len(path)] == path}
    if not below or any(p[:len(path)] == path for p in metadata.tensors):
        raise CheckpointError(f"load from {directory}: {dotted(path)} is not in the checkpoint"
                              f"{_nearby(path, metadata)}" if not below else
                              f"load from {directory}: {dotted(path)} holds tensors in the checkpoint; allocate "
                              f"them in the state dict to load into")
    result: dict[Any, Any] = {}
    for rest, text in below.items():
        node = result
        for key in rest[:-1]:
            node = node.setdefault(key, {})
        node[rest[-1]] = decode_value(text)
    return result


def read_tensors(directory: str, metadata: Metadata, items: list[TensorItem]) -> None:
    """Fill ``items`` from the checkpoint (one process): plan the reads, verify every chunk, then copy."""
    reads = _Reads(directory)
    try:
        reads.plan(metadata, items)
        reads.verify()
        reads.copy()
    finally:
        reads.close()


class _Reads:
    """The byte ranges a load reads: the files it maps, the chunks it verifies, the copies it makes."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.files: dict[str, DataFile] = {}
        self.copies: list[tuple[np.ndarray, np.ndarray]] = []
        self.checks: list[ChunkCheck] = []

    def plan(self, metadata: Metadata, items: list[TensorItem]) -> None:
        for item in items:
            _plan_reads(item, metadata, self.directory, self.files, self.copies, self.checks)

    def verify(self) -> None:
        _run_all(ChunkCheck.verify, self.checks)

    def copy(self) -> None:
        _run_all(lambda pair: np.copyto(pair[0], pair[1]), self.copies)

    def close(self) -> None:
        self.copies.clear()
        self.checks.clear()
        for file in self.files.values():
            file.close()


def _plan_reads(item: TensorItem, metadata: Metadata, directory: str, files: dict[str, DataFile],
                copies: list[tuple[np.ndarray, np.ndarray]], checks: list[ChunkCheck]) -> None:
    """Add the copies and checksum checks that fill ``item`` from the pieces overlapping its range."""
    meta = metadata.tensors.get(item.path)
    if meta is None:
        raise CheckpointError(f"load from {directory}: {dotted(item.path)} is not in the checkpoint"
                              f"{_nearby(item.path, metadata)}")
    if meta.code != item.code or meta.shape != item.shape:
        raise CheckpointError(f"load from {directory}: {dotted(item.path)} is {meta.code} {list(meta.shape)} in "
                              f"the checkpoint, the state dict has {item.code} {list(item.shape)}")
    itemsize = STORAGE_DTYPE[meta.code].itemsize
    target = item.values.view(np.uint8)
    for piece in meta.pieces:
        first, last = max(piece.start, item.start), min(piece.stop, item.stop)
        if first >= last:
            continue
        if piece.file not in files:
            files[piece.file] = DataFile(directory, piece.file, metadata.files[piece.file], metadata.save_id)
        file = files[piece.file]
        end = piece.offset + (piece.stop - piece.start) * itemsize
        if end > file.bytes.size:
            raise CheckpointCorruptError(f"{file.path}: tensor {dotted(item.path)} ends at byte {end}, past the "
                                         f"file's end ({file.bytes.size})")
        checks.extend(chunks_touched(file, item.path, piece, itemsize, metadata.chunk_bytes, first, last))
        source = file.bytes[piece.offset + (first - piece.start) * itemsize:piece.offset + (last - piece.start)
                            * itemsize]
        destination = target[(first - item.start) * itemsize:(last - item.start) * itemsize]
        # Copies in chunk-sized parts, so the pool spreads one large tensor over its threads.
        for at in range(0, source.size, CHUNK_BYTES):
            copies.append((destination[at:at + CHUNK_BYTES], source[at:at + CHUNK_BYTES]))


def _nearby(path: Path, metadata: Metadata) -> str:
    names = sorted(dotted(p) for p in (*metadata.tensors, *metadata.values))
    prefix = dotted(path[:-1])
    similar = [n for n in names if n.startswith(prefix)][:5] or names[:5]
    return f" (it has {len(names)} entries, such as {', '.join(similar)})" if names else " (it is empty)"


def _run_all(task: Callable[[_T], object], items: Iterable[_T]) -> None:
    """Run ``task`` over ``items`` on a few threads (checksums and copies release the GIL); re-raise the first error."""
    items = list(items)
    if len(items) <= 1:
        for item in items:
            task(item)
        return
    with _pool(len(items)) as pool:
        for _ in pool.map(task, items):
            pass


# --- finding checkpoints ---------------------------------------------------------------------------------------

def latest(root: str | os.PathLike[str]) -> str | None:
    """Return the highest-numbered committed ``root/step_<N>`` checkpoint, or None if there is none.

    Committed means its metadata is in place and complete and every data file it
    lists exists at its recorded size (contents are checked when it is loaded).
    Directories of saves that died before their commit are passed over.
    """
    root = os.fspath(root)
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return None
    steps = sorted(((int(m.group(1)), name) for name in names if (m := _STEP_DIR.fullmatch(name))), reverse=True)
    for _, name in steps:
        candidate = os.path.join(root, name)
        if _is_committed(candidate):
            return candidate
    return None


def _is_committed(directory: str) -> bool:
    try:
        metadata = read_metadata(directory)
    except CheckpointError:
        return False
    for name, size in metadata.files.items():
        try:
            found = os.lstat(os.path.join(directory, name))  # a symlink or FIFO is no file a save wrote
        except OSError:
            return False
        if not stat.S_ISREG(found.st_mode) or found.st_size != size:
            return False
    return True
