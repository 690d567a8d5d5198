"""Bus bandwidth and latency against message size, one line per library, op and world size (matplotlib)."""

from __future__ import annotations

from ferro.errors import BackendUnavailableError
from ferro.tools.bench.table import Row

__all__ = ["lines", "plot"]


def lines(rows: list[Row]) -> dict[str, list[Row]]:
    """Group ``rows`` into the plot's lines: label -> rows by size, one per library, op and world size.

    A sweep of several world sizes (``-n 2,4,8``) draws a line per size, named after it, never one
    zigzag through all of them.
    """
    series: dict[tuple[str, str, int], list[Row]] = {}
    for row in rows:
        if row.size > 0:
            series.setdefault((row.library, row.op, row.world_size), []).append(row)
    several = len({world for _, _, world in series}) > 1
    return {f"{library} {op}" + (f", {world} ranks" if several else ""): sorted(points, key=lambda r: r.size)
            for (library, op, world), points in sorted(series.items())}


def plot(path: str, rows: list[Row]) -> None:
    """Draw ``rows`` into ``path`` (PNG).

    Raises:
        BackendUnavailableError: matplotlib is not installed (``pip install 'ferro[plot]'``).

    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise BackendUnavailableError("--plot needs matplotlib: pip install 'ferro[plot]'") from exc
    figure, (bandwidth, latency) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, points in lines(rows).items():
        style = "-" if label.startswith("ferro") else "--"
        in_place = all(p.ip_time_us is not None for p in points)
        bandwidth.plot([p.size for p in points], [p.busbw(in_place) or 0 for p in points], style, marker="o", ms=3,
                       label=label)
        latency.plot([p.size for p in points], [p.time_us() for p in points], style, marker="o", ms=3, label=label)
    ranks = ", ".join(str(world) for world in sorted({row.world_size for row in rows}))
    for axis, title, unit in ((bandwidth, "bus bandwidth", "GB/s"), (latency, "time per call", "us")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("message size (bytes)")
        axis.set_ylabel(unit)
        axis.set_title(f"{title}, {ranks} ranks")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    latency.set_yscale("log")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
