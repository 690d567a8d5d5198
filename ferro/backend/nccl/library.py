"""Finding libnccl, loading it lazily, and the one table of its prototypes.

ferro binds NCCL through :mod:`ctypes`: nothing is compiled against CUDA, so
the same wheel serves CPU clusters and GPU nodes. The library is looked for,
first found wins, in:

1. ``$FERRO_NCCL_LIBRARY``, a path to the ``.so``;
2. a libnccl already loaded into this process (PyTorch's, once
   ``torch.cuda`` or ``torch.distributed`` loaded it), so ferro and torch
   share one NCCL;
3. the ``nvidia-nccl-cu12`` / ``nvidia-nccl-cu13`` wheels' ``nvidia/nccl/lib/libnccl.so.2``
   under any entry of ``sys.path``;
4. the system's ``libnccl.so.2`` (``LD_LIBRARY_PATH``, the linker cache).

Nothing here runs at ``import ferro``: :func:`load_library` is called by the
first NCCL group. Every prototype is declared once, in :data:`PROTOTYPES`, with
exact argument types: element counts are ``size_t`` and the 128-byte
``ncclUniqueId`` is passed by value, as ``nccl.h`` declares them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ferro import environment
from ferro.errors import BackendUnavailableError

__all__ = [
    "CONFIG_MAGIC",
    "CONFIG_VERSION",
    "LIBRARY_ENV",
    "MIN_VERSION",
    "PROTOTYPES",
    "SPLIT_NOCOLOR",
    "UNIQUE_ID_BYTES",
    "Candidate",
    "Config",
    "NcclLibrary",
    "UniqueId",
    "candidates",
    "decode_version",
    "load_library",
    "nccl_version",
]

LIBRARY_ENV = "FERRO_NCCL_LIBRARY"
SONAME = "libnccl.so.2"
# Where the NVIDIA wheels put the library, relative to a sys.path entry.
WHEEL_DIRS = ("nvidia/nccl/lib", "nvidia/cu13/lib", "nvidia/cu12/lib")
INSTALL_HINT = ("pip install nvidia-nccl-cu12 (or nvidia-nccl-cu13 for CUDA 13), or set FERRO_NCCL_LIBRARY to the "
                "path of libnccl.so.2")
# ncclCommInitRankConfig (non-blocking communicators) came in 2.14, ncclCommSplit in 2.18.
MIN_VERSION = (2, 18, 0)

UNIQUE_ID_BYTES = 128
SPLIT_NOCOLOR = -1
CONFIG_MAGIC = 0xCAFEBEEF
# The layout of ncclConfig_t declared below is NCCL 2.17's. Newer libraries read a config by its
# size and version and give every later field its default (nccl's parseCommConfig), so one
# declaration serves every NCCL from 2.18 on.
CONFIG_VERSION = 21700
CONFIG_UNDEF_INT = -(2**31)


class UniqueId(ctypes.Structure):
    """``ncclUniqueId``: 128 opaque bytes that rank 0 creates and every rank passes by value."""

    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


class Config(ctypes.Structure):
    """``ncclConfig_t`` as of NCCL 2.17 (see :data:`CONFIG_VERSION`)."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
        ("cgaClusterSize", ctypes.c_int),
        ("minCTAs", ctypes.c_int),
        ("maxCTAs", ctypes.c_int),
        ("netName", ctypes.c_char_p),
    ]

    @classmethod
    def non_blocking(cls) -> Config:
        """Return ``NCCL_CONFIG_INITIALIZER`` with ``blocking = 0``: calls return at once and are polled."""
        return cls(ctypes.sizeof(cls), CONFIG_MAGIC, CONFIG_VERSION, 0, CONFIG_UNDEF_INT, CONFIG_UNDEF_INT,
                   CONFIG_UNDEF_INT, None)


_Result = ctypes.c_int  # ncclResult_t, and every other enum: C enums are int-sized
_Comm = ctypes.c_void_p  # ncclComm_t
_Stream = ctypes.c_void_p  # cudaStream_t
_Ptr = ctypes.c_void_p
_Count = ctypes.c_size_t
_Int = ctypes.c_int

#: name -> (return type, argument types), exactly as nccl.h declares them.
PROTOTYPES: Mapping[str, tuple[Any, tuple[Any, ...]]] = {
    "ncclGetVersion": (_Result, (ctypes.POINTER(_Int),)),
    "ncclGetUniqueId": (_Result, (ctypes.POINTER(UniqueId),)),
    "ncclCommInitRankConfig": (_Result, (ctypes.POINTER(_Comm), _Int, UniqueId, _Int, ctypes.POINTER(Config))),
    "ncclCommSplit": (_Result, (_Comm, _Int, _Int, ctypes.POINTER(_Comm), ctypes.POINTER(Config))),
    "ncclCommFinalize": (_Result, (_Comm,)),
    "ncclCommDestroy": (_Result, (_Comm,)),
    "ncclCommAbort": (_Result, (_Comm,)),
    "ncclCommGetAsyncError": (_Result, (_Comm, ctypes.POINTER(_Result))),
    "ncclCommCount": (_Result, (_Comm, ctypes.POINTER(_Int))),
    "ncclCommCuDevice": (_Result, (_Comm, ctypes.POINTER(_Int))),
    "ncclCommUserRank": (_Result, (_Comm, ctypes.POINTER(_Int))),
    "ncclGetErrorString": (ctypes.c_char_p, (_Result,)),
    "ncclGetLastError": (ctypes.c_char_p, (_Comm,)),
    "ncclAllReduce": (_Result, (_Ptr, _Ptr, _Count, _Int, _Int, _Comm, _Stream)),
    "ncclBroadcast": (_Result, (_Ptr, _Ptr, _Count, _Int, _Int, _Comm, _Stream)),
    "ncclReduce": (_Result, (_Ptr, _Ptr, _Count, _Int, _Int, _Int, _Comm, _Stream)),
    "ncclAllGather": (_Result, (_Ptr, _Ptr, _Count, _Int, _Comm, _Stream)),
    "ncclReduceScatter": (_Result, (_Ptr, _Ptr, _Count, _Int, _Int, _Comm, _Stream)),
    "ncclSend": (_Result, (_Ptr, _Count, _Int, _Int, _Comm, _Stream)),
    "ncclRecv": (_Result, (_Ptr, _Count, _Int, _Int, _Comm, _Stream)),
    "ncclGroupStart": (_Result, ()),
    "ncclGroupEnd": (_Result, ()),
}


@dataclass(frozen=True)
class Candidate:
    """A place the loader looks: where the path came from, and the path (or soname) to open."""

    source: str
    path: str


def candidates(environ: Mapping[str, str], search_path: Iterable[str], loaded: Iterable[str]) -> list[Candidate]:
    """Return the places to look for libnccl, in the loader's order (see the module docstring).

    Args:
        environ: The environment (for ``FERRO_NCCL_LIBRARY``).
        search_path: ``sys.path``, for the NVIDIA wheels.
        loaded: Paths of the shared objects this process has loaded already.

    """
    found: list[Candidate] = []
    explicit = environment.get(LIBRARY_ENV, environ=environ)
    if explicit:
        found.append(Candidate(LIBRARY_ENV, explicit))
    for path in loaded:
        if os.path.basename(path).startswith("libnccl.so"):
            found.append(Candidate("already loaded in this process", path))
            break
    for entry in search_path:
        for folder in WHEEL_DIRS:
            path = os.path.join(entry or ".", folder, SONAME)
            if os.path.isfile(path):
                found.append(Candidate("the nvidia-nccl wheel", path))
    found.append(Candidate("the system's libraries", ctypes.util.find_library("nccl") or SONAME))
    return found


def loaded_objects() -> list[str]:
    """Return the paths of the shared objects mapped into this process (Linux; empty elsewhere)."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return []
    paths = (line.split(None, 5)[5] for line in lines if line.count(" ") >= 5 and "/" in line)
    return list(dict.fromkeys(path.strip() for path in paths if ".so" in path))


def decode_version(code: int) -> tuple[int, int, int]:
    """Split ``NCCL_VERSION_CODE`` into (major, minor, patch); 2.8 and older used a narrower scheme."""
    if code >= 10000:
        return code // 10000, code // 100 % 100, code % 100
    return code // 1000, code // 100 % 10, code % 100


class NcclLibrary:
    """A loaded libnccl, its functions declared from :data:`PROTOTYPES`.

    Attributes:
        path: What was opened.
        source: Where the loader found it.
        version: (major, minor, patch).

    """

    def __init__(self, handle: ctypes.CDLL, candidate: Candidate) -> None:
        self.path, self.source = candidate.path, candidate.source
        missing = []
        for name, (restype, argtypes) in PROTOTYPES.items():
            try:
                function = getattr(handle, name)
            except AttributeError:
                missing.append(name)
                continue
            function.restype, function.argtypes = restype, argtypes
            setattr(self, name, function)
        if missing:
            raise BackendUnavailableError(
                f"NCCL: {candidate.path} (from {candidate.source}) lacks {', '.join(missing)}; ferro needs NCCL "
                f"{'.'.join(map(str, MIN_VERSION))} or newer: {INSTALL_HINT}")
        code = _Int()
        self.ncclGetVersion(ctypes.byref(code))
        self.version = decode_version(code.value)
        if self.version < MIN_VERSION:
            raise BackendUnavailableError(
                f"NCCL: {candidate.path} is NCCL {'.'.join(map(str, self.version))}; ferro needs "
                f"{'.'.join(map(str, MIN_VERSION))} or newer (ncclCommSplit): {INSTALL_HINT}")

    def __getattr__(self, name: str) -> Any:  # the declared functions are set per instance
        raise AttributeError(f"NCCL function {name} is not declared in ferro.backend.nccl.library.PROTOTYPES")

    def __repr__(self) -> str:
        return f"<NcclLibrary {'.'.join(map(str, self.version))} at {self.path} ({self.source})>"


@functools.cache  # loaded once per process, like an import; never at `import ferro`
def load_library() -> NcclLibrary:
    """Find and load libnccl (see the module docstring for the order).

    Raises:
        BackendUnavailableError: No candidate loads; the message lists what was tried and how to install NCCL.

    """
    tried = []
    for candidate in candidates(os.environ, sys.path, loaded_objects()):
        try:
            handle = ctypes.CDLL(candidate.path)
        except OSError as exc:
            tried.append(f"{candidate.path} ({candidate.source}): {exc}")
            continue
        return NcclLibrary(handle, candidate)
    raise BackendUnavailableError(f"NCCL: libnccl not found; tried {'; '.join(tried)}. {INSTALL_HINT}")


def nccl_version() -> tuple[int, int, int]:
    """Return the version of the libnccl ferro loads, as (major, minor, patch).

    Raises:
        BackendUnavailableError: libnccl cannot be found or is too old (the message says how to install it).

    Example::

        ferro.nccl_version()   # (2, 27, 3)

    """
    return load_library().version
