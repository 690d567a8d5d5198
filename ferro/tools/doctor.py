"""``ferro doctor DUMP_DIR``: read every rank's flight record and say which rank did not arrive where.

It prints the report of :func:`ferro.collective.diagnosis.diagnose` (a hang, a
mismatch, a straggler), and on request writes a Chrome/Perfetto trace of the
last calls across ranks (``--trace``) or the dumps in the pickled layout torch's
flight-recorder analyser reads (``--torch DIR``, then ``torchfrtrace DIR``).
Exit status: 0 when the records show no hang and no mismatch, 1 when they do,
2 when the folder holds no dump.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path
from typing import Any

from ferro.collective.diagnosis import chrome_trace, diagnose, load_dumps
from ferro.types import dtype_by_name

__all__ = ["add_parser", "torch_layout"]

# torch's names of ferro's collectives (its analyser matches calls by these).
_TORCH_NAMES = {"allreduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
                "broadcast": "broadcast", "reduce": "reduce", "gather": "gather", "scatter": "scatter",
                "all_to_all": "all_to_all", "barrier": "barrier", "p2p": "send"}
_TORCH_DTYPES = {"float32": "Float", "float64": "Double", "float16": "Half", "bfloat16": "BFloat16",
                 "int32": "Int", "int64": "Long", "int8": "Char", "uint8": "Byte"}


def add_parser(commands: Any) -> None:
    """Add ``doctor`` to the ``ferro`` command's subcommands."""
    doctor = commands.add_parser("doctor", help="read every rank's flight record and say which rank did not "
                                                "arrive where (a hang, a mismatch, a straggler)")
    doctor.add_argument("dump_dir", help="the job's dump folder (ferro run prints it; else $FERRO_DUMP_DIR)")
    doctor.add_argument("--last", type=int, default=50, help="calls the straggler report looks at (default 50)")
    doctor.add_argument("--world-size", type=int, default=None, help="ranks in the job (default: from the dumps)")
    doctor.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace of the last calls here")
    doctor.add_argument("--torch", default=None, metavar="DIR",
                        help="write the dumps in torch's flight-recorder layout into DIR (read by torchfrtrace)")
    doctor.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Run ``ferro doctor``."""
    dumps = load_dumps(args.dump_dir)
    if not dumps:
        print(f"ferro doctor: no rank-<r>.json in {args.dump_dir}", file=sys.stderr)
        return 2
    found = diagnose(dumps, args.world_size, args.last)
    print(found.report())
    if args.trace:
        Path(args.trace).write_text(json.dumps(chrome_trace(dumps, args.last)))
        print(f"trace of the last {args.last} calls of each rank written to {args.trace} (open in ui.perfetto.dev)")
    if args.torch:
        folder = Path(args.torch)
        folder.mkdir(parents=True, exist_ok=True)
        for rank, data in torch_layout(dumps).items():
            (folder / f"rank{rank}").write_bytes(pickle.dumps(data))
        print(f"torch's layout written to {folder} (torchfrtrace {folder})")
    return 1 if any(f.kind in ("hang", "mismatch") for f in found.findings) else 0


def torch_layout(dumps: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Return each rank's dump as torch's flight recorder pickles it (version 2.10), by rank."""
    converted = {}
    for rank, dump in dumps.items():
        pg_config = {}
        entries: list[dict[str, Any]] = []
        for group in dump.get("groups") or []:
            name = group["pg_id"]
            desc = "default_pg" if group.get("ranks") == list(range(len(group.get("ranks") or []))) and \
                group.get("world_size") == max(g.get("world_size") or 0 for g in dump["groups"]) else group["desc"]
            pg_config[name] = {"name": name, "desc": desc, "ranks": str(group.get("ranks"))}
            for entry in group.get("entries") or []:
                sizes = [[entry["nbytes"] // _itemsize(entry.get("dtype"))]] if entry.get("dtype") else [[]]
                dtypes = [_TORCH_DTYPES.get(entry.get("dtype") or "", "Byte")]
                entries.append({
                    "record_id": len(entries), "pg_id": len(pg_config) - 1, "process_group": (name, desc),
                    "collective_seq_id": 0 if entry["is_p2p"] else entry["collective_seq_id"],
                    "p2p_seq_id": (entry.get("p2p_seq_id") or entry["record_id"]) if entry["is_p2p"] else 0,
                    "op_id": entry["collective_seq_id"],
                    "profiling_name": f"gloo:{_TORCH_NAMES.get(entry['op'], entry['op'])}",
                    "time_created_ns": entry.get("time_created_ns") or 0,
                    "input_sizes": sizes, "input_dtypes": dtypes, "output_sizes": sizes, "output_dtypes": dtypes,
                    "state": entry["state"] if entry["state"] != "failed" else "completed",
                    "time_discovered_started_ns": entry.get("time_discovered_started_ns"),
                    "time_discovered_completed_ns": entry.get("time_discovered_completed_ns"),
                    "retired": entry["state"] in ("completed", "failed"), "timeout_ms": 0,
                    "is_p2p": entry["is_p2p"], "frames": entry.get("frames") or [],
                })
        converted[rank] = {"version": "2.10", "pg_config": pg_config, "pg_status": {}, "entries": entries,
                           "rank": rank}
    return converted


def _itemsize(dtype: str | None) -> int:
    try:
        found = dtype_by_name(dtype) if dtype else None
    except (KeyError, ValueError):
        return 1
    return found.itemsize if found is not None else 1
