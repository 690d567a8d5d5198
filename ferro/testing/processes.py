"""Run one function on N ranks as separate processes over real sockets."""

from __future__ import annotations

import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import pickle
import secrets
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ferro.backend import backend_entry
from ferro.errors import DistributedTimeoutError, RankFailedError
from ferro.launch.bootstrap import die_with_parent
from ferro.rendezvous.settings import free_port
from ferro.rendezvous.store import StoreServer

__all__ = ["RankExit", "run_processes"]

STACK_DUMP_GRACE = 1.0
FAILURE_GATHER_SECONDS = 0.2
_LOCALHOST = "127.0.0.1"
# Imported by the forkserver that ranks fork from, when the caller has imported them: torch costs a rank
# 2-3 s to import on a small machine, and a test module that uses it makes every rank import it again.
HEAVY_PRELOADS = ("torch",)


@dataclass(frozen=True)
class RankExit:
    """What :func:`run_processes` returns for a rank that was allowed to exit without a result.

    Attributes:
        exitcode: The process's exit status, or ``None`` if a signal ended it.
        signal_name: The name of the signal that ended it (``"SIGKILL"``), or ``None``.

    """

    exitcode: int | None
    signal_name: str | None


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code} without returning a result"


def _rank_main(fn: Callable[..., Any], args: tuple[Any, ...], rank: int, world_size: int, mode: str | None,
               store_port: int, secret: str, env: Mapping[str, str], stack_path: str, group_timeout: float | None,
               result_pipe: multiprocessing.connection.Connection) -> None:
    die_with_parent()  # no rank outlives a crashed or killed test run
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": _LOCALHOST, "MASTER_PORT": str(store_port), "FERRO_SECRET": secret})
    stack_file = open(stack_path, "w")  # noqa: SIM115 - must outlive this frame for faulthandler
    # SIGUSR2: SIGUSR1 belongs to the rank's hang watch (ferro.collective.hang_watch), which dumps its record.
    faulthandler.register(signal.SIGUSR2, file=stack_file, all_threads=True)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    reported = False

    def report_failure() -> None:
        # When one rank's failure makes its peers fail too, the earliest is the cause (see _earliest_failure).
        nonlocal reported
        if not reported:
            reported = True
            result_pipe.send(("error", traceback.format_exc(), time.monotonic()))

    def call(*fn_args: Any) -> Any:
        try:
            return fn(*fn_args)
        except BaseException:
            # Reported before the group closes: closing is what makes the peers fail, and it can take longer
            # (a lingering abort, 2 s at most) than the parent waits for a cause after the first failure.
            report_failure()
            raise

    try:
        if mode is not None:
            from ferro.backend import JoinSpec, join_backend
            from ferro.rendezvous.store import Store

            store = Store(_LOCALHOST, store_port, secret=secret, timeout=group_timeout or 60.0)
            try:
                spec = JoinSpec(rank, world_size, _LOCALHOST, store_port, timeout=group_timeout, secret=secret,
                                store=store)
                with join_backend(mode, spec) as group:
                    result = call(group, *args)
            finally:
                store.close()
        else:
            result = call(rank, world_size, *args)
        try:
            result_pipe.send(("ok", result))
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            result_pipe.send(("error", f"rank {rank} returned an unpicklable result: {exc!r}"))
    except BaseException:
        report_failure()
    finally:
        result_pipe.close()


def run_processes(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    backend: str | None = "tcp",
    timeout: float = 60.0,
    group_timeout: float | None = None,
    allow_exit: Iterable[int] = (),
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``fn`` on ``world_size`` ranks, each in its own process, and return their results.

    With a backend of the registry (:data:`ferro.backend.BACKENDS`: ``"tcp"``, ``"shm"``,
    ...) each rank calls ``fn(group, *args)`` with a connected group of that backend; the
    harness serves the rendezvous store on loopback and closes every group afterwards. With ``backend=None`` each rank
    calls ``fn(rank, world_size, *args)`` with ``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT`` (a free port) and a fresh ``FERRO_SECRET``
    in its environment, and builds whatever it wants.

    ``fn`` and ``args`` must be picklable (a module-level function). Ranks start
    through a forkserver, so the caller's threads and state do not leak into them.
    The forkserver (started by the process's first run) imports numpy, ferro
    and, where the caller has already imported it, torch: ranks forked from it
    start with them imported instead of importing them again each.

    Args:
        fn: The function every rank runs.
        world_size: Number of ranks.
        args: Extra positional arguments for ``fn``.
        backend: A backend's name, or ``None`` (see above).
        timeout: Seconds for the whole run; past it the stacks of the ranks
            still running are collected into the error and every rank is killed.
        group_timeout: Default timeout of the group (default: ferro's).
        allow_exit: Ranks that may end without returning (a test that kills a
            rank on purpose); their result is a :class:`RankExit`.
        env: Extra environment variables for every rank.

    Returns:
        Each rank's return value, in rank order.

    Raises:
        RankFailedError: A rank raised or died; carries its traceback. Every
            other rank is killed at once.
        DistributedTimeoutError: The run took longer than ``timeout``; the
            message holds the stacks of the ranks that had not finished.

    """
    if backend is not None:
        backend_entry(backend)  # unknown or unavailable: refused here, before any rank starts
    allowed = set(allow_exit)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["numpy", "ferro", *(name for name in HEAVY_PRELOADS if name in sys.modules)])
    secret = secrets.token_hex(16)
    server = None
    workdir = tempfile.mkdtemp(prefix="ferro-ranks-")
    processes: list[Any] = []  # context-specific Process classes
    pipes: list[multiprocessing.connection.Connection] = []
    try:
        if backend is not None:
            server = StoreServer(_LOCALHOST, 0, secret=secret.encode())
            port = server.port
        else:
            port = free_port()
        for rank in range(world_size):
            receiver, sender = context.Pipe(duplex=False)
            stack_path = os.path.join(workdir, f"rank{rank}.stacks")
            process = context.Process(
                target=_rank_main, name=f"ferro-rank-{rank}",
                args=(fn, tuple(args), rank, world_size, backend, port, secret, dict(env or {}), stack_path,
                      group_timeout, sender))
            process.start()
            sender.close()
            processes.append(process)
            pipes.append(receiver)
        return _collect(processes, pipes, allowed, timeout, workdir)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        for process in processes:
            process.join(timeout=10)
        for pipe in pipes:
            pipe.close()
        if server is not None:
            server.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _collect(processes: list[multiprocessing.process.BaseProcess], pipes: list[multiprocessing.connection.Connection],
             allowed: set[int], timeout: float, workdir: str) -> list[Any]:
    results: list[Any] = [None] * len(processes)
    pending = set(range(len(processes)))
    deadline = time.monotonic() + timeout
    while pending:
        remaining = deadline - time.monotonic()
        waitables: dict[Any, int] = {pipes[r]: r for r in pending}
        waitables.update({processes[r].sentinel: r for r in pending})
        ready = multiprocessing.connection.wait(list(waitables), timeout=max(remaining, 0))
        if not ready:
            raise DistributedTimeoutError(_hang_report(processes, pending, timeout, workdir))
        for rank in sorted({waitables[obj] for obj in ready}):
            if rank not in pending:
                continue
            message = _read_result(pipes[rank])
            if message is None:
                processes[rank].join(timeout=5)
                code = processes[rank].exitcode
                if rank in allowed:
                    signal_name = signal.Signals(-code).name if code is not None and code < 0 else None
                    results[rank] = RankExit(code if code is not None and code >= 0 else None, signal_name)
                    pending.discard(rank)
                    continue
                raise RankFailedError(f"rank {rank} {_describe_exit(code)}", rank)
            if message[0] == "ok":
                results[rank] = message[1]
                pending.discard(rank)
            else:
                rank, text = _earliest_failure(pipes, pending, rank, message)
                raise RankFailedError(f"rank {rank} failed:\n{text}", rank, text)
    return results


def _earliest_failure(pipes: list[multiprocessing.connection.Connection], pending: set[int], rank: int,
                      message: tuple[Any, ...]) -> tuple[int, str]:
    """Among the failures reported within a moment of this one, return the earliest (the cause)."""
    failures = [(message[2] if len(message) > 2 else 0.0, rank, message[1])]
    deadline = time.monotonic() + FAILURE_GATHER_SECONDS
    others = [r for r in pending if r != rank]
    while others and time.monotonic() < deadline:
        for other in list(others):
            reported = _read_result(pipes[other])
            if reported is not None:
                others.remove(other)
                if reported[0] == "error":
                    failures.append((reported[2] if len(reported) > 2 else 0.0, other, reported[1]))
        time.sleep(0.005)
    when, first, text = min(failures)
    return first, text


def _read_result(pipe: multiprocessing.connection.Connection) -> tuple[Any, ...] | None:
    try:
        if pipe.poll():
            message: tuple[Any, ...] = pipe.recv()
            return message
    except (EOFError, OSError):
        pass
    return None


def _hang_report(processes: list[multiprocessing.process.BaseProcess], pending: set[int], timeout: float,
                 workdir: str) -> str:
    for rank in pending:
        pid = processes[rank].pid
        if pid is not None and processes[rank].is_alive():
            try:
                os.kill(pid, signal.SIGUSR2)
            except ProcessLookupError:
                pass
    time.sleep(STACK_DUMP_GRACE)
    parts = [f"ranks {sorted(pending)} did not finish within {timeout:g} s; their stacks:"]
    for rank in sorted(pending):
        path = os.path.join(workdir, f"rank{rank}.stacks")
        try:
            with open(path) as f:
                stacks = f.read().strip()
        except OSError:
            stacks = ""
        parts.append(f"--- rank {rank} ---\n{stacks or '(no stack dump)'}")
    return "\n".join(parts)
