"""Compiling the stub libnccl and libcuda (tests/stubs/) and the fake GPU arrays tests hand to ferro."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np

STUBS = Path(__file__).parent / "stubs"


def compile_stub(name: str, out: Path) -> Path:
    """Compile ``tests/stubs/<name>_stub.c`` into the shared library ``out``."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc) to build the NCCL stub with")
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", str(out),
                    str(STUBS / f"{name}_stub.c")], check=True)
    return out


def stub_env(nccl: Path, cuda: Path, log: Path, **extra: str) -> dict[str, str]:
    """The environment that makes ferro load the stubs and log to ``log.<pid>``."""
    return {"FERRO_NCCL_LIBRARY": str(nccl), "FERRO_CUDA_DRIVER_LIBRARY": str(cuda), "FERRO_STUB_LOG": str(log),
            **extra}


def read_log(log: Path, pid: int | None = None) -> list[str]:
    """Return the stub's log lines of process ``pid`` (default: this one)."""
    path = Path(f"{log}.{pid if pid is not None else os.getpid()}")
    return path.read_text().splitlines() if path.exists() else []


class FakeGpuArray:
    """Host memory that presents itself as GPU memory (``__cuda_array_interface__``), for the stubs.

    Attributes:
        array: The NumPy array behind it (what the stubs read and write).

    """

    def __init__(self, array: np.ndarray, stream: int = 7, readonly: bool = False) -> None:
        self.array, self.stream, self.readonly = array, stream, readonly

    @property
    def __cuda_array_interface__(self) -> dict:
        a = self.array
        strides = None if a.flags.c_contiguous else a.strides
        return {"shape": a.shape, "typestr": a.dtype.str, "data": (a.ctypes.data, self.readonly), "version": 3,
                "strides": strides, "stream": self.stream}
