"""Moving the training state from a healthy rank to a replacement, peer to peer over the data plane.

The state is a mapping of names to objects with ``state_dict()`` and
``load_state_dict()`` (a ferro.nn or torch module, an optimizer). The sender
sends one small pickled *skeleton* (the nested dicts and lists with every array
or tensor replaced by a numbered :class:`_Leaf`), then each array as a frame of
its own, straight from its memory: nothing passes through the store, and no
array is joined into one buffer first. Pickles travel only between
authenticated members of the job, as ferro's object collectives do.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ferro.backend.base import Backend
from ferro.collective.p2p import recv, recv_into, send

__all__ = ["receive_state", "send_state"]

# The point-to-point tag of state transfers (kept apart from a user's tag-0 messages).
STATE_TAG = 0x5E1F


@dataclass(frozen=True)
class _Leaf:
    index: int
    shape: tuple[int, ...]
    dtype: str  # NumPy's dtype.str, or "torch.<name>"


def _is_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "data_ptr")


def _flatten(value: Any, arrays: list[Any]) -> Any:
    if isinstance(value, np.ndarray):
        arrays.append(np.ascontiguousarray(value))
        return _Leaf(len(arrays) - 1, tuple(value.shape), value.dtype.str)
    if _is_tensor(value):
        tensor = value.detach().contiguous()
        arrays.append(tensor)
        return _Leaf(len(arrays) - 1, tuple(tensor.shape), str(tensor.dtype))
    if isinstance(value, dict):
        return {key: _flatten(item, arrays) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_flatten(item, arrays) for item in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def _empty(leaf: _Leaf) -> Any:
    if leaf.dtype.startswith("torch."):
        import torch  # only when the sender sent tensors, so torch is there

        return torch.empty(leaf.shape, dtype=getattr(torch, leaf.dtype.removeprefix("torch.")))
    return np.empty(leaf.shape, dtype=np.dtype(leaf.dtype))


def _rebuild(value: Any, arrays: list[Any]) -> Any:
    if isinstance(value, _Leaf):
        return arrays[value.index]
    if isinstance(value, dict):
        return {key: _rebuild(item, arrays) for key, item in value.items()}
    if isinstance(value, list):
        return [_rebuild(item, arrays) for item in value]
    if isinstance(value, tuple):
        return tuple(_rebuild(item, arrays) for item in value)
    return value


def _leaves(value: Any) -> list[_Leaf]:
    if isinstance(value, _Leaf):
        return [value]
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in _leaves(item)]
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _leaves(item)]
    return []


def _collect(state: Mapping[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    arrays: list[Any] = []
    skeleton = {"objects": {name: _flatten(obj.state_dict(), arrays) for name, obj in state.items()}}
    return skeleton, arrays


def _nbytes(array: Any) -> int:
    return int(array.nbytes) if isinstance(array, np.ndarray) else array.numel() * array.element_size()


def send_state(state: Mapping[str, Any], dst: int, group: Backend, timeout: float | None = None) -> int:
    """Send every object's ``state_dict()`` to ``dst``; return the array bytes sent.

    Example::

        # rank 0 (healthy)                         # rank 3 (the replacement)
        send_state(state, 3, group)                receive_state(state, 0, group)

    """
    skeleton, arrays = _collect(state)
    send(np.frombuffer(pickle.dumps(skeleton), np.uint8), dst, tag=STATE_TAG, group=group, timeout=timeout)
    for array in arrays:
        send(array, dst, tag=STATE_TAG, group=group, timeout=timeout)
    return sum(_nbytes(array) for array in arrays)


def receive_state(state: Mapping[str, Any], src: int, group: Backend, timeout: float | None = None) -> int:
    """Receive :func:`send_state`'s message from ``src`` and load it into ``state``'s objects; return its bytes.

    The step is not sent: every rank agreed on it (an all_gather) before the transfer.
    Every array is received before anything is checked or loaded, so a state
    this rank refuses leaves no message behind on the connection.

    Raises:
        KeyError: The sender's state names objects this rank lacks, or lacks some it has.
        Exception: What an object's ``load_state_dict`` raises for a state that does not fit it
            (another shape, a missing key); objects before it in ``state`` are loaded by then.

    """
    skeleton = pickle.loads(np.asarray(recv(src, tag=STATE_TAG, group=group, timeout=timeout)).tobytes())
    objects = skeleton["objects"]
    leaves = sorted((leaf for value in objects.values() for leaf in _leaves(value)), key=lambda leaf: leaf.index)
    arrays = []
    for leaf in leaves:
        out = _empty(leaf)
        recv_into(out, src, tag=STATE_TAG, group=group, timeout=timeout)
        arrays.append(out)
    if set(objects) != set(state):
        raise KeyError(f"elastic state: rank {src} sent {sorted(objects)}, this rank holds {sorted(state)}")
    for name, obj in state.items():
        obj.load_state_dict(_rebuild(objects[name], arrays))
    return sum(_nbytes(array) for array in arrays)
