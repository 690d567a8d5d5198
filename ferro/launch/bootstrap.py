"""What each rank started by ``ferro run`` executes first, before the user's script or module.

It asks the kernel to kill this rank if the launcher dies (so no rank outlives
its launcher), then runs the target in this same process as ``python script.py``
or ``python -m module`` would: ``sys.argv`` and ``sys.path[0]`` as Python sets them.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

LAUNCHER_PID_ENV = "FERRO_LAUNCHER_PID"


def _die_with_launcher() -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    # The launcher may have died before prctl took effect: then our parent is no longer it.
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher and os.getppid() != int(launcher):
        os._exit(1)


def main(argv: list[str]) -> None:
    """Run ``argv``: ``["-m", module, *args]`` or ``[script, *args]``."""
    _die_with_launcher()
    if argv and argv[0] == "-m":
        module, args = argv[1], argv[2:]
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, args = argv[0], argv[1:]
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
