"""Distributed checkpoints: save from any number of ranks, load into any other, atomically and verified.

A checkpoint is a directory of per-rank safetensors files and a JSON
``metadata.json`` (no pickle) that commits them. Every rank writes only the
pieces assigned to it (replicated values once in total, spread over the ranks);
a load reads, memory-mapped, only the byte ranges its own layout needs, and
checks their checksums before anything is copied into the caller's state.

Example:
    Save every 100 steps from an FSDP job of 4 ranks, resume on 3::

        from ferro import checkpoint

        state = checkpoint.get_state_dict(fsdp, optimizer)
        state["step"] = step
        checkpoint.save(state, checkpoint.step_path("ckpt", step))

        # later, at any world size, after building the model and optimizer
        state = checkpoint.get_state_dict(fsdp, optimizer) | {"step": 0}
        checkpoint.load(state, checkpoint.latest("ckpt"))
        checkpoint.set_state_dict(fsdp, optimizer, state)
        step = state["step"]

"""

from ferro.checkpoint.api import async_save, latest, load, save, step_path
from ferro.checkpoint.state import get_state_dict, set_state_dict
from ferro.checkpoint.tools import consolidate, inspect

__all__ = ["async_save", "consolidate", "get_state_dict", "inspect", "latest", "load", "save", "set_state_dict",
           "step_path"]
