"""The nccl-tests result table: rows, bandwidth factors, text, CSV and JSON.

Columns follow nccl-tests: ``size count type redop root`` then, for out-of-place
and in-place, ``time(us) algbw busbw #wrong``. GB = 1e9 bytes. ``algbw`` is
size / time; ``busbw`` scales it by the factor that makes it comparable with
the link's bandwidth: 2(n-1)/n for allreduce, (n-1)/n for all_gather,
reduce_scatter and all_to_all, 1 for broadcast, reduce and sendrecv.
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass

__all__ = ["HEADER", "Row", "bus_factor", "footer", "format_row", "write_csv", "write_json"]


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor for ``op`` at ``world_size`` ranks."""
    n = world_size
    if op == "allreduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op == "barrier":
        return 0.0
    return 1.0


@dataclass
class Row:
    """One size of one op for one library.

    Attributes:
        library: ``ferro``, ``torch-gloo`` or ``mpi``.
        op: The collective.
        size: Bytes (nccl-tests' convention: the whole result for all_gather).
        count: Elements in ``size``.
        dtype: Element type.
        redop: Reduction op, or ``none``.
        root: Root rank, or -1.
        world_size: Ranks.
        oop_time_us: Out-of-place time per call, the slowest rank's, in microseconds.
        ip_time_us: In-place time, or None where the op has no in-place form.
        oop_wrong: Wrong elements seen with --check, or None without it.
        ip_wrong: As ``oop_wrong`` for in-place.
        algorithm: The algorithm that ran (ferro's, by its rule or ``FERRO_ALGORITHM_ALLREDUCE``), or the library's.
        cpu_us: The busy CPU microseconds per call of rank 0's machine, for the call :meth:`time_us` times (every
            rank's work where they share that machine, as on one host or an emulated cluster), or None off Linux.
            The kernel counts it in 10 ms ticks: a row of few short calls measures it coarsely.

    """

    library: str
    op: str
    size: int
    count: int
    dtype: str
    redop: str
    root: int
    world_size: int
    oop_time_us: float
    ip_time_us: float | None
    oop_wrong: int | None
    ip_wrong: int | None
    algorithm: str = ""
    cpu_us: float | None = None

    def time_us(self) -> float:
        """Return the time used to compare libraries: in-place where the op has it, else out-of-place."""
        return self.ip_time_us if self.ip_time_us is not None else self.oop_time_us

    def algbw(self, in_place: bool = False) -> float | None:
        """Algorithm bandwidth in GB/s."""
        t = self.ip_time_us if in_place else self.oop_time_us
        if t is None or t <= 0:
            return None
        return self.size / (t * 1e-6) / 1e9

    def busbw(self, in_place: bool = False) -> float | None:
        """Bus bandwidth in GB/s."""
        bw = self.algbw(in_place)
        return None if bw is None else bw * bus_factor(self.op, self.world_size)


HEADER = (
    "#                                                              out-of-place                       in-place\n"
    "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw"
    " #wrong  algorithm\n"
    "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)"
)


def _cell(value: float | None, width: int, digits: int) -> str:
    return f"{'N/A':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def _wrong(value: int | None) -> str:
    return f"{'N/A':>6}" if value is None else f"{value:>6d}"


def format_row(row: Row) -> str:
    """Format the row as nccl-tests prints it."""
    return (f"{row.size:>12d}  {row.count:>12d}  {row.dtype:>8}  {row.redop:>6}  {row.root:>6d}  "
            f"{_cell(row.oop_time_us, 7, 1)} {_cell(row.algbw(), 7, 2)} {_cell(row.busbw(), 7, 2)} "
            f"{_wrong(row.oop_wrong)}  {_cell(row.ip_time_us, 7, 1)} {_cell(row.algbw(True), 7, 2)} "
            f"{_cell(row.busbw(True), 7, 2)} {_wrong(row.ip_wrong)}  {row.algorithm}").rstrip()


def footer(rows: list[Row]) -> str:
    """nccl-tests' closing lines: wrong results and the average bus bandwidth."""
    values = [bw for row in rows for bw in (row.busbw(), row.busbw(True)) if bw is not None]
    wrong = sum((row.oop_wrong or 0) + (row.ip_wrong or 0) for row in rows)
    checked = any(row.oop_wrong is not None for row in rows)
    average = sum(values) / len(values) if values else 0.0
    lines = [f"# Out of bounds values : {wrong if checked else 'N/A'} {'OK' if wrong == 0 else 'FAILED'}",
             f"# Avg bus bandwidth    : {average:.4f} "]
    return "\n".join(lines)


def write_csv(path: str, rows: list[Row]) -> None:
    """Write the rows, with algbw and busbw, the algorithm and the machine's CPU per call, as CSV."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["library", "op", "size", "count", "type", "redop", "root", "world_size",
                         "oop_time_us", "oop_algbw", "oop_busbw", "oop_wrong",
                         "ip_time_us", "ip_algbw", "ip_busbw", "ip_wrong", "algorithm", "cpu_us"])
        for r in rows:
            writer.writerow([r.library, r.op, r.size, r.count, r.dtype, r.redop, r.root, r.world_size,
                             r.oop_time_us, r.algbw(), r.busbw(), r.oop_wrong,
                             r.ip_time_us, r.algbw(True), r.busbw(True), r.ip_wrong, r.algorithm, r.cpu_us])


def write_json(path: str, rows: list[Row]) -> None:
    """Write the rows as a JSON list of objects."""
    with open(path, "w") as f:
        json.dump([asdict(r) | {"oop_busbw": r.busbw(), "ip_busbw": r.busbw(True)} for r in rows], f, indent=1)


def read_json(path: str) -> list[Row]:
    """Read rows written by :func:`write_json`."""
    with open(path) as f:
        items = json.load(f)
    return [Row(**{k: v for k, v in item.items() if k in Row.__dataclass_fields__}) for item in items]
