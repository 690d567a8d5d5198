"""What each rank started by ``ferro run`` executes first, before the user's script or module.

The launcher runs this file *by its path* (``python -u /.../ferro/launch/bootstrap.py target...``),
never as ``python -m ferro.launch.bootstrap``: ``-m`` would put the launcher's working
directory first on ``sys.path``, and a ferro source tree there (the repository root of a
clone, say) would shadow the installed, compiled package. Run by path, ``sys.path[0]`` is
this file's own folder, which holds nothing importable by a user.

It then asks the kernel to kill this rank if the launcher dies (so no rank outlives
its launcher), imports the ferro this file belongs to, and runs the target in this
same process as ``python script.py`` or ``python -m module`` would: ``sys.argv`` and
``sys.path[0]`` as Python sets them. The target's ``import ferro`` finds the package
already imported, whatever its working directory holds.

Only the standard library is imported before the parent-death signal is set.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

__all__ = ["LAUNCHER_PID_ENV", "die_with_parent", "main"]

LAUNCHER_PID_ENV = "FERRO_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent(expected_parent: int | None = None) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux; elsewhere nothing).

    Args:
        expected_parent: The pid the parent should have. The parent may have died
            before the request took effect; then this process is now someone else's
            child, and it exits at once instead of running orphaned.

    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)


def main(argv: list[str]) -> None:
    """Run ``argv``: ``["-m", module, *args]`` or ``[script, *args]``."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    die_with_parent(int(launcher) if launcher else None)
    # sys.path[0] is this file's folder here, so this is the installed ferro; importing it
    # now pins it in sys.modules before the target's own sys.path[0] is put in place.
    import ferro  # noqa: F401

    if argv and argv[0] == "-m":
        module, args = argv[1], argv[2:]
        sys.argv = [module, *args]
        sys.path[0] = os.getcwd()  # what `python -m` puts first
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, args = argv[0], argv[1:]
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # what `python script.py` puts first
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
