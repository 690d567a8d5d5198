"""Type stub for the direct allreduce path of foreign-library groups (ferro/_core/foreign.pyx)."""

from collections.abc import Callable
from typing import Any

from ferro._core.state import GroupState

class WatchSlot:
    deadline: float
    call: str
    seconds: float

class DirectForeignAllreduce:
    def __init__(self, allreduce: Callable[..., Any], in_place: Any, group_state: GroupState, watch: WatchSlot,
                 make_plan: Callable[[Any, Any], Any], on_failure: Callable[[BaseException], BaseException],
                 ndarray: type, default_timeout: float, resolve_timeout: Callable[[Any], float]) -> None: ...
    def __call__(self, x: Any, op: Any, timeout: float | None) -> bool: ...
