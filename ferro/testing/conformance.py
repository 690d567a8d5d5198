"""A conformance suite for backends: every collective, op, dtype and shape against a NumPy reference.

Run :func:`check_collectives` on every rank of a group (through
:func:`~ferro.testing.run_processes` or :func:`~ferro.testing.run_threads`). Each
rank builds every rank's input from a seed, so it can compute the reference
result locally, runs the collective, and compares. The returned
:class:`ConformanceReport` lists the failures and a digest of every result, so
the caller can also check that all ranks got identical bytes.

Example::

    reports = run_threads(check_collectives, 4)
    assert all(not r.failures for r in reports)
    assert len({r.digest for r in reports}) == 1   # allreduce results identical everywhere
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

import ferro
from ferro.backend.base import Backend
from ferro.collective import ReduceOp

__all__ = ["ConformanceReport", "check_collectives", "conformance_dtypes"]

SHAPES: list[tuple[int, ...]] = [(), (0,), (1,), (7,), (13, 3), (20_011,)]
FLOAT_OPS = [ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]
INT_OPS = [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR]


@dataclass
class ConformanceReport:
    """What one rank saw.

    Attributes:
        rank: The rank.
        cases: Number of collective calls checked.
        failures: One line per result that differed from the reference.
        digests: A digest of every allreduce/all_gather result, in call order; equal across ranks
            when results are identical bit for bit.

    """

    rank: int
    cases: int = 0
    failures: list[str] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)

    @property
    def digest(self) -> str:
        """One digest over all the per-result digests."""
        return hashlib.sha256("".join(self.digests).encode()).hexdigest()


def conformance_dtypes() -> list[np.dtype]:
    """Return the dtypes checked: every reducible NumPy dtype, and bfloat16 when ml_dtypes is installed."""
    names = ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8"]
    dtypes = [np.dtype(n) for n in names]
    try:
        import ml_dtypes

        dtypes.insert(1, np.dtype(ml_dtypes.bfloat16))
    except ImportError:
        pass
    return dtypes


def _input(dtype: np.dtype, shape: tuple[int, ...], rank: int, case: int, op: ReduceOp | None) -> np.ndarray:
    rng = np.random.default_rng([case, rank])
    size = int(np.prod(shape, dtype=np.int64))
    values: np.ndarray
    if dtype.kind == "f" or dtype.name == "bfloat16":
        if op is ReduceOp.PRODUCT:
            values = rng.uniform(0.5, 1.5, size)
        else:
            values = rng.uniform(-4, 4, size).round(2)
    elif op is ReduceOp.PRODUCT:
        values = rng.integers(-2, 3, size) if dtype.kind == "i" else rng.integers(0, 3, size)
    else:
        info = np.iinfo(dtype)
        values = rng.integers(max(info.min, -100), min(info.max, 100) + 1, size)
    return values.astype(dtype).reshape(shape)


def _reference(inputs: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    stack = np.stack(inputs)
    dtype = inputs[0].dtype
    if dtype.kind == "f" or dtype.name == "bfloat16":
        wide = stack.astype(np.float64)
        result = {ReduceOp.SUM: wide.sum(0), ReduceOp.MEAN: wide.mean(0), ReduceOp.PRODUCT: wide.prod(0),
                  ReduceOp.MIN: wide.min(0), ReduceOp.MAX: wide.max(0)}[op]
        return result  # compared with a tolerance
    if op is ReduceOp.SUM:
        return stack.sum(0, dtype=dtype)
    if op is ReduceOp.PRODUCT:
        return stack.prod(0, dtype=dtype)
    if op is ReduceOp.MIN:
        return stack.min(0)
    if op is ReduceOp.MAX:
        return stack.max(0)
    fold = {ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor}[op]
    return fold.reduce(stack, axis=0)


def _close(actual: np.ndarray, expected: np.ndarray, inputs: list[np.ndarray], op: ReduceOp) -> bool:
    if actual.shape != expected.shape:
        return False
    dtype = actual.dtype
    if not (dtype.kind == "f" or dtype.name == "bfloat16") or op in (ReduceOp.MIN, ReduceOp.MAX):
        return bool(np.array_equal(actual.astype(np.float64) if dtype.name == "bfloat16" else actual,
                                   expected.astype(actual.dtype).astype(np.float64) if dtype.name == "bfloat16"
                                   else expected.astype(actual.dtype)))
    # Each pairwise step rounds to the dtype: allow a few units of its precision per rank.
    eps = {"float16": 1e-3, "bfloat16": 8e-3, "float32": 1.2e-7, "float64": 2.3e-16}[dtype.name]
    scale = np.abs(np.stack(inputs).astype(np.float64)).sum(0) if op is not ReduceOp.PRODUCT else np.abs(expected)
    if op is ReduceOp.MEAN:
        scale = scale / len(inputs)
    tolerance = 4 * len(inputs) * eps * (scale + 1e-30) + (6e-8 if dtype.name == "float16" else 0)
    return bool(np.all(np.abs(actual.astype(np.float64) - expected) <= tolerance))


def _cases(dtypes: list[np.dtype]) -> Iterator[tuple[int, np.dtype, tuple[int, ...], ReduceOp]]:
    case = 0
    for dtype in dtypes:
        ops = FLOAT_OPS if (dtype.kind == "f" or dtype.name == "bfloat16") else INT_OPS
        for shape in SHAPES:
            for op in ops:
                case += 1
                yield case, dtype, shape, op


def _digest(array: np.ndarray) -> str:
    return hashlib.sha256(_bytes(array)).hexdigest()[:16]


def _bytes(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array).tobytes()


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and _bytes(a) == _bytes(b)


def check_collectives(group: Backend, *, dtypes: list[np.dtype] | None = None) -> ConformanceReport:
    """Run every collective on ``group`` and compare with NumPy; call it on every rank.

    Returns:
        This rank's :class:`ConformanceReport`.

    """
    n, r = group.world_size, group.rank
    report = ConformanceReport(r)
    last = n - 1

    def check(name: str, ok: bool) -> None:
        report.cases += 1
        if not ok:
            report.failures.append(f"rank {r}: {name}")

    # Halving-doubling is the TCP mesh's own algorithm; every other engine takes it as a hint and runs
    # what it runs for the ring, which the ring's pass already checks.
    native = group.native
    algorithms = ["ring", "recursive_doubling"] + (
        ["halving_doubling"] if native is not None and native.direct_mesh is not None else [])
    for case, dtype, shape, op in _cases(dtypes or conformance_dtypes()):
        inputs = [_input(dtype, shape, k, case, op) for k in range(n)]
        expected = _reference(inputs, op)
        label = f"{dtype.name} shape {shape} {op.name}"
        for algorithm in algorithms:
            x = inputs[r].copy()
            ferro.allreduce(x, op, group=group, algorithm=algorithm)
            check(f"allreduce/{algorithm} {label}", _close(x, expected, inputs, op))
            report.digests.append(_digest(x))
        x = inputs[r].copy()
        ferro.reduce(x, dst=last, op=op, group=group)
        check(f"reduce {label}", _close(x, expected, inputs, op) if r == last else np.array_equal(x, inputs[r]))
        if shape:
            before = inputs[r].tobytes()
            part = ferro.reduce_scatter(inputs[r], op, group=group)
            mine = np.array_split(expected, n)[r] if expected.ndim else expected
            check(f"reduce_scatter {label}", _close(part, mine, [np.array_split(i, n)[r] for i in inputs], op))
            check(f"reduce_scatter {label} leaves its input as it was", inputs[r].tobytes() == before)
        if op is not ReduceOp.SUM:
            continue
        # Data movement depends on dtype and shape only: once per pair.
        _check_movement(group, inputs, label, check, report)
    ferro.barrier(group=group)
    return report


def _check_movement(group: Backend, inputs: list[np.ndarray], label: str, check: Callable[[str, bool], None],
                    report: ConformanceReport) -> None:
    n, r, last = group.world_size, group.rank, group.world_size - 1
    gathered = np.concatenate([i.reshape(1) if i.ndim == 0 else i for i in inputs])
    x = inputs[r].copy() if r == last else np.zeros_like(inputs[r])
    ferro.broadcast(x, root=last, group=group)
    check(f"broadcast {label}", _same_bytes(x, inputs[last]))
    result = ferro.all_gather(inputs[r], group=group)
    check(f"all_gather {label}", _same_bytes(result, gathered))
    report.digests.append(_digest(result))
    result = ferro.gather(inputs[r], dst=last, group=group)
    check(f"gather {label}", (result is None) if r != last else _same_bytes(result, gathered))
    chunks = [inputs[k] for k in range(n)] if r == last else None
    mine = ferro.scatter(chunks, src=last, group=group)
    check(f"scatter {label}", _same_bytes(mine, inputs[r]))
    blocks = np.concatenate([np.full(2, 10 * k + r).astype(inputs[r].dtype) for k in range(n)])
    result = ferro.all_to_all(blocks, group=group)
    check(f"all_to_all {label}", np.array_equal(
        result, np.concatenate([np.full(2, 10 * r + k).astype(inputs[r].dtype) for k in range(n)])))
    send_counts = [(r + k) % 3 for k in range(n)]
    recv_counts = [(k + r) % 3 for k in range(n)]
    payload = np.concatenate([np.full(c, 100 * r + k).astype(inputs[r].dtype) for k, c in enumerate(send_counts)])
    result = ferro.all_to_all_single_uneven(payload, send_counts, recv_counts, group=group)
    check(f"all_to_all_single_uneven {label}", np.array_equal(
        result, np.concatenate([np.full(c, 100 * k + r).astype(inputs[r].dtype) for k, c in enumerate(recv_counts)])))

