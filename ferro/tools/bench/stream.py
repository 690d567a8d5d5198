"""The line-rate reference on an emulated cluster: the raw full-duplex TCP stream of its links.

Every host sends to the next host of a ring and receives from the previous one
at the same time, one plain TCP connection each way and nothing else (the most
a collective's traffic over the same links could move): with two hosts, each
link carries a stream in both directions. :func:`measure_stream` runs one
``python -m ferro.tools.bench.stream`` per host, in its namespace, and returns
the slowest host's receive rate. :func:`stream_rows` turns that rate into the
time the links alone would need for each op's bytes, as rows of the bench's
table beside ferro's and its peers': ``link bytes / rate``.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time

from ferro.tools.bench.table import Row
from ferro.tools.emulate import EmulatedCluster

__all__ = ["link_bytes", "measure_stream", "stream_rows"]

CHUNK = 4 << 20
WARMUP_SECONDS = 0.5  # slow start, and the token bucket's first burst, are not the line rate
CONNECT_SECONDS = 20.0  # how long a host waits for its neighbours' streams to begin


def link_bytes(op: str, size: int, hosts: int, ranks_per_host: int = 1) -> float | None:
    """Bytes one host's link must carry each way for ``op`` on ``size`` bytes over ``hosts`` hosts (None: not modelled).

    allreduce: ``2 (H-1)/H`` of the buffer (a ring over hosts, after reducing
    within each); all_gather: the ``(H-1)/H`` of the result held elsewhere;
    reduce_scatter: the ``(H-1)/H`` of the input reduced elsewhere; broadcast
    and reduce: the message once, out of (into) the root's host; all_to_all
    (``size`` sent by each rank): what the host's ``ranks_per_host`` ranks send
    to the other hosts, ``R (H-1)/H`` of it.
    """
    if hosts < 2:
        return None
    share = (hosts - 1) / hosts
    return {"allreduce": 2 * share * size, "all_gather": share * size, "reduce_scatter": share * size,
            "broadcast": float(size), "reduce": float(size), "all_to_all": ranks_per_host * share * size}.get(op)


def stream_rows(rate_bytes_per_s: float, template: list[Row], hosts: int) -> list[Row]:
    """Return a ``stream`` row for each of ``template``'s (op, size): the link-limited time per call."""
    rows, seen = [], set()
    for row in template:
        needed = link_bytes(row.op, row.size, hosts, max(1, row.world_size // hosts))
        if needed is None or (row.op, row.size, row.world_size) in seen:
            continue
        seen.add((row.op, row.size, row.world_size))
        seconds_us = needed / rate_bytes_per_s * 1e6
        rows.append(Row("stream", row.op, row.size, row.count, row.dtype, row.redop, row.root, row.world_size,
                        seconds_us, seconds_us if row.ip_time_us is not None else None, None, None))
    return rows


def measure_stream(cluster: EmulatedCluster, seconds: float = 3.0, port: int = 29777) -> float:
    """Return the raw duplex stream's rate (bytes/s each way) of ``cluster``'s links: its slowest host's."""
    hosts = cluster.hosts
    processes = [subprocess.Popen(cluster.command(host, [
        sys.executable, "-m", "ferro.tools.bench.stream", "--listen", cluster.address(host), "--to",
        cluster.address((host + 1) % hosts), "--port", str(port), "--seconds", str(seconds)]),
        stdout=subprocess.PIPE, text=True) for host in range(hosts)]
    rates = []
    try:
        for process in processes:
            out, _ = process.communicate(timeout=seconds + CONNECT_SECONDS + 30)
            if process.returncode != 0:
                raise RuntimeError(f"the stream reference failed on a host (exit {process.returncode})")
            rates.append(json.loads(out.strip().splitlines()[-1])["received_bytes_per_s"])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()  # a host that never connected must not outlive the measurement
                process.wait()
    if min(rates) <= 0:  # seen at 32x1: one host's stream carried nothing in its window (32 ranks on 2 cores)
        raise RuntimeError(f"host {rates.index(min(rates))} received nothing in {seconds:g} s")
    return min(rates)


def _stream(listen: str, to: str, port: int, seconds: float) -> float:
    server = socket.create_server((listen, port))
    server.settimeout(CONNECT_SECONDS)
    deadline = time.monotonic() + CONNECT_SECONDS
    while True:
        try:
            outgoing = socket.create_connection((to, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    incoming, _ = server.accept()
    incoming.settimeout(seconds + CONNECT_SECONDS)  # a host that stops sending fails the measurement, not hangs it
    payload = memoryview(bytearray(CHUNK))
    stop = time.monotonic() + seconds

    def send() -> None:
        while time.monotonic() < stop:
            outgoing.sendall(payload)
        outgoing.shutdown(socket.SHUT_WR)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    buffer = memoryview(bytearray(CHUNK))
    counted, begin, end = 0, time.monotonic() + WARMUP_SECONDS, 0.0
    while True:
        got = incoming.recv_into(buffer)
        if not got:
            break
        now = time.monotonic()
        if now >= begin and now <= stop:
            counted += got
            end = now
    sender.join()
    return counted / max(end - begin, 1e-9)


def main(argv: list[str] | None = None) -> int:
    """One host's side of the stream: serve the previous host, stream to the next; print the receive rate."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--to", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args(argv)
    rate = _stream(args.listen, args.to, args.port, args.seconds)
    print(json.dumps({"received_bytes_per_s": rate}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
