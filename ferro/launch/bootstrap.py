"""What each rank started by ``ferro run`` executes first, before the user's script or module.

The launcher runs this file *by its path* (``python -u /.../ferro/launch/bootstrap.py target...``),
never as ``python -m ferro.launch.bootstrap``: ``-m`` would put the launcher's working
directory first on ``sys.path``, and a ferro source tree there (the repository root of a
clone, say) would shadow the installed, compiled package. Run by path, ``sys.path[0]`` is
this file's own folder, which holds nothing importable by a user.

On Linux the process the launcher started becomes the rank's *guardian*: a
subreaper that forks the rank and waits. The rank's orphans (processes in their
own session, double forks) come back to the guardian, which ends every one of
them once the rank has ended, or at once if the launcher dies, even by SIGKILL
(see :mod:`ferro.launch.reaper`); it also removes shared-memory segments of a
rank killed before it could. It then exits as the rank did, so the launcher
sees the rank's exit code or signal.

The rank asks the kernel to kill it if its guardian dies, imports the ferro this
file belongs to, and runs the target in this same process as ``python script.py``
or ``python -m module`` would: ``sys.argv`` and ``sys.path[0]`` as Python sets
them. The target's ``import ferro`` finds the package already imported, whatever
its working directory holds.

Only the standard library is imported before the fork and the parent-death signal.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

if __package__:  # imported by the launcher, for this file's path and names
    from ferro.launch import heartbeat, reaper
else:  # run by path, before ferro is imported: this file's folder is sys.path[0]
    import heartbeat  # type: ignore[no-redef]
    import reaper  # type: ignore[no-redef]

__all__ = ["GRACE_ENV", "GUARDIAN_ENV", "LAUNCHER_PID_ENV", "die_with_parent", "main"]

LAUNCHER_PID_ENV = "FERRO_LAUNCHER_PID"
# Seconds the guardian gives a rank's leftover processes between SIGTERM and SIGKILL.
GRACE_ENV = "FERRO_GRACE_SECONDS"
# "0" runs the rank without a guardian (no fork; the rank is the launcher's child).
GUARDIAN_ENV = "FERRO_GUARDIAN"
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
    """Run ``argv``: ``["-m", module, *args]`` or ``[script, *args]``, under a guardian where the OS allows."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    launcher_pid = int(launcher) if launcher else None
    if _can_guard():
        reaper.become_subreaper()  # before the fork: the rank's orphans come back to the guardian
        guardian = os.getpid()
        rank = os.fork()
        if rank:
            _guard(rank, launcher_pid)  # never returns
        die_with_parent(guardian)
    else:
        die_with_parent(launcher_pid)
    _run_target(argv)


def _can_guard() -> bool:
    return sys.platform.startswith("linux") and os.environ.get(GUARDIAN_ENV, "1") != "0"


def _guard(rank: int, launcher: int | None) -> None:
    """Wait for the rank; then end every process it left behind and exit as the rank did.

    The guardian is the process the launcher started; the rank is its child, in
    the same process group, so the launcher's signals reach the rank directly
    (the guardian ignores them and waits). As a subreaper it inherits whatever
    the rank orphans; when the rank has ended, or the launcher has died (even by
    SIGKILL), it ends all of them and removes the rank's shared-memory segments.
    """
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # waited for below, never lost
    grace = float(os.environ.get(GRACE_ENV, "5"))
    status = None
    while status is None:
        for pid, pid_status in reaper.reap_children():
            if pid == rank:
                status = pid_status
        if status is None and launcher is not None and os.getppid() != launcher:
            os.kill(rank, signal.SIGKILL)  # the launcher is gone: nothing of this rank may outlive it
            grace = 0.0
        if status is None:
            signal.sigtimedwait({signal.SIGCHLD}, 0.2)
    reaper.end_descendants(os.getpid(), grace)
    _remove_segments_of(rank)
    if os.WIFSIGNALED(status):  # end as the rank ended, so the launcher reports the same signal
        ended_by = os.WTERMSIG(status)
        if ended_by not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(ended_by, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {ended_by})
        os.kill(os.getpid(), ended_by)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def _remove_segments_of(pid: int) -> None:
    """Remove shared-memory segments a killed rank created and could not unlink (named by its pid)."""
    try:
        leftovers = any(name.startswith(f"ferro-{pid}-") for name in os.listdir("/dev/shm"))
    except OSError:
        return
    if leftovers:  # import ferro only when there is something to do: the common end stays fast
        from ferro.backend.shm import remove_segments_of

        remove_segments_of(pid)


def _run_target(argv: list[str]) -> None:
    beat_file = os.environ.get(heartbeat.HEARTBEAT_FILE_ENV)
    if beat_file:  # ferro run --restart-policy rank: the agent kills a rank whose beats stop
        heartbeat.start_beating(beat_file)
    # sys.path[0] is this file's folder here, so this is the installed ferro; importing it
    # now pins it in sys.modules before the target's own sys.path[0] is put in place.
    import ferro  # noqa: F401
    from ferro.launch.failures import record_failure

    try:
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
    except BaseException as exc:
        record_failure(exc)  # before exit closes the group: the launcher names the cause, not its peers
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
