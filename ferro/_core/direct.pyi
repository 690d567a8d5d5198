"""Type stub for the direct paths' shared front (ferro/_core/direct.pyx)."""

from collections.abc import Callable
from typing import Any

from ferro._core.state import GroupState

class DirectCall:
    default_timeout: float
    def __init__(
        self,
        group_state: GroupState,
        slot: int,
        make_plan: Callable[[dict[Any, Any], Any, Any], Any] | None,
        on_failure: Callable[[BaseException], None],
        wake: Callable[[], None],
        ndarray: type,
        resolve_timeout: Callable[[float], float],
        default_timeout: float,
        op_type: type | None = ...,
        *,
        engine: Any = ...,
        empty: Callable[..., Any] | None = ...,
    ) -> None: ...
