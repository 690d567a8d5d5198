"""Waiting for a condition instead of sleeping: helpers for tests that need one thread inside a call first."""

import sys
import threading
import time


def wait_until_inside(thread: threading.Thread, function_name: str, timeout: float = 30.0) -> None:
    """Return once ``thread`` is executing ``function_name`` (its innermost Python frame, or one below it).

    The compiled core has no Python frames, so the innermost frame of a thread
    blocked in a receive is the Python method that called into the core.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(thread.ident)
        while frame is not None:
            if frame.f_code.co_name == function_name:
                return
            frame = frame.f_back
        time.sleep(0.001)
    raise TimeoutError(f"{thread.name} did not enter {function_name} within {timeout} s")


def on_entering(function_name: str, action, timeout: float = 30.0) -> threading.Thread:
    """Run ``action()`` on a helper thread once the calling thread is inside ``function_name``."""
    caller = threading.current_thread()

    def watch() -> None:
        wait_until_inside(caller, function_name, timeout)
        action()

    helper = threading.Thread(target=watch, daemon=True)
    helper.start()
    return helper
