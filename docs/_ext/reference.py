"""An MkDocs hook: the reference pages that are generated from the code at every build, so they cannot go stale.

* ``reference/cli.md``: the ``ferro`` command line, from the argument parsers themselves (``ferro``,
  ``ferro run``, ``ferro bench``, ``ferro doctor``, ``ferro ckpt``);
* ``reference/environment.md``: every ``FERRO_*`` variable, from :data:`ferro.environment.VARIABLES`, the
  registry every read goes through (``tests/test_environment.py`` holds the source to that);
* ``reference/backends.md``: what each backend supports, from the backends' own declarations
  (:class:`ferro.backend.base.Support`) and from which collectives each runs in its own engine (the
  :class:`~ferro.backend.native.NativeCollectives` methods its class overrides);
* ``reference/torch-names.md``: torch.distributed's names and ferro's, from :data:`TORCH_NAMES` below
  (``tests/test_docs.py`` checks that every ferro name resolves, and every torch name where torch is installed).

Unlike ``autolink.py`` this hook imports ferro: the site is built with ferro installed (``pip install
'.[docs]'``), and the parsers and classes are the source of these pages. The pages also exist as plain
functions (:func:`pages`), which the docs test calls.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from ferro.tools.cli import DELEGATED

# torch's name, ferro's (under ``ferro.``), and a note where they differ.
TORCH_NAMES: tuple[tuple[str, str, str], ...] = (
    ("torch.distributed.init_process_group", "init_process_group",
     "`backend=\"auto\"` picks `shm`, `tcp` or `hierarchical` from where the ranks are; `\"tcp\"` is where "
     "torch says `\"gloo\"`."),
    ("torch.distributed.destroy_process_group", "destroy_process_group", ""),
    ("torch.distributed.is_initialized", "is_initialized", ""),
    ("torch.distributed.get_rank", "get_rank", ""),
    ("torch.distributed.get_world_size", "get_world_size", ""),
    ("torch.distributed.new_group", "new_group", ""),
    ("torch.distributed.all_reduce", "allreduce",
     "In place, and returns the array; `async_op=True` returns a `PendingCollective`."),
    ("torch.distributed.reduce", "reduce", ""),
    ("torch.distributed.broadcast", "broadcast", ""),
    ("torch.distributed.all_gather_into_tensor", "all_gather",
     "Returns the ranks' arrays concatenated along axis 0 (or fills `out`)."),
    ("torch.distributed.reduce_scatter_tensor", "reduce_scatter",
     "Splits its input along axis 0 as `numpy.array_split` does (parts may differ by a row)."),
    ("torch.distributed.all_to_all_single", "all_to_all",
     "Uneven splits: `all_to_all_single_uneven`."),
    ("torch.distributed.gather", "gather", ""),
    ("torch.distributed.scatter", "scatter", ""),
    ("torch.distributed.barrier", "barrier", ""),
    ("torch.distributed.all_gather_object", "all_gather_object", ""),
    ("torch.distributed.broadcast_object_list", "broadcast_object",
     "One object, returned, instead of a list filled in place."),
    ("torch.distributed.send", "send", ""),
    ("torch.distributed.recv", "recv",
     "Returns the message as a new array (`recv_into` fills yours); from any rank: `recv_any`."),
    ("torch.distributed.isend", "isend", ""),
    ("torch.distributed.irecv", "irecv", ""),
    ("torch.distributed.ReduceOp", "ReduceOp",
     "`AVG` is an alias of `MEAN`; `BAND`, `BOR`, `BXOR` as torch's."),
    ("torch.distributed.TCPStore", "Store",
     "Authenticated with the job secret; `StoreServer` serves one."),
    ("torch.nn.parallel.DistributedDataParallel", "DDP",
     "For `torch.nn` modules under torch itself, use `torch.distributed.init_process_group(\"ferro\")` and "
     "torch's own DDP."),
    ("torch.distributed.fsdp.fully_shard", "FSDP",
     "Or torch's `fully_shard` over the `\"ferro\"` backend."),
    ("torch.distributed.device_mesh.init_device_mesh", "init_device_mesh", ""),
    ("torch.distributed.tensor.distribute_tensor", "dtensor.distribute_tensor", ""),
    ("torch.distributed.pipelining.PipelineStage", "pipeline.PipelineStage", ""),
    ("torch.distributed.pipelining.Schedule1F1B", "pipeline.Schedule1F1B", ""),
    ("torch.distributed.checkpoint.save", "checkpoint.save",
     "Resharding on load, as torch's `distributed.checkpoint`."),
    ("torch.distributed.checkpoint.load", "checkpoint.load", ""),
    ("torch.distributed.rpc.init_rpc", "rpc.init_rpc", ""),
    ("torch.distributed.rpc.rpc_sync", "rpc.rpc_sync", ""),
    ("torch.distributed.rpc.rpc_async", "rpc.rpc_async", ""),
)


def _cell(text: Any) -> str:
    """Text safe inside a Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _option_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:  # argparse keeps no public list of its arguments
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
            continue
        name = ", ".join(f"`{flag}`" for flag in action.option_strings) or f"`{action.dest}`"
        if action.option_strings and action.nargs != 0:
            name += f" `{action.metavar or action.dest.upper()}`"
        default = "" if action.default in (None, argparse.SUPPRESS, False) or action.nargs == 0 \
            else f"`{action.default}`"
        if action.required or not action.option_strings:
            default = "required"
        help_text = (action.help or "") % {"default": action.default, "prog": parser.prog} if action.help else ""
        if action.choices and not isinstance(action.choices, range):
            help_text += f" (one of {', '.join(f'`{c}`' for c in action.choices)})"
        rows.append(f"| {_cell(name)} | {_cell(default)} | {_cell(help_text)} |")
    return rows


def _command(parser: argparse.ArgumentParser, summary: str, level: int) -> list[str]:
    lines = [f"{'#' * level} `{parser.prog}`", ""]
    if summary:
        lines += [summary[0].upper() + summary[1:] + ("" if summary.endswith(".") else "."), ""]
    if parser.description and parser.prog != "ferro bench":
        lines += [parser.description.strip(), ""]
    lines += ["```text", parser.format_usage().strip().replace("usage: ", ""), "```", ""]
    rows = _option_rows(parser)
    if rows:
        lines += ["| argument | default | meaning |", "|---|---|---|", *rows, ""]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                if name in DELEGATED:  # `ferro run` and `ferro bench` parse their arguments themselves
                    sub = importlib.import_module(DELEGATED[name]).build_parser()
                lines += _command(sub, helps.get(name) or "", level + 1)
    return lines


def cli_page() -> str:
    """Return the ``ferro`` command line's page, from its parsers."""
    import ferro
    from ferro.tools import cli

    lines = ["---", "search:", "  boost: 2", "---", "", "# Command line", "",
             f"Generated from the argument parsers of ferro {ferro.__version__} at every build of this site; "
             "`ferro COMMAND --help` prints the same. `ferro --version` prints the version.", ""]
    lines += _command(cli.build_parser(), "", 2)
    return "\n".join(lines) + "\n"


def environment_page() -> str:
    """Return the page of every ``FERRO_*`` variable, from the registry."""
    from ferro import environment

    lines = ["---", "search:", "  boost: 2", "---", "", "# Environment variables", "",
             "Every `FERRO_*` variable ferro reads, generated from `ferro.environment.VARIABLES`: each read in the "
             "code goes through that registry, and the test suite fails on a read that bypasses it or a name it "
             "lacks. **Set by `ferro run`** marks the ones the launcher sets for the ranks it starts (under "
             "`torchrun`, `mpirun` or `srun`, set `FERRO_SECRET` yourself; the rest have defaults). A keyword "
             "argument of the function that reads a setting wins over its variable.", "",
             "ferro also reads the launchers' own variables: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, "
             "`LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` (torchrun's), `OMPI_COMM_WORLD_*` and `PMI_*` "
             "(mpirun), `SLURM_*` (srun).", ""]
    for area in environment.AREAS:
        lines += [f"## {area}", "", "| variable | default | meaning | set by `ferro run` |", "|---|---|---|---|"]
        for variable in environment.VARIABLES.values():
            if variable.area == area:
                lines.append(f"| `{variable.name}` | {_cell(variable.default)} | {_cell(variable.meaning)} | "
                             f"{'yes' if variable.set_by_launcher else ''} |")
        lines.append("")
    return "\n".join(lines)


_COLLECTIVES = ("allreduce", "reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "gather",
                "scatter")


def own_engine(cls: type) -> list[str]:
    """Return the collectives ``cls`` runs in its own engine: the NativeCollectives methods it overrides."""
    from ferro.backend.native import NativeCollectives

    if not issubclass(cls, NativeCollectives):
        return []
    return [op for op in _COLLECTIVES
            if getattr(cls, f"native_{op}") is not getattr(NativeCollectives, f"native_{op}")]


def backends_page() -> str:
    """Return the page of what each backend supports, from the backends' declarations."""
    from ferro.backend import BACKENDS, SimulatedBackend

    lines = ["# What each backend supports", "",
             "Generated from each backend's own declaration (its class's `SUPPORT`) and from the collectives its "
             "class runs in its own engine. Every backend runs every collective: one without an engine of its "
             "own for a collective runs ferro's generic algorithm over its point-to-point messages (each transfer "
             "and reduction still compiled). [Choosing a backend](../guides/backends.md) says when to pick which.",
             "", "| backend | devices | dtypes | own engine for | other collectives | async | point to point | "
             "receive from any | sub-groups |", "|---|---|---|---|---|---|---|---|---|"]
    classes = [(name, entry.backend_class()) for name, entry in BACKENDS.items() if entry.backend_class]
    classes.append(("`SimulatedBackend` (tests)", SimulatedBackend))
    for name, cls in classes:
        support = cls.SUPPORT
        engine = own_engine(cls)
        engine_text = support.engine or (", ".join(engine) + f" ({support.engine_kind})" if engine else "none")
        generic = support.generic or ", ".join(op for op in _COLLECTIVES if op not in engine)
        label = name if name.startswith("`") else f"`{name}` (`{cls.__name__}`)"
        lines.append(" | ".join(["", label, support.devices, support.dtypes, _cell(engine_text), _cell(generic),
                                 support.asynchronous, support.point_to_point, support.receive_any,
                                 support.sub_groups, ""]).strip())
    unavailable = [entry for entry in BACKENDS.values() if not entry.backend_class]
    for entry in unavailable:
        lines += ["", f"`{entry.name}` is not part of this ferro: {_cell(entry.unavailable)}."]
    return "\n".join(lines) + "\n"


def torch_names_page() -> str:
    """Return the page of torch.distributed's names and ferro's."""
    lines = ["# From torch.distributed", "",
             "ferro's names for what torch.distributed calls otherwise, or the same. The other way in is to keep "
             "torch's code and name ferro as its backend: `torch.distributed.init_process_group(\"ferro\")` "
             "([torch, Lightning, accelerate, Ray](../guides/torch.md)).", "",
             "| torch | `ferro.` | differences |", "|---|---|---|"]
    lines += [f"| `{torch}` | `{ours}` | {_cell(note)} |" for torch, ours, note in TORCH_NAMES]
    return "\n".join(lines) + "\n"


def pages() -> dict[str, str]:
    """Return every generated page by its path in the site."""
    return {"reference/cli.md": cli_page(), "reference/environment.md": environment_page(),
            "reference/backends.md": backends_page(), "reference/torch-names.md": torch_names_page()}


def on_files(files: Any, config: Any) -> Any:
    """Add the generated pages to the site's files (MkDocs hook)."""
    from mkdocs.structure.files import File

    for path, content in pages().items():
        files.append(File.generated(config, path, content=content))
    return files


def on_config(config: Any) -> Any:
    """Put the version in the site's header (MkDocs hook)."""
    import ferro

    config["site_name"] = f"ferro {ferro.__version__}"
    return config


__all__ = ["TORCH_NAMES", "backends_page", "cli_page", "environment_page", "on_config", "on_files",
           "own_engine", "pages", "torch_names_page"]
