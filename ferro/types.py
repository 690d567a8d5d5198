"""The vocabulary every layer shares: reduction ops, dtypes as the kernels see them, call fingerprints.

This module sits at the bottom with :mod:`ferro.errors`: backends map a
:class:`ReduceOp` and a :class:`DType` to kernel codes without importing the
collectives, and every layer encodes and decodes a call's 64-bit fingerprint
the same way. It imports nothing from the rest of ferro.
"""

from __future__ import annotations

import enum
import functools
import zlib
from dataclasses import dataclass

__all__ = [
    "COLLECTIVE_IDS",
    "THREAD_TAG_BITS",
    "DType",
    "ReduceOp",
    "collective_name",
    "describe_fingerprint",
    "dtype_by_code",
    "dtype_by_name",
    "fingerprint",
    "thread_tag",
    "fingerprint_collective",
]


class ReduceOp(enum.Enum):
    """How :func:`ferro.allreduce`, :func:`ferro.reduce` and :func:`ferro.reduce_scatter` combine values.

    ``BAND``, ``BOR`` and ``BXOR`` apply to integer dtypes; ``MEAN`` (also named
    ``AVG``) to floating-point ones; the rest to both.
    """

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6
    MEAN = 7
    AVG = 7  # an alias of MEAN, as in torch.distributed

    # Members are singletons compared by identity; Enum's default hash (of the name, in Python)
    # costs 0.2 us, and ops are looked up in dictionaries on every call.
    __hash__ = object.__hash__

    @property
    def kernel_code(self) -> int:
        """The C kernel's op code (MEAN reduces as SUM; the backend then divides by the world size)."""
        return KERNEL_CODES[self]


#: ReduceOp -> the C kernel's op code. Looked up on every call: a plain dictionary beats enum attributes.
KERNEL_CODES = {op: (0 if op is ReduceOp.MEAN else op.value) for op in ReduceOp}


@dataclass(frozen=True)
class DType:
    """A dtype's reduction code (``reduce_kernels.h``) and properties.

    Attributes:
        code: The ``FERRO_*`` dtype code, or -1 for dtypes that can be moved but not reduced.
        name: Its name, for messages.
        itemsize: Bytes per element.
        kind: ``"f"`` floating, ``"i"`` signed, ``"u"`` unsigned integer, ``"o"`` other.

    """

    code: int
    name: str
    itemsize: int
    kind: str

    @property
    def reducible(self) -> bool:
        """Whether reduction kernels exist for this dtype."""
        return self.code >= 0


_BY_NAME = {
    "float16": DType(0, "float16", 2, "f"),
    "bfloat16": DType(1, "bfloat16", 2, "f"),
    "float32": DType(2, "float32", 4, "f"),
    "float64": DType(3, "float64", 8, "f"),
    "int8": DType(4, "int8", 1, "i"),
    "int16": DType(5, "int16", 2, "i"),
    "int32": DType(6, "int32", 4, "i"),
    "int64": DType(7, "int64", 8, "i"),
    "uint8": DType(8, "uint8", 1, "u"),
    "uint16": DType(9, "uint16", 2, "u"),
    "uint32": DType(10, "uint32", 4, "u"),
    "uint64": DType(11, "uint64", 8, "u"),
}
_BY_CODE = {d.code: d for d in _BY_NAME.values()}
#: Raw bytes, for collectives that move data without reducing it.
BYTES = _BY_NAME["uint8"]


def dtype_by_name(name: str) -> DType | None:
    """Return the reducible dtype called ``name`` (NumPy's name, or ``"bfloat16"``), or None."""
    return _BY_NAME.get(name)


def dtype_by_code(code: int) -> DType | None:
    """Return the reducible dtype with kernel code ``code``, or None."""
    return _BY_CODE.get(code)


#: Collective ids in the fingerprint's top 6 bits. The compiled core counts bytes per id
#: (``group.stats()``), so every operation a group runs has one; barrier frames carry no
#: fingerprint and are counted by their kind.
COLLECTIVE_IDS = {
    "allreduce": 1, "broadcast": 2, "reduce": 3, "all_gather": 4, "gather": 5, "scatter": 6,
    "reduce_scatter": 7, "all_to_all": 8, "all_to_all_single_uneven": 9, "broadcast_object": 10,
    "all_gather_object": 11, "p2p": 12, "barrier": 13,
}
_COLLECTIVE_NAMES = {v: k for k, v in COLLECTIVE_IDS.items()}
_COLLECTIVE_NAMES[0] = "p2p"  # a plain send/recv frame: fingerprint 0


def collective_name(collective_id: int) -> str:
    """Return the name of a collective id (the top 6 bits of a fingerprint)."""
    return _COLLECTIVE_NAMES.get(collective_id, f"collective {collective_id}")


def fingerprint_collective(value: int) -> int:
    """Return the collective id a fingerprint carries."""
    return value >> 58


_OP_NAMES = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "MEAN"]


@functools.lru_cache(maxsize=4096)  # the same calls repeat every training step
def fingerprint(collective: str, dtype_code: int = -1, op_code: int = 0, root: int = 0, count: int = 0,
                shape: tuple[int, ...] = (), thread: int = 0) -> int:
    """Pack a collective call into the 64-bit frame fingerprint.

    Layout (high to low): collective id (6 bits), dtype code + 1 (5), op (3; in a
    broadcast, all_gather or all_to_all the TCP mesh puts its plan there), root
    (10), element count modulo 2**20 (20), the issuing thread's tag (12, see
    :func:`thread_tag`), a hash of the shape (8). Two ranks whose calls differ in
    any of these refuse each other's frames.
    """
    shape_hash = zlib.crc32(repr(tuple(shape)).encode()) & 0xFF
    return ((COLLECTIVE_IDS[collective] & 0x3F) << 58 | ((dtype_code + 1) & 0x1F) << 53 | (op_code & 0x7) << 50
            | (root & 0x3FF) << 40 | (count & 0xFFFFF) << 20 | (thread & 0xFFF) << 8 | shape_hash)


#: Where :func:`thread_tag` sits in a fingerprint.
THREAD_TAG_BITS = 0xFFF << 8


@functools.lru_cache(maxsize=256)
def thread_tag(thread_name: str) -> int:
    """Return the 12-bit tag of a thread's name that collectives carry in their fingerprint (never 0).

    Calls are matched across ranks in order, per group; the tag makes a call
    issued by one thread refuse a call issued by a thread of another name, so
    calls that several threads race to make fail loudly instead of meeting the
    wrong partner (see :mod:`ferro.collective.work` for the rule).
    """
    return zlib.crc32(thread_name.encode()) % 0xFFF + 1


def describe_fingerprint(value: int, against: int | None = None) -> str:
    """Decode a fingerprint for messages: ``allreduce(float32, SUM, 1024 elements, ...)``.

    Only a reduction shows its op: ``broadcast(float32, root 0, 1024 elements, ...)``. An allreduce shows its
    algorithm only beside a call (``against``) that chose another: ``allreduce(float32, SUM, algorithm ring, ...)``.
    """
    collective = collective_name(value >> 58)
    code = ((value >> 53) & 0x1F) - 1
    dtype = _BY_CODE[code].name if code in _BY_CODE else "bytes"
    op = _OP_NAMES[(value >> 50) & 0x7]
    root = (value >> 40) & 0x3FF
    count = (value >> 20) & 0xFFFFF
    thread = (value >> 8) & 0xFFF
    issued = f", from thread tag {thread:03x}" if thread else ""
    # Rootless collectives carry a caller's tag in the root field (see ferro.all_gather's ``tag``); allreduce carries
    # its algorithm there (code + 1), so that ranks that run different algorithms say so.
    if collective == "allreduce":
        shown = against is not None and fingerprint_tag(against) != root and 0 < root <= len(_ALLREDUCE_ALGORITHMS)
        where = f"algorithm {_ALLREDUCE_ALGORITHMS[root - 1]}, " if shown else ""
    else:
        where = f"root {root}, " if collective in _ROOTED else (f"tag {root}, " if root else "")
    # A broadcast, all_gather or all_to_all on TCP carries the plan its mesh chose in the op field (code + 1),
    # shown beside a call that chose another (ferro._core.collectives._with_plan).
    plan, plans = (value >> 50) & 0x7, _PLANS.get(collective, ())
    if against is not None and 0 < plan <= len(plans) and (against >> 50) & 0x7 != plan:
        where += f"plan {plans[plan - 1]}, "
    # Only a reduction has an op; the field is 0 (SUM) in every other call's fingerprint.
    how = f"{op}, " if collective in _REDUCING else ""
    return f"{collective}({dtype}, {how}{where}{count} elements, shape hash {value & 0xFF:02x}{issued})"


_REDUCING = frozenset({"allreduce", "reduce", "reduce_scatter"})
# The allreduce algorithms by code (ferro._core.collectives.ALGORITHMS), for describe_fingerprint.
_ALLREDUCE_ALGORITHMS = ("ring", "recursive_doubling", "halving_doubling")
# The plans of the collectives that choose one by cost, by code (ferro._core.collectives.choose's names).
_PLANS = {"broadcast": ("binomial tree", "pipelined chain", "scatter and all-gather"), "all_gather": ("ring", "bruck"),
          "all_to_all": ("pairwise", "bruck"), "all_to_all_single_uneven": ("pairwise",)}
_ROOTED = frozenset({"broadcast", "reduce", "gather", "scatter", "broadcast_object", "p2p"})

#: Tags of :func:`ferro.all_gather` and :func:`ferro.reduce_scatter` travel in the root field: 10 bits.
MAX_TAG = 0x3FF


def fingerprint_tag(value: int) -> int:
    """Return the root (or, for a rootless collective, the tag) a fingerprint carries."""
    return (value >> 40) & 0x3FF
