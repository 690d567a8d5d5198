"""examples/elastic_train.py with one more way to die: inside the manager, while the group heals.

``--die-in MEMBER:WHAT`` SIGKILLs that member (``"2.0"``, ``"1.1"``) at the start of
``WHAT``: ``settle`` (arriving at a rendezvous after the first epoch: a rank dying
during heal), ``receive_state`` (a replacement dying while it receives the state),
``request_join`` (a replacement dying before it is admitted). Everything else is the
example's own command line.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

from ferro.elastic import manager, membership

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "elastic_train.py")


def _die_in(spec: str) -> None:
    member, what = spec.split(":")
    me = f"{os.environ['RANK']}.{os.environ.get('FERRO_RESTART_COUNT', '0')}"
    if member != me:
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
        manager.receive_state = die  # type: ignore[assignment]
    elif what == "request_join":
        membership.Membership.request_join = die  # type: ignore[assignment,method-assign]
    else:
        raise SystemExit(f"--die-in: unknown point {what!r}")


if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--die-in" in argv:
        at = argv.index("--die-in")
        _die_in(argv[at + 1])
        del argv[at:at + 2]
    sys.argv = [EXAMPLE, *argv]
    runpy.run_path(EXAMPLE, run_name="__main__")
