"""examples/elastic_train.py with more ways to fail: inside the manager, stuck, by a bug, with another model.

``--die-in MEMBER:WHAT`` SIGKILLs that member (``"2.0"``, ``"1.1"``) at the start of
``WHAT``: ``settle`` (arriving at a rendezvous after the first epoch: a rank dying
during heal), ``receive_state`` (a replacement dying while it receives the state),
``request_join`` (a replacement dying before it is admitted).
``--hang-at RANK:STEP``: that launch rank, in its first life, sleeps for good at that step.
``--kill-member MEMBER:STEP``: that member SIGKILLs itself at that step (a replacement too), or at its first
step after it when it joined later (a replacement's start-up time varies with the machine's load).
``--raise-from RANK:STEP``: that launch rank raises a RuntimeError at each step from that one on, in every life
(a bug). ``--model-of MEMBER:HIDDEN``: that member builds its model with another hidden size.
Everything else is the example's own command line.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time
from collections.abc import Callable

from ferro.elastic import manager, membership, sync

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "elastic_train.py")
ME = f"{os.environ['RANK']}.{os.environ.get('FERRO_RESTART_COUNT', '0')}"


def _die_in(spec: str) -> None:
    member, what = spec.split(":")
    if member != ME:
        return

    def die(*_args: object, **_kwargs: object) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if what == "settle":
        original = membership.Membership.settle

        def settle(self, number, *args, **kwargs):  # type: ignore[no-untyped-def]
            if number >= 1:
                die()
            return original(self, number, *args, **kwargs)

        membership.Membership.settle = settle  # type: ignore[method-assign]
    elif what == "receive_state":
        sync.receive_state = die  # type: ignore[assignment]
    elif what == "request_join":
        membership.Membership.request_join = die  # type: ignore[assignment,method-assign]
    else:
        raise SystemExit(f"--die-in: unknown point {what!r}")


def _at_step(who: str, number: int, action: Callable[[int], None], onwards: bool = False) -> None:
    """From the step ``number`` (``onwards``: and each after it) of member ``who`` (a launch rank: any life)."""
    if who != ME and who != ME.split(".")[0]:
        return
    original = manager.Manager.steps

    def steps(self, total, sampler=None):  # type: ignore[no-untyped-def]
        for step in original(self, total, sampler):
            if step.number == number or (onwards and step.number > number):
                action(step.number)
            yield step

    manager.Manager.steps = steps  # type: ignore[method-assign]


def _hang(step: int) -> None:
    print(f"member {ME} hangs at step {step}", flush=True)
    time.sleep(1e6)  # HANG


def _bug(step: int) -> None:
    raise RuntimeError(f"a bug in rank {os.environ['RANK']}'s training step")


def _kill(step: int) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _option(argv: list[str], name: str) -> str | None:
    if name not in argv:
        return None
    at = argv.index(name)
    value = argv[at + 1]
    del argv[at:at + 2]
    return value


if __name__ == "__main__":
    argv = sys.argv[1:]
    if (spec := _option(argv, "--die-in")) is not None:
        _die_in(spec)
    if (spec := _option(argv, "--hang-at")) is not None:
        _at_step(f"{spec.split(':')[0]}.0", int(spec.split(":")[1]), _hang)
    if (spec := _option(argv, "--kill-member")) is not None:
        _at_step(spec.split(":")[0], int(spec.split(":")[1]), _kill, onwards=True)
    if (spec := _option(argv, "--raise-from")) is not None:
        _at_step(spec.split(":")[0], int(spec.split(":")[1]), _bug, onwards=True)
    if (spec := _option(argv, "--model-of")) is not None and spec.split(":")[0] == ME:
        argv += ["--hidden", spec.split(":")[1]]
    sys.argv = [EXAMPLE, *argv]
    runpy.run_path(EXAMPLE, run_name="__main__")
