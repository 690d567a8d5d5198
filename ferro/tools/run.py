"""``ferro run``: start a job's ranks on this node, torchrun-style."""

from __future__ import annotations

import argparse
import os
import sys

from ferro import environment
from ferro.errors import ConfigurationError
from ferro.launch.agent import LaunchConfig, run_job
from ferro.launch.in_place import run_in_place
from ferro.rendezvous.settings import free_port

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of ``ferro run`` (flag-compatible with torchrun for the common cases)."""
    parser = argparse.ArgumentParser(
        prog="ferro run",
        description="Start the ranks of a distributed job on this node. Each rank gets RANK, LOCAL_RANK, "
                    "WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT, FERRO_RESTART_COUNT "
                    "and the job's FERRO_SECRET.")
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1, help="ranks on this node")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes in the job (default 1)")
    parser.add_argument("--node-rank", "--node_rank", type=int, default=0, help="this node's index (default 0)")
    parser.add_argument("--master-addr", "--master_addr", default="127.0.0.1",
                        help="host of rank 0 (default 127.0.0.1)")
    parser.add_argument("--master-port", "--master_port", type=int, default=None,
                        help="port of the rendezvous store (default: a free port on one node, 29500 on several)")
    parser.add_argument("--standalone", action="store_true",
                        help="a single-node job on loopback with a free port")
    parser.add_argument("--max-restarts", "--max_restarts", type=int, default=0,
                        help="restart up to K times after a failure: the whole group, or (with --restart-policy "
                             "rank) each failed rank")
    parser.add_argument("--restart-policy", choices=("group", "rank"), default="group",
                        help="group: a failure stops every rank and restarts them all (default); rank: the others "
                             "train on in place (ferro.elastic) and only the failed rank is replaced")
    parser.add_argument("--min-size", type=int, default=1,
                        help="with --restart-policy rank: stop when fewer ranks than this are left (default 1)")
    parser.add_argument("--min-nodes", type=int, default=1,
                        help="with --restart-policy rank: stop when ranks on fewer nodes than this are left "
                             "(default 1)")
    parser.add_argument("--heartbeat-timeout", type=float, default=10.0,
                        help="with --restart-policy rank: kill a rank silent this many seconds, and take a node "
                             "whose launcher is silent that long for lost (default 10)")
    parser.add_argument("--hang-timeout", type=float, default=300.0,
                        help="seconds in which no rank made or ended a collective or point-to-point call after "
                             "which every rank's flight record is collected and the ranks the others wait for are "
                             "judged: one that keeps a core busy is working (reported, left alone), one that is "
                             "idle is hung: the verdict is printed (which rank did not arrive where) and the job "
                             "stopped with exit code 86, or, with --restart-policy rank, the hung rank killed and "
                             "replaced (default 300; 0: off)")
    parser.add_argument("--dump-dir", default=None,
                        help="folder for the ranks' flight records, one for the whole job whatever the restart "
                             "policy (default $FERRO_DUMP_DIR, else <tmp>/ferro-dumps/run-<master port>); read "
                             "them with ferro doctor")
    parser.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with the rank")
    parser.add_argument("--grace", type=float, default=5.0,
                        help="seconds ranks get to exit after a stop request before they are killed (default 5)")
    parser.add_argument("-m", "--module", action="store_true", help="run the target as a module, like python -m")
    parser.add_argument("target", help="the script (or module with -m)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def config_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> LaunchConfig:
    """Turn parsed arguments into a :class:`LaunchConfig`.

    Raises:
        ConfigurationError: Several nodes without a shared ``FERRO_SECRET``, or contradictory flags.

    """
    env = os.environ if environ is None else environ
    nnodes, node_rank, addr = args.nnodes, args.node_rank, args.master_addr
    if args.standalone:
        if nnodes != 1:
            raise ConfigurationError("ferro run: --standalone is a single-node job; drop --nnodes")
        node_rank, addr = 0, "127.0.0.1"
    port = args.master_port
    if port is None:
        port = free_port(addr) if nnodes == 1 else 29500
    secret = environment.get("FERRO_SECRET", environ=env)
    if not secret and nnodes > 1:
        raise ConfigurationError(
            "ferro run: a job on several nodes needs the same FERRO_SECRET on every node; export one "
            "(for example `export FERRO_SECRET=$(python -c 'import secrets; print(secrets.token_hex(16))')`) "
            "before starting each node's launcher")
    if args.restart_policy != "rank" and (args.min_size != 1 or args.min_nodes != 1):
        raise ConfigurationError("ferro run: --min-size and --min-nodes apply to --restart-policy rank (training "
                                 "in place); with the group policy every failure restarts all ranks")
    if args.hang_timeout < 0:
        raise ConfigurationError(f"ferro run: --hang-timeout must be >= 0 seconds (0 turns it off), got "
                                 f"{args.hang_timeout:g}")
    target = ["-m", args.target, *args.args] if args.module else [args.target, *args.args]
    fields = dict(target=target, nproc_per_node=args.nproc_per_node, nnodes=nnodes, node_rank=node_rank,
                  master_addr=addr, master_port=port, max_restarts=args.max_restarts, prefix=not args.no_prefix,
                  grace_seconds=args.grace, restart_policy=args.restart_policy, min_size=args.min_size,
                  min_nodes=args.min_nodes, heartbeat_timeout=args.heartbeat_timeout,
                  hang_timeout=args.hang_timeout, dump_dir=args.dump_dir)
    return LaunchConfig(**fields, secret=secret) if secret else LaunchConfig(**fields)


def main(argv: list[str] | None = None) -> int:
    """Run ``ferro run`` and return its exit status."""
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
        return run_in_place(config) if config.restart_policy == "rank" else run_job(config)
    except ConfigurationError as exc:
        print(str(exc), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
