"""Transport benchmark: small-message round-trip latency and large-message one-way throughput.

Two processes on loopback. Each variant runs in the same invocation, interleaved
over several repeats, so the noisy shared machine affects them alike:

* ``python-socket``: plain blocking Python sockets (``sendall``/``recv_into``) with
  TCP_NODELAY, a 32-byte header per message like ferro's, the baseline;
* ``ferro-core-blocking``: ferro's compiled connection with spinning off (sleeps in
  poll at once, like a plain blocking receive);
* ``ferro-core-spin``: the compiled connection with its default bounded spin;
* ``ferro-backend``: the public ``TcpBackend.send``/``recv`` path (validation,
  locks, buffer checks) on top of the spinning connection.

Run: ``python bench/bench_transport.py [--repeats 5] [--json out.json]``.
Reports the median of the repeats, and each variant's ratio to the baseline.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import struct
import sys
import time

import numpy as np

HEADER = struct.Struct("<IIQQQ")
ROUND_TRIP_BYTES = 8
VARIANTS = ["python-socket", "ferro-core-blocking", "ferro-core-spin", "ferro-backend"]


def _socket_pair_over_tcp(rank: int, port: int) -> socket.socket:
    if rank == 0:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(1)
        sock, _ = listener.accept()
        listener.close()
    else:
        deadline = time.monotonic() + 30
        while True:
            try:
                sock = socket.create_connection(("127.0.0.1", port))
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class PythonSocketPeer:
    """The baseline: what a careful pure-Python implementation does."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.header = bytearray(HEADER.size)

    def send(self, buf: np.ndarray) -> None:
        self.sock.sendall(HEADER.pack(1, 1, buf.nbytes, 0, 0))
        self.sock.sendall(memoryview(buf).cast("B"))

    def recv(self, buf: np.ndarray) -> None:
        self._recv_exact(memoryview(self.header))
        length = HEADER.unpack(self.header)[2]
        if length != buf.nbytes:
            raise ValueError("size mismatch")
        self._recv_exact(memoryview(buf).cast("B"))

    def _recv_exact(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("closed")
            got += n


class CorePeer:
    def __init__(self, sock: socket.socket, rank: int, spin_us: float) -> None:
        from ferro._core.transport import Connection

        self.conn = Connection(sock, rank, 1 - rank, spin_us=spin_us)

    def send(self, buf: np.ndarray) -> None:
        self.conn.send(buf, timeout=60.0)

    def recv(self, buf: np.ndarray) -> None:
        self.conn.recv_into(buf, timeout=60.0)


class BackendPeer:
    def __init__(self, group) -> None:
        self.group = group
        self.peer = 1 - group.rank

    def send(self, buf: np.ndarray) -> None:
        self.group.send(buf, self.peer)

    def recv(self, buf: np.ndarray) -> None:
        self.group.recv(buf, self.peer)


def _latency(peer, rank: int, iterations: int) -> float:
    """Median round-trip time in microseconds, measured on rank 0."""
    buf = np.zeros(ROUND_TRIP_BYTES, np.uint8)
    times = []
    for _ in range(iterations):
        if rank == 0:
            start = time.perf_counter()
            peer.send(buf)
            peer.recv(buf)
            times.append(time.perf_counter() - start)
        else:
            peer.recv(buf)
            peer.send(buf)
    return statistics.median(times) * 1e6 if times else 0.0


def _throughput(peer, rank: int, nbytes: int, messages: int) -> float:
    """One-way GB/s: rank 0 sends ``messages`` of ``nbytes``, rank 1 acknowledges the last."""
    data = np.ones(nbytes, np.uint8)
    ack = np.zeros(ROUND_TRIP_BYTES, np.uint8)
    start = time.perf_counter()
    for _ in range(messages):
        if rank == 0:
            peer.send(data)
        else:
            peer.recv(data)
    if rank == 0:
        peer.recv(ack)
    else:
        peer.send(ack)
    elapsed = time.perf_counter() - start
    return nbytes * messages / elapsed / 1e9


def _make_peer(variant: str, rank: int, port: int, secret: str):
    if variant == "ferro-backend":
        from ferro.backend.tcp import TcpBackend

        return BackendPeer(TcpBackend(rank, 2, "127.0.0.1", port, secret=secret, timeout=60))
    sock = _socket_pair_over_tcp(rank, port)
    if variant == "python-socket":
        return PythonSocketPeer(sock)
    return CorePeer(sock, rank, spin_us=0.0 if variant == "ferro-core-blocking" else 50.0)


def _rank(rank: int, ports: list[int], args: argparse.Namespace, results: mp.Queue) -> None:
    secret = "bench"
    nbytes = args.size_mb * 1024 * 1024
    for repeat in range(args.repeats):
        for i, variant in enumerate(VARIANTS):
            peer = _make_peer(variant, rank, ports[repeat * len(VARIANTS) + i], secret)
            _latency(peer, rank, 500)  # warm-up
            latency = _latency(peer, rank, args.round_trips)
            throughput = _throughput(peer, rank, nbytes, args.messages)
            if rank == 0:
                results.put((variant, latency, throughput))
            if isinstance(peer, BackendPeer):
                peer.group.close()


def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--round-trips", type=int, default=5000)
    parser.add_argument("--size-mb", type=int, default=64)
    parser.add_argument("--messages", type=int, default=8)
    parser.add_argument("--json", help="write the raw per-repeat results here")
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    ports = _free_ports(args.repeats * len(VARIANTS))
    procs = [ctx.Process(target=_rank, args=(r, ports, args, results)) for r in range(2)]
    for p in procs:
        p.start()
    rows: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    for _ in range(args.repeats * len(VARIANTS)):
        variant, latency, throughput = results.get(timeout=600)
        rows[variant].append((latency, throughput))
    for p in procs:
        p.join(60)
    base_lat = statistics.median(r[0] for r in rows["python-socket"])
    base_tp = statistics.median(r[1] for r in rows["python-socket"])
    print(f"loopback, 2 processes, median of {args.repeats} repeats "
          f"({args.round_trips} round trips of {ROUND_TRIP_BYTES} B; {args.messages} x {args.size_mb} MiB one way)")
    print(f"{'variant':<22}{'round trip (us)':>16}{'vs baseline':>13}{'throughput (GB/s)':>19}{'vs baseline':>13}")
    for variant in VARIANTS:
        lat = statistics.median(r[0] for r in rows[variant])
        tp = statistics.median(r[1] for r in rows[variant])
        print(f"{variant:<22}{lat:>16.1f}{base_lat / lat:>12.2f}x{tp:>19.2f}{tp / base_tp:>12.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
