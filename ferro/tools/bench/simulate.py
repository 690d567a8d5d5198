"""``ferro bench --simulate HxR@RATE[,LATENCY]``: ferro's own schedules replayed on a model of the network.

The steps are the ones the compiled executor runs (:func:`ferro._core.collectives.plan_steps`, the iterator of
``_core/schedule.h``), cut into the same segments; nothing here describes an algorithm a second time. The model:

* ``H`` hosts of ``R`` ranks each (rank ``r`` on host ``r // R``, as ``ferro run --nnodes`` places them), each
  host with one link to a non-blocking switch, ``RATE`` bytes per second each way, shared by its ranks: a message
  between hosts holds its sender's uplink and its receiver's downlink, first come first served;
* every message pays ``LATENCY`` on the wire and a per-message CPU ``overhead`` at its sender; messages between
  ranks of one host go through memory at ``local_rate``; a link may hold a token bucket (``Network.burst``, as
  ``tc`` shapes an emulated one: bytes saved up while it idles pass at once), none by default;
* the ranks' CPU work (each message's ``overhead`` at its sender, its ``cpu_per_byte`` and reduction at its
  receiver) may need one of a pool of ``cores`` (per host, or one pool for every host where one machine
  emulates the cluster), first come first served; by default every rank has a core of its own;
* a rank runs its steps in order; a step sends and receives one segment each way at a time (as
  ``_exchange_segments`` does), and a reducing step then reduces what arrived at ``reduce_rate``;
* except the ring, which streams as ``_stream_ring`` runs it: each chunk in :func:`~ferro._core.collectives.ring_piece`
  frames, a frame of step ``k + 1`` leaving once the frame of step ``k`` holding its bytes has arrived and been
  reduced, sends and receives each in their own order (:func:`replay_streams`).

It predicts the slowest rank's time, and gives the textbook lower bounds beside it (:func:`lower_bound`).
"""

from __future__ import annotations

import heapq
import re
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ferro._core import collectives as native

__all__ = ["ALGORITHMS", "BROADCAST_ALGORITHMS", "OP_ALGORITHMS", "Network", "lower_bound", "parse_network", "predict",
           "replay", "replay_streams", "traffic"]

#: The schedules the simulator replays, by the name ``ferro.allreduce(algorithm=...)`` takes.
ALGORITHMS = {"ring": native.ALGORITHM_RING, "recursive_doubling": native.ALGORITHM_RECURSIVE_DOUBLING,
              "halving_doubling": native.ALGORITHM_HALVING_DOUBLING}
_RATE_UNITS = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "kbps": 1e3 / 8, "mbps": 1e6 / 8,
               "gbps": 1e9 / 8, "kb": 1e3, "mb": 1e6, "gb": 1e9}
_TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclass(frozen=True)
class Network:
    """A cluster as the simulator sees it.

    Attributes:
        hosts: Hosts.
        ranks_per_host: Ranks on each host.
        rate: Bytes per second each way on a host's link.
        latency: Seconds a message spends on the wire beyond its bytes (one way).
        overhead: Sender CPU seconds per message.
        local_rate: Bytes per second between two ranks of one host.
        local_latency: Seconds per message between two ranks of one host.
        reduce_rate: Bytes per second a rank reduces.
        burst: Bytes each way of a host's link may pass at ``local_rate`` rather than ``rate``, refilled at
            ``rate`` while the link is idle: a token bucket of that size, as ``tc``'s ``tbf`` shapes an emulated
            link (:data:`ferro.tools.emulate`'s links hold 64 KiB at 100 Mbit). 0, the default: a plain line, as a
            NIC sends.
        cpu_per_byte: CPU seconds per byte a message carries (both ends' copies and the kernel's work on it),
            charged to the receiver as the bytes land, so that a stream's next frame crosses the link meanwhile
            (as the kernel's buffers let it); ``overhead`` is the rest of a message's CPU, at its sender.
        cores: Cores the ranks' CPU work runs on (each message's ``overhead`` at its sender, and its
            ``cpu_per_byte`` and reduction at its receiver): a rank whose work finds every core busy waits for
            one. 0, the default: a core per rank, no waiting.
        cores_shared: The ``cores`` are one pool for every host (one machine running the whole cluster, as
            ``ferro bench --emulate`` does) rather than each host's own.

    """

    hosts: int
    ranks_per_host: int
    rate: float
    latency: float = 50e-6
    overhead: float = 5e-6
    local_rate: float = 4e9
    local_latency: float = 5e-6
    reduce_rate: float = 4e9
    burst: float = 0.0
    cpu_per_byte: float = 0.0
    cores: int = 0
    cores_shared: bool = False

    @property
    def world_size(self) -> int:
        """The ranks of the whole cluster."""
        return self.hosts * self.ranks_per_host


def parse_network(text: str) -> Network:
    """Parse ``HxR@RATE[,LATENCY]``: ``16x1@100mbit``, ``8x2@200mbit,100us``, ``256x8@25gbit,5us``.

    Raises:
        ValueError: The text is not of that form.

    """
    match = re.fullmatch(r"(\d+)x(\d+)@([\d.]+)([a-z]+)(?:,([\d.]+)([a-z]+))?", text.strip().lower())
    if not match or match.group(4) not in _RATE_UNITS or (match.group(6) and match.group(6) not in _TIME_UNITS):
        raise ValueError(f"--simulate {text!r}: expected HOSTSxRANKS@RATE[,LATENCY], e.g. 16x1@100mbit or "
                         f"8x2@25gbit,5us (rates in kbit, mbit, gbit; latency in ns, us, ms, s)")
    hosts, ranks = int(match.group(1)), int(match.group(2))
    if hosts < 1 or ranks < 1:
        raise ValueError(f"--simulate {text!r}: at least one host of one rank")
    rate = float(match.group(3)) * _RATE_UNITS[match.group(4)]
    network = Network(hosts, ranks, rate)
    if match.group(5):
        network = Network(hosts, ranks, rate, latency=float(match.group(5)) * _TIME_UNITS[match.group(6)])
    return network


Step = tuple[int, int, int, int, int, int, int, int]


class _Link:
    """One way of a host's link: busy until ``free``, when its bucket held ``tokens`` bytes.

    The bucket starts empty: the calls a replay stands for follow warm-up calls, which drained it wherever the
    link is what they wait for; where it is not, the idle spells between messages refill it in the replay too.
    """

    __slots__ = ("free", "tokens")

    def __init__(self) -> None:
        self.free = 0.0
        self.tokens = 0.0


def _links(network: Network) -> list[_Link]:
    return [_Link() for _ in range(network.hosts)]


def _through(network: Network, link: _Link, start: float, nbytes: int) -> tuple[float, float]:
    """Return when ``nbytes`` starting at ``start`` have passed ``link`` alone, and the tokens it has left then.

    The bucket's tokens pass at ``local_rate``, the rest at ``rate`` (without a bucket: all of it at ``rate``).
    """
    tokens = min(network.burst, link.tokens + (start - link.free) * network.rate)
    if tokens >= nbytes:
        return start + nbytes / network.local_rate, tokens - nbytes
    return start + tokens / network.local_rate + (nbytes - tokens) / network.rate, 0.0


def _cross(network: Network, up: list[_Link], down: list[_Link], a: int, b: int, at: float, nbytes: int) -> float:
    """Return when ``nbytes`` ready at ``at`` have left host ``a`` for host ``b`` (the sender's buffer free).

    The message holds ``a``'s uplink and ``b``'s downlink, first come first served, and leaves when the slower
    of the two has passed it.
    """
    start = max(at, up[a].free, down[b].free)
    up_done, up_tokens = _through(network, up[a], start, nbytes)
    down_done, down_tokens = _through(network, down[b], start, nbytes)
    leaves = max(up_done, down_done)
    # Each bucket refills from when its own link passed the message until the message has left.
    up[a].tokens = min(network.burst, up_tokens + (leaves - up_done) * network.rate)
    down[b].tokens = min(network.burst, down_tokens + (leaves - down_done) * network.rate)
    up[a].free = down[b].free = leaves
    return leaves


class _Cores:
    """The cores the ranks' CPU work runs on: each pool a heap of the times its cores come free."""

    def __init__(self, network: Network) -> None:
        self.network = network
        pools = 0 if network.cores <= 0 else 1 if network.cores_shared else network.hosts
        self.pools = [[0.0] * network.cores for _ in range(pools)]

    def run(self, rank: int, ready: float, seconds: float) -> float:
        """Return when ``seconds`` of ``rank``'s CPU work, ready at ``ready``, is done."""
        if not self.pools or seconds <= 0:
            return ready + seconds
        pool = self.pools[0 if self.network.cores_shared else rank // self.network.ranks_per_host]
        start = max(ready, pool[0])  # the core that comes free first
        heapq.heapreplace(pool, start + seconds)
        return start + seconds

    def landed(self, nbytes: int, reduce_bytes: int) -> float:
        """Return the receiver's CPU seconds for a message of ``nbytes`` that reduces ``reduce_bytes``."""
        return nbytes * self.network.cpu_per_byte + reduce_bytes / self.network.reduce_rate


def replay(network: Network, steps_of: Callable[[int], Sequence[Step]], segment: int) -> float:
    """Return the seconds until the slowest rank has run every step ``steps_of(rank)`` gives, on ``network``.

    Each step is cut into ``segment``-byte exchanges as the executor cuts it. A discrete-event replay: events
    are taken in time order, so the links are granted in the order the messages reach them.
    """
    n, per_host = network.world_size, network.ranks_per_host
    plans = [_exchanges(steps_of(rank), segment) for rank in range(n)]
    position = [0] * n
    up, down = _links(network), _links(network)  # each host's link, each way
    cores = _Cores(network)
    arrivals: dict[tuple[int, int], deque[float]] = defaultdict(deque)   # (src, dst) -> arrival times, in order
    waiting: dict[tuple[int, int], tuple[int, float, float]] = {}  # (src, dst) -> the receiver's op
    finished = [0.0] * n
    events = [(0.0, rank, 0.0) for rank in range(n)]  # (when a rank starts its next exchange, or works on what
    # landed, the rank, that work's seconds)
    heapq.heapify(events)

    def send(src: int, dst: int, nbytes: int, start: float) -> float:
        """Put one message on its way; return when it has left the sender (its buffer is free)."""
        at = cores.run(src, start, network.overhead)
        if src // per_host == dst // per_host:
            leaves = at + nbytes / network.local_rate
            arrival = leaves + network.local_latency
        else:
            leaves = _cross(network, up, down, src // per_host, dst // per_host, at, nbytes)
            arrival = leaves + network.latency
        key = (src, dst)
        if key in waiting:  # the receiver is already in the exchange that takes this message
            rank, sent_done, work = waiting.pop(key)
            finish(rank, max(sent_done, arrival), work)
        else:
            arrivals[key].append(arrival)
        return leaves

    def finish(rank: int, done: float, work: float) -> None:
        """Mark the exchange done at ``done`` but for the receiver's ``work`` seconds on what landed."""
        if work and cores.pools:
            # Take a core when the bytes are there: a core taken now for later would stay idle until then for
            # work that is ready earlier.
            heapq.heappush(events, (done, rank, work))
            return
        position[rank] += 1
        heapq.heappush(events, (done + work, rank, 0.0))

    while events:
        now, rank, landed = heapq.heappop(events)
        if landed:
            position[rank] += 1
            heapq.heappush(events, (cores.run(rank, now, landed), rank, 0.0))
            continue
        if position[rank] >= len(plans[rank]):
            finished[rank] = now
            continue
        dst, out_bytes, src, in_bytes, reduce_bytes = plans[rank][position[rank]]
        sent_done = send(rank, dst, out_bytes, now) if dst >= 0 else now
        work = cores.landed(in_bytes, reduce_bytes)
        if src < 0:
            finish(rank, sent_done, 0.0)
        elif arrivals[(src, rank)]:
            finish(rank, max(sent_done, arrivals[(src, rank)].popleft()), work)
        else:
            waiting[(src, rank)] = (rank, sent_done, work)
    if waiting:
        raise RuntimeError(f"the schedules deadlock: {len(waiting)} receives never matched (ranks "
                           f"{sorted(r for r, *_ in waiting.values())[:8]})")
    return max(finished)


def replay_symmetric(network: Network, steps_of: Callable[[int], Sequence[Step]], segment: int) -> float:
    """Return :func:`replay`'s seconds for a plan every host runs alike, from the plans of host 0's ranks alone.

    The ring, Bruck's plans, the pairwise exchange, the dissemination barrier, and recursive doubling and
    halving-doubling on a power of two of hosts look the same from every host (rotated, or XORed): every rank
    does its i-th exchange at the same moment, and each host's link carries in each direction what host 0's
    ranks send off the host. So a step lasts as long as host 0's slowest rank needs for it, its link shared by
    those of its ranks sending off the host. It costs R plans instead of H x R, which is what makes 16,384 ranks
    predictable; ``tests/test_schedule.py`` holds it to the full replay where both run: equal at one rank per
    host, an upper estimate within 2x with several (their lockstep and shared link cost more than the replay's
    overlap). Its links are plain lines: it ignores ``burst``. Each host's ``cores`` bound a step by its ranks'
    CPU work; cores shared by every host (``cores_shared``) are not replayed this way (:func:`predict` refuses).
    """
    per_host = network.ranks_per_host
    plans = [_exchanges(steps_of(rank), segment) for rank in range(min(per_host, network.world_size))]
    total = 0.0
    def leaves(peer: int) -> bool:  # a message to or from this peer crosses host 0's link
        return peer >= 0 and peer // per_host != 0

    for step in zip(*plans, strict=True):
        # Each direction of host 0's link carries what its ranks send off the host (and, alike, receive).
        uplink = sum(out for dst, out, *_ in step if leaves(dst))
        downlink = sum(inn for _, _, src, inn, _ in step if leaves(src))
        slowest = work = 0.0
        for dst, out, src, inn, red in step:
            if leaves(dst) or leaves(src):
                wire = max(uplink, downlink) / network.rate + network.latency
            else:
                wire = max(out, inn) / network.local_rate + network.local_latency
            cpu = network.overhead + inn * network.cpu_per_byte + red / network.reduce_rate
            slowest = max(slowest, cpu + wire)
            work += cpu
        if network.cores > 0:  # the host's ranks' CPU work of the step on its cores
            slowest = max(slowest, work / network.cores)
        total += slowest
    return total


#: The plans every host runs alike (see :func:`replay_symmetric`); recursive doubling and halving-doubling only
#: on a power of two of ranks, where no rank folds.
SYMMETRIC = {("allreduce", "ring"), ("all_gather", "ring"), ("all_gather", "bruck"), ("reduce_scatter", "ring"),
             ("all_to_all", "pairwise"), ("all_to_all", "bruck"), ("barrier", "dissemination")}
#: Above this many exchanges in all, :func:`predict` replays a symmetric plan from host 0's ranks alone.
FULL_REPLAY_EXCHANGES = 2_000_000


#: A rank's streamed plan: its sends ``(dst, bytes, dep)``, each leaving once its receive number ``dep`` is done
#: (-1: at once), and its receives ``(src, bytes, reduced bytes)``, in order.
Streams = tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]


def _streams(calls: Sequence[Sequence[Step]], segment: int, piece: int, itemsize: int) -> Streams:
    """Cut ring plans (one per call, back to back) into ``_stream_ring``'s frames and its rule for when each leaves.

    A frame of step ``k`` waits for the frame of step ``k - 1``'s receive that ends at or past its own bytes (when
    those bytes are what step ``k - 1`` received), else for all of step ``k - 1``'s receives; a call's first step
    waits for the previous call to have received everything (the executor returns only then). A call's send
    number ``i`` also waits for its receive number ``i - RING_LEAD_FRAMES - 1``, or for all its receives where
    it has fewer.
    """
    sends: list[tuple[int, int, int]] = []
    recvs: list[tuple[int, int, int]] = []
    for steps in calls:
        before_call, first_send = len(recvs) - 1, len(sends)
        previous: tuple[int, int, list[int]] | None = None  # the last step's (recv_off, recv_len, piece ends)
        for k, (send_peer, send_off, send_len, recv_peer, recv_off, recv_len, flags, _) in enumerate(steps):
            first_of_step = len(recvs)
            if send_peer >= 0 and send_len:
                size = native.ring_piece(send_len, segment, piece, itemsize)
                for pos in range(0, send_len, size):
                    a = min(size, send_len - pos)
                    if k == 0 or flags & native.STEP_SEND_SOURCE:
                        dep = before_call
                    elif previous is not None and previous[0] <= send_off + pos and (
                            send_off + pos + a <= previous[0] + previous[1]):
                        # The earliest of the last step's receives whose end reaches this frame's end.
                        dep = next(i for i, end in enumerate(previous[2], start=first_of_step - len(previous[2]))
                                   if end >= send_off + pos + a)
                    else:
                        dep = first_of_step - 1
                    sends.append((send_peer, a, dep))
            ends: list[int] = []
            if recv_peer >= 0 and recv_len:
                size = native.ring_piece(recv_len, segment, piece, itemsize)
                for pos in range(0, recv_len, size):
                    b = min(size, recv_len - pos)
                    recvs.append((recv_peer, b, b if flags & native.STEP_REDUCE else 0))
                    ends.append(recv_off + pos + b)
            previous = (recv_off, recv_len if recv_peer >= 0 else 0, ends)
        last = len(recvs) - 1
        for i in range(first_send, len(sends)):
            clocked = min(before_call + (i - first_send) - native.RING_LEAD_FRAMES, last)  # past the last: all
            if clocked > sends[i][2]:
                sends[i] = (sends[i][0], sends[i][1], clocked)
    return sends, recvs


def replay_streams(network: Network, streams_of: Callable[[int], Streams], symmetric: bool = False) -> float:
    """Return the seconds until the slowest rank has sent and received all its streamed frames on ``network``.

    A rank sends its frames in order, one at a time (a frame holds the rank for ``overhead``, then its links as
    :func:`replay` holds them), each once its ``dep`` receive is done; it takes its receives in order, each
    reduced as it lands. With ``symmetric`` only host 0's ranks are replayed, for a plan every host runs alike
    rotated by whole hosts (the ring): what host 0 sends off the host to host ``h`` stands for what it receives
    from host ``-h`` at the same moment, so each of its messages off the host also arrives, relabelled, at host 0,
    and its link's two ways are in the same state. At one rank per host it gives what the full replay gives.
    """
    n, per_host, hosts = network.world_size, network.ranks_per_host, network.hosts
    ranks = range(per_host if symmetric else n)
    plans = {rank: streams_of(rank) for rank in ranks}
    up, down = _links(network), _links(network)
    cores = _Cores(network)
    arrivals: dict[tuple[int, int], deque[float]] = defaultdict(deque)
    next_send = dict.fromkeys(ranks, 0)
    next_recv = dict.fromkeys(ranks, 0)
    send_free = dict.fromkeys(ranks, 0.0)
    recv_busy = dict.fromkeys(ranks, False)
    finished = dict.fromkeys(ranks, 0.0)
    events: list[tuple[float, int, int, int]] = [(0.0, 0, rank, -1) for rank in ranks]  # (time, kind, rank, src)

    def push(time: float, kind: int, rank: int, src: int) -> None:
        heapq.heappush(events, (time, kind, rank, src))

    def try_send(rank: int, now: float) -> None:
        sends, _ = plans[rank]
        i = next_send[rank]
        if i >= len(sends) or send_free[rank] > now or sends[i][2] >= next_recv[rank] - recv_busy[rank]:
            return  # nothing left, the last frame still leaving, or its bytes not received yet
        dst, nbytes, _ = sends[i]
        at = cores.run(rank, now, network.overhead)
        a, b = rank // per_host, dst // per_host
        if a == b:
            leaves = at + nbytes / network.local_rate
            arrival, to, src = leaves + network.local_latency, dst, rank
        else:
            leaves = _cross(network, up, down, a, 0 if symmetric else b, at, nbytes)
            arrival = leaves + network.latency
            host = dst // per_host
            to, src = (dst - host * per_host, (rank + (hosts - host) * per_host) % n) if symmetric else (dst, rank)
        next_send[rank] = i + 1
        send_free[rank] = leaves
        finished[rank] = max(finished[rank], leaves)
        push(arrival, 1, to, src)
        push(leaves, 0, rank, -1)

    def try_recv(rank: int, now: float) -> None:
        _, recvs = plans[rank]
        i = next_recv[rank]
        if recv_busy[rank] or i >= len(recvs) or not arrivals[(recvs[i][0], rank)]:
            return
        arrival = arrivals[(recvs[i][0], rank)].popleft()
        recv_busy[rank] = True
        next_recv[rank] = i + 1
        push(cores.run(rank, max(now, arrival), cores.landed(recvs[i][1], recvs[i][2])), 2, rank, -1)

    while events:
        now, kind, rank, src = heapq.heappop(events)
        if kind == 1:    # a frame arrived from src
            arrivals[(src, rank)].append(now)
            try_recv(rank, now)
        elif kind == 2:  # a receive is done (and reduced)
            recv_busy[rank] = False
            finished[rank] = max(finished[rank], now)
            try_recv(rank, now)
            try_send(rank, now)
        else:            # the rank's last frame has left (or it starts)
            try_send(rank, now)
    stuck = [rank for rank in ranks if next_send[rank] < len(plans[rank][0]) or next_recv[rank] < len(plans[rank][1])]
    if stuck:
        raise RuntimeError(f"the streamed plans deadlock: ranks {stuck[:8]} never finished")
    return max(finished.values())


def _exchanges(steps: Sequence[Step], segment: int) -> list[tuple[int, int, int, int, int]]:
    """Cut each step into the executor's one-segment-each-way exchanges: (dst, bytes out, src, bytes in, reduced)."""
    out: list[tuple[int, int, int, int, int]] = []
    for send_peer, _, send_len, recv_peer, _, recv_len, flags, _ in steps:
        position = 0
        while position < send_len or position < recv_len:
            a = min(segment, max(0, send_len - position))
            b = min(segment, max(0, recv_len - position))
            if a or b:
                out.append((send_peer if a else -1, a, recv_peer if b else -1, b,
                            b if flags & native.STEP_REDUCE else 0))
            position += segment
    return out


#: Every op's schedules, by the names ``ferro bench`` rows give them.
OP_ALGORITHMS: dict[str, dict[str, int]] = {
    "allreduce": ALGORITHMS,
    "broadcast": native.BROADCAST_PLANS,
    "all_gather": {"ring": native.ALGORITHM_RING, "bruck": native.ALGORITHM_BRUCK},
    "reduce_scatter": {"ring": native.ALGORITHM_RING},
    "all_to_all": {"pairwise": native.ALGORITHM_PAIRWISE, "bruck": native.ALGORITHM_BRUCK_ALL_TO_ALL},
    "barrier": {"dissemination": native.ALGORITHM_DISSEMINATION},
    "reduce": native.REDUCE_PLANS,
}
#: Broadcast's schedules (``OP_ALGORITHMS["broadcast"]``).
BROADCAST_ALGORITHMS = OP_ALGORITHMS["broadcast"]


def _plans(network: Network, algorithm: str, nbytes: int, itemsize: int, segment: int, op: str, root: int,
           latency_bytes: float) -> tuple[Callable[[int], Sequence[Step]], int, int]:
    """Return each rank's steps of one call, the segment they are cut into, and the elements per rank."""
    if op not in OP_ALGORITHMS or algorithm not in OP_ALGORITHMS[op]:
        known = ", ".join(f"{o}: {'/'.join(a)}" for o, a in OP_ALGORITHMS.items())
        raise ValueError(f"no schedule of {op} named {algorithm!r} to replay; the simulator has {known}")
    n, code = network.world_size, OP_ALGORITHMS[op][algorithm]
    count = max(nbytes // itemsize, 1)
    steps_of: Callable[[int], Sequence[Step]]
    if op == "allreduce":
        steps_of = lambda rank: native.plan_steps(code, rank, n, count, itemsize)  # noqa: E731
    elif op == "broadcast":
        if algorithm == "pipelined chain":
            segment = native.chain_segment(nbytes, n, latency_bytes)
        steps_of = lambda rank: native.plan_steps(code, rank, n, nbytes, 1, root=root, segment=segment)  # noqa: E731
    elif op == "reduce":
        if algorithm == "pipelined chain":
            segment = native.chain_segment(nbytes, n, latency_bytes)
        steps_of = lambda rank: native.plan_steps(code, rank, n, count, itemsize, root=root,  # noqa: E731
                                                  segment=segment)
    elif op == "reduce_scatter":
        steps_of = lambda rank: native.plan_steps(code, rank, n, count, itemsize, phases=1, source=True)  # noqa: E731
    elif op == "all_gather" and algorithm == "ring":
        steps_of = lambda rank: native.plan_steps(code, rank, n, count, itemsize, phases=2)  # noqa: E731
    else:  # all_gather's Bruck, all_to_all: each rank's block, or the block to each peer
        block = max(count // n, 1)
        steps_of = lambda rank: native.plan_steps(code, rank, n, block, itemsize)  # noqa: E731
    return steps_of, segment, count


def _ring_streams(op: str, steps_of: Callable[[int], Sequence[Step]], segment: int, piece: int, itemsize: int,
                  calls: int) -> Callable[[int], Streams]:
    unit = 1 if op == "all_gather" else itemsize  # the all_gather's frames are cut in bytes, the others' in elements
    return lambda rank: _streams([steps_of(rank)] * max(calls, 1), segment, piece or segment, unit)


def traffic(network: Network, algorithm: str, nbytes: int, itemsize: int = 4,
            segment: int = native.DEFAULT_SEGMENT_BYTES, op: str = "allreduce", root: int = 0,
            latency_bytes: float = native.DEFAULT_LATENCY_BYTES, piece: int = 0) -> tuple[int, int, int]:
    """Return what one call of ``op`` with ``algorithm`` moves, over every rank: messages, bytes, reduced bytes.

    The messages are the frames :func:`predict` replays (the ring's streamed frames, the other plans'
    segments), from the same plans; arguments as :func:`predict`'s. ``ferro bench --fit`` divides a call's
    measured CPU time among them (:attr:`Network.overhead`, :attr:`Network.cpu_per_byte`).
    """
    steps_of, segment, _ = _plans(network, algorithm, nbytes, itemsize, segment, op, root, latency_bytes)
    messages = sent = reduced = 0
    for rank in range(network.world_size):
        if algorithm == "ring":
            sends, recvs = _ring_streams(op, steps_of, segment, piece, itemsize, 1)(rank)
            messages += len(sends)
            sent += sum(size for _, size, _ in sends)
            reduced += sum(red for *_, red in recvs)
        else:
            for dst, out, _, _, red in _exchanges(steps_of(rank), segment):
                messages += dst >= 0
                sent += out
                reduced += red
    return messages, sent, reduced


def predict(network: Network, algorithm: str, nbytes: int, itemsize: int = 4,
            segment: int = native.DEFAULT_SEGMENT_BYTES, op: str = "allreduce", root: int = 0,
            latency_bytes: float = native.DEFAULT_LATENCY_BYTES, method: str = "auto", calls: int = 1,
            piece: int = 0) -> float:
    """Return the predicted seconds of one call of ``op`` with ``algorithm`` on ``network``.

    ``nbytes`` is the size a ``ferro bench`` row gives: the allreduce's and broadcast's message, the all_gather's
    output, the reduce_scatter's input, the all_to_all's bytes sent per rank. A pipelined chain is cut as the
    mesh cuts it for a link of ``latency_bytes`` (:func:`ferro._core.collectives.chain_segment`). ``method``:
    ``"full"`` replays every rank (:func:`replay`), ``"symmetric"`` host 0's ranks (:func:`replay_symmetric`, for
    the plans in :data:`SYMMETRIC`), ``"auto"`` the full replay unless it would take more than
    :data:`FULL_REPLAY_EXCHANGES` exchanges and the plan is symmetric. ``calls``: replay that many calls back to
    back, each rank starting its next call as soon as its own part of the last is done (as ``ferro bench`` times
    them), and return the time per call: a pipelined chain's successive broadcasts overlap. ``segment`` and
    ``piece`` are the mesh's ``segment_bytes`` and ``piece_bytes`` (0: the segment): the frames the plans are cut
    into (:meth:`ferro.backend.cost_model.CostModel.segment_bytes`, ``piece_bytes``).

    Raises:
        ValueError: ``op`` or ``algorithm`` is not one the simulator replays, or a symmetric replay of a plan
            that is not symmetric.

    """
    steps_of, segment, count = _plans(network, algorithm, nbytes, itemsize, segment, op, root, latency_bytes)
    n = network.world_size
    symmetric = (op, algorithm) in SYMMETRIC or (algorithm in ("recursive_doubling", "halving_doubling")
                                                 and n & (n - 1) == 0 and network.hosts & (network.hosts - 1) == 0)
    if algorithm == "ring" and count < n:
        symmetric = False  # chunks of nothing: the ranks holding one element do more steps than the others
    if method == "symmetric" and not symmetric:
        raise ValueError(f"{op}'s {algorithm} at {n} ranks is not the same from every host: replay it in full")
    if network.cores > 0 and network.cores_shared:
        if method == "symmetric":
            raise ValueError("cores shared by every host (one machine emulating the cluster) need every rank "
                             "replayed: give method='full'")
        symmetric = False  # host 0's ranks alone would have the whole machine's cores
    if algorithm == "ring":  # it streams
        streams_of = _ring_streams(op, steps_of, segment, piece, itemsize, calls)
        if method == "auto" and symmetric and n * len(streams_of(0)[0]) > FULL_REPLAY_EXCHANGES:
            method = "symmetric"
        return replay_streams(network, streams_of, symmetric=method == "symmetric") / max(calls, 1)
    if calls > 1:
        one_call = steps_of
        steps_of = lambda rank: list(one_call(rank)) * calls  # noqa: E731
    if method == "auto" and symmetric and n * len(_exchanges(steps_of(0), segment)) > FULL_REPLAY_EXCHANGES:
        method = "symmetric"
    seconds = replay_symmetric(network, steps_of, segment) if method == "symmetric" else replay(network, steps_of,
                                                                                                 segment)
    return seconds / max(calls, 1)


def lower_bound(network: Network, nbytes: int, op: str = "allreduce") -> float:
    """Return the textbook lower bound of ``op`` of ``nbytes`` (as :func:`predict` counts them).

    Bandwidth: what each host's link must carry at the least (ranks of one host may combine first), at
    ``rate``; inside one host at ``local_rate``. Latency: one message's. (The textbook's ceil(log2 n) rounds of
    latency assume a rank sends one message per round; in this model a sender is busy only ``overhead`` per
    message, so a root reaches four children in about one latency, and the round count is no bound.)

    * allreduce: each host sends and receives 2 (H - 1) / H of the data;
    * broadcast: the root's host sends the message once; reduce: the root's host receives it once (every
      element of the result depends on the other hosts' data);
    * all_gather, reduce_scatter: each host receives (sends) (H - 1) / H of the whole;
    * all_to_all: each host sends what its R ranks send to the other hosts, R (H - 1) / H of a rank's bytes.
    """
    hosts, per_host, n = network.hosts, network.ranks_per_host, network.world_size
    if n < 2:
        return 0.0
    share = {"allreduce": 2 * (hosts - 1) / hosts, "broadcast": 1.0 if hosts > 1 else 0.0,
             "reduce": 1.0 if hosts > 1 else 0.0,
             "all_gather": (hosts - 1) / hosts, "reduce_scatter": (hosts - 1) / hosts,
             "all_to_all": per_host * (hosts - 1) / hosts, "barrier": 0.0}[op]
    local = {"allreduce": 2 * (n - 1) / n, "broadcast": 1.0, "reduce": 1.0, "all_gather": (n - 1) / n,
             "reduce_scatter": (n - 1) / n, "all_to_all": (n - 1) / n, "barrier": 0.0}[op]
    bandwidth = share * nbytes / network.rate if hosts > 1 else local * nbytes / network.local_rate
    latency = network.latency if hosts > 1 else network.local_latency
    return max(bandwidth, latency)
