"""Sub-groups: a subset of a group's ranks with their own, separate traffic."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ferro._core.state import GroupState
from ferro.backend.base import Backend
from ferro.backend.native import NativeCollectives
from ferro.errors import InvalidRankError

__all__ = ["SubBackend", "sub_group"]


class SubBackend(Backend):
    """A group made of some ranks of a parent group.

    Ranks in a sub-group are local: member ``ranks[i]`` of the parent is rank
    ``i`` here. Its messages travel on channels of their own (a new mesh of
    connections on TCP), so they never mix with the parent's or a sibling's,
    whatever the order in which the groups are used.

    Create one with :func:`ferro.new_group`.
    """

    def __init__(self, parent: Backend, ranks: Sequence[int], channel: Backend) -> None:
        self._parent = parent
        self._ranks = tuple(ranks)
        self._channel = channel
        self.tags_threads = parent.tags_threads  # simulated ranks stay untagged in their sub-groups too
        self.host_memory = channel.host_memory
        self.splits_collectively = channel.splits_collectively
        self.nonblocking_collectives = channel.nonblocking_collectives
        channel.state.owner = weakref.ref(self)  # the channel's calls are the sub-group's: describe it in dumps

    def issue_nonblocking(self, body: Callable[[], Any], call: str, description: str,
                          buffers: tuple[Any, ...]) -> Any:
        """Start the collective as the channel's nonblocking calls."""
        return self._channel.issue_nonblocking(body, call, description, buffers)

    @property
    def state(self) -> GroupState:
        """The channel's state: the sub-group and the group carrying its traffic are one group."""
        return self._channel.state

    @property
    def native(self) -> NativeCollectives | None:
        """The channel's native collectives (TCP's compiled ones serve the sub-group as they are)."""
        return self._channel.native

    @property
    def device_collectives(self) -> Any:
        """The channel's NCCL communicator, if it has one."""
        return self._channel.device_collectives

    def cut_peer(self, peer: int) -> bool:
        """Cut the channel's connection to sub-group rank ``peer`` (the channel's ranks are the sub-group's)."""
        return self._channel.cut_peer(peer)

    def split_excluded(self, *, timeout: float | None = None) -> None:
        """Take part, left out, in a collective split of the channel."""
        self._channel.split_excluded(timeout=timeout)

    def _counters(self) -> dict[int, tuple[int, int, int]]:
        return self._channel._counters()

    def reset_stats(self) -> None:
        """Zero the sub-group's communication counters."""
        self._channel.reset_stats()

    @property
    def parent(self) -> Backend:
        """The group this one was made from."""
        return self._parent

    @property
    def ranks(self) -> tuple[int, ...]:
        """The members' ranks in the parent group, in local-rank order."""
        return self._ranks

    @property
    def rank(self) -> int:
        """The calling process's local rank."""
        return self._channel.rank

    @property
    def world_size(self) -> int:
        """The number of members."""
        return self._channel.world_size

    @property
    def timeout(self) -> float:
        """Default seconds for blocking operations."""
        return self._channel.timeout

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._channel.closed

    def global_rank(self, local_rank: int) -> int:
        """Return the parent-group rank of member ``local_rank``.

        Raises:
            InvalidRankError: Not a local rank of this group.

        """
        if not 0 <= local_rank < len(self._ranks):
            raise InvalidRankError(f"local rank {local_rank} is outside the sub-group's [0, {len(self._ranks)})")
        return self._ranks[local_rank]

    def local_rank(self, global_rank: int) -> int:
        """Return the local rank of parent-group rank ``global_rank``.

        Raises:
            InvalidRankError: That rank is not a member.

        """
        try:
            return self._ranks.index(global_rank)
        except ValueError:
            raise InvalidRankError(f"rank {global_rank} is not a member of the sub-group {list(self._ranks)}") from None

    def send(self, buf: Any, dst: int, *, timeout: float | None = None) -> None:
        """Send to local rank ``dst`` (see :meth:`Backend.send`)."""
        self._channel.send(buf, dst, timeout=timeout)

    def recv(self, buf: Any, src: int, *, timeout: float | None = None) -> None:
        """Receive from local rank ``src`` (see :meth:`Backend.recv`)."""
        self._channel.recv(buf, src, timeout=timeout)

    def sendrecv(self, send_buf: Any, dst: int, recv_buf: Any, src: int, *, timeout: float | None = None) -> None:
        """Full-duplex exchange with local ranks (see :meth:`Backend.sendrecv`)."""
        self._channel.sendrecv(send_buf, dst, recv_buf, src, timeout=timeout)

    def send_tagged(self, buf: Any, dst: int, *, kind: int, fingerprint: int, timeout: float | None = None) -> None:
        """Tagged send to local rank ``dst`` (see :meth:`Backend.send_tagged`)."""
        self._channel.send_tagged(buf, dst, kind=kind, fingerprint=fingerprint, timeout=timeout)

    def recv_tagged(self, buf: Any, src: int, *, kind: int, fingerprint: int, timeout: float | None = None) -> None:
        """Tagged receive from local rank ``src`` (see :meth:`Backend.recv_tagged`)."""
        self._channel.recv_tagged(buf, src, kind=kind, fingerprint=fingerprint, timeout=timeout)

    def frames_waiting(self, sources: Sequence[int]) -> list[int]:
        """Local ranks among ``sources`` whose next frame has begun to arrive (see :meth:`Backend.frames_waiting`)."""
        return self._channel.frames_waiting(sources)

    def sendrecv_tagged(self, send_buf: Any, dst: int, recv_buf: Any, src: int, *, kind: int, fingerprint: int,
                        timeout: float | None = None) -> None:
        """Tagged full-duplex exchange with local ranks (see :meth:`Backend.sendrecv_tagged`)."""
        self._channel.sendrecv_tagged(send_buf, dst, recv_buf, src, kind=kind, fingerprint=fingerprint,
                                      timeout=timeout)

    def abort_peers(self, payload: bytes) -> None:
        """Send an abort notice to the sub-group's members."""
        self._channel.abort_peers(payload)

    def barrier(self, *, timeout: float | None = None) -> None:
        """Barrier among the members only."""
        self._channel.barrier(timeout=timeout)

    def split(self, ranks: Sequence[int], *, timeout: float | None = None) -> Backend:
        """Split further; ``ranks`` are local ranks of this sub-group."""
        return self._channel.split(ranks, timeout=timeout)

    def close(self) -> None:
        """Close the sub-group's channels (the parent stays open)."""
        self._channel.close()

    def __repr__(self) -> str:
        return f"<SubBackend rank={self.rank} ranks={list(self._ranks)} of {self._parent!r}>"


def sub_group(group: Backend, ranks: Iterable[int], *, timeout: float | None = None) -> SubBackend | None:
    """Create a sub-group of ``group`` made of ``ranks`` (what :func:`ferro.new_group` runs).

    Every member must call it, with the same ranks, in the same order as its
    other sub-group calls on that group. Non-members may call it too and get
    ``None`` without communicating, except on NCCL groups (``nccl``, ``hybrid``),
    where every rank of ``group`` must call it, as in ``torch.distributed``.
    Local ranks follow the sorted order of ``ranks``.

    Args:
        group: The parent group.
        ranks: Ranks of ``group`` that form the sub-group.
        timeout: Seconds for connecting the sub-group (default: the parent's).

    Returns:
        The sub-group, or ``None`` on a rank that is not a member.

    Raises:
        InvalidRankError: Empty, duplicate or out-of-range ranks.

    """
    members = []
    for r in ranks:
        if isinstance(r, bool) or not hasattr(r, "__index__"):
            raise InvalidRankError(f"new_group: ranks must be integers, got {r!r}")
        members.append(r.__index__())
    if not members:
        raise InvalidRankError("new_group: the ranks list is empty")
    if len(set(members)) != len(members):
        raise InvalidRankError(f"new_group: duplicate ranks in {members}")
    outside = [r for r in members if not 0 <= r < group.world_size]
    if outside:
        raise InvalidRankError(f"new_group: ranks {outside} are outside the parent group's [0, {group.world_size})")
    members.sort()
    if group.rank not in members:
        if group.splits_collectively:  # NCCL: every rank of the parent takes part in ncclCommSplit
            group.split_excluded(timeout=timeout)
        return None
    return SubBackend(group, members, group.split(members, timeout=timeout))
