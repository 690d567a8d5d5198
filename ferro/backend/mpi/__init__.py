"""The MPI backend: ferro's process groups over the cluster's own MPI, through mpi4py.

``init_process_group(backend="mpi")`` under ``mpirun``/``srun`` (or
``backend="auto"`` with ``FERRO_BACKEND=mpi``) joins ``MPI_COMM_WORLD``;
:meth:`MpiBackend.from_comm` wraps any mpi4py communicator. mpi4py is an
optional extra (``pip install 'ferro[mpi]'``), imported only when a group is made.
"""

from __future__ import annotations

from ferro.backend.mpi.backend import MpiBackend, MpiPending
from ferro.backend.mpi.launch import find_mpirun, mpirun_command
from ferro.backend.mpi.library import load_mpi
from ferro.errors import MpiError

__all__ = ["MpiBackend", "MpiError", "MpiPending", "find_mpirun", "load_mpi", "mpirun_command"]
