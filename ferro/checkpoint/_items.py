"""A state dict taken apart into tensor pieces and plain values, and put back.

A state dict is a nested structure of dicts (string or integer keys), lists and
tuples whose leaves are arrays, tensors, FSDP :class:`~ferro.parallel.fsdp.ShardedEntry`
pieces, DTensors, or plain Python values. Each leaf is addressed by its *path*, the tuple
of keys and indices that reaches it. Lists and tuples are walked only where they
hold a tensor; otherwise they are plain values as a whole.

Every tensor becomes a :class:`TensorItem`: a contiguous range ``[start, stop)``
of the global tensor flattened in row-major order, seen as a 1-d NumPy array
(torch tensors through the one zero-copy view in :mod:`ferro._buffers`; dtypes
NumPy lacks, such as bfloat16, as same-width integers). A plain array or tensor
is the whole range; a DTensor's piece is one range per contiguous run (a row
block one, a column block one per row). That one shape of piece is what makes resharding simple: a
load asks for a range, and every saved piece that overlaps it contributes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ferro._buffers import is_torch_tensor, torch_view
from ferro.dtensor import DTensor, Partial
from ferro.errors import CheckpointError

__all__ = ["Path", "PlainItem", "TensorItem", "decode_value", "dotted", "encode_value", "flatten", "put_values"]

Path = tuple[str | int, ...]

# safetensors' dtype codes, by the NumPy dtype name of the elements (bfloat16 is carried as uint16 bits).
_CODE_BY_NUMPY = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32",
                  "int16": "I16", "int8": "I8", "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8",
                  "bool": "BOOL", "bfloat16": "BF16"}
_NAME_BY_CODE = {code: name for name, code in _CODE_BY_NUMPY.items()}
# How each code's elements are stored in NumPy here (bfloat16 as its bits).
STORAGE_DTYPE = {code: np.dtype("uint16" if code == "BF16" else name) for code, name in _NAME_BY_CODE.items()}


def numpy_name(code: str) -> str:
    """Return the dtype name safetensors' writer takes for a dtype ``code`` ("F32" -> "float32")."""
    return _NAME_BY_CODE[code]


def dotted(path: Path) -> str:
    """Return a path as users write it: ``("optim", "state", "fc.w", "step")`` -> ``optim.state.fc.w.step``."""
    return ".".join(str(key) for key in path)


@dataclass
class TensorItem:
    """One contiguous range of a tensor's flattened elements, as this rank holds it.

    Attributes:
        path: Where the tensor sits in the state dict.
        code: The safetensors dtype code ("F32", "BF16", ...).
        shape: The global tensor's shape.
        start: First flattened element held here.
        stop: One past the last.
        values: The elements ``[start, stop)`` as a 1-d NumPy array (a view of the caller's memory).

    """

    path: Path
    code: str
    shape: tuple[int, ...]
    start: int
    stop: int
    values: np.ndarray

    @property
    def nbytes(self) -> int:
        """Bytes of this range."""
        return int(self.values.nbytes)


@dataclass
class PlainItem:
    """A leaf that is not a tensor (the step, a learning rate, RNG or data-loader state), JSON-encoded."""

    path: Path
    encoded: str


def flatten(state: dict[Any, Any], *, writable: bool) -> tuple[list[TensorItem], list[PlainItem]]:
    """Take a state dict apart into tensor pieces and plain values.

    Args:
        state: The nested state dict.
        writable: The pieces will be written into (a load): torch tensors are viewed for writing.

    Raises:
        CheckpointError: A key that is neither a string nor an integer, a value that cannot be stored,
            a tensor that is not contiguous, or two leaves whose names read the same (``{"a.b": x, "a": {"b": y}}``:
            a data file names tensors by their dotted path, so one would silently replace the other).

    """
    if not isinstance(state, dict):
        raise CheckpointError(f"a state dict must be a dict, not {type(state).__name__}")
    tensors: list[TensorItem] = []
    plain: list[PlainItem] = []
    named: dict[str, Path] = {}
    for path, leaf in _leaves(state, ()):
        name = dotted(path)
        if (other := named.setdefault(name, path)) != path:
            raise CheckpointError(f"state dict keys {_keys(other)} and {_keys(path)} both name {name!r}: a checkpoint "
                                  f"stores each under that name; rename one of them")
        if isinstance(leaf, DTensor):
            tensors.extend(_dtensor_items(path, leaf, writable))
            continue
        item = _tensor_item(path, leaf, writable)
        if item is not None:
            tensors.append(item)
        else:
            plain.append(PlainItem(path, encode_value(leaf, path)))
    return tensors, plain


def _keys(path: Path) -> str:
    """Return a path as the keys that lead to it: ``("a", 1)`` -> ``['a'][1]``."""
    return "".join(f"[{key!r}]" for key in path)


def _leaves(node: Any, path: Path) -> Iterator[tuple[Path, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise CheckpointError(f"state dict key {key!r} at {dotted(path) or '<root>'}: keys must be strings "
                                      f"or integers")
            yield from _leaves(value, (*path, key))
    elif isinstance(node, (list, tuple)) and _holds_tensor(node):
        for index, value in enumerate(node):
            yield from _leaves(value, (*path, index))
    else:
        yield path, node


def _is_tensor_leaf(value: Any) -> bool:
    return (isinstance(value, (np.ndarray, DTensor)) or is_torch_tensor(value) or _is_sharded_entry(value))


def _is_sharded_entry(value: Any) -> bool:
    return all(hasattr(value, name) for name in ("local", "global_shape", "start", "stop"))


def _holds_tensor(node: Any) -> bool:
    if _is_tensor_leaf(node):
        return True
    if isinstance(node, dict):
        return any(_holds_tensor(v) for v in node.values())
    if isinstance(node, (list, tuple)):
        return any(_holds_tensor(v) for v in node)
    return False


def _tensor_item(path: Path, leaf: Any, writable: bool) -> TensorItem | None:
    if _is_sharded_entry(leaf):
        values, code = _flat_view(leaf.local, path, writable)
        shape = tuple(int(n) for n in leaf.global_shape)
        start, stop = int(leaf.start), int(leaf.stop)
        if not 0 <= start <= stop <= math.prod(shape) or stop - start != values.size:
            raise CheckpointError(f"{dotted(path)}: the sharded entry holds {values.size} elements as "
                                  f"[{start}, {stop}) of a tensor of shape {shape}")
        return TensorItem(path, code, shape, start, stop, values)
    if isinstance(leaf, np.ndarray) or is_torch_tensor(leaf):
        values, code = _flat_view(leaf, path, writable)
        return TensorItem(path, code, tuple(int(n) for n in leaf.shape), 0, values.size, values)
    return None


def _dtensor_items(path: Path, leaf: DTensor, writable: bool) -> list[TensorItem]:
    """Return a DTensor's piece as the flat ranges it covers: one for a row block, one per row for a column block."""
    if any(isinstance(p, Partial) for p in leaf.placements):
        raise CheckpointError(f"checkpoint: {dotted(path)} is a DTensor placed {list(leaf.placements)}: a Partial "
                              f"holds terms, not values; redistribute it to Replicate or Shard before saving")
    values, code = _flat_view(leaf.to_local(), path, writable)
    shape = tuple(int(n) for n in leaf.shape)
    items, offset = [], 0
    for start, stop in leaf.flat_ranges().tolist():
        items.append(TensorItem(path, code, shape, start, stop, values[offset:offset + stop - start]))
        offset += stop - start
    return items


def _flat_view(tensor: Any, path: Path, writable: bool) -> tuple[np.ndarray, str]:
    """Return a 1-d view of a tensor's elements and its dtype code."""
    where = f"checkpoint: {dotted(path)}"
    if is_torch_tensor(tensor):
        array, torch_dtype = torch_view(tensor.detach(), where, writable)
        name = str(torch_dtype).replace("torch.", "")
    else:
        array = tensor
        name = tensor.dtype.name
        if writable and not tensor.flags.writeable:
            raise CheckpointError(f"{where}: the array is read-only; load fills arrays in place")
    if name not in _CODE_BY_NUMPY:
        raise CheckpointError(f"{where}: dtype {name} cannot be stored (supported: {', '.join(_CODE_BY_NUMPY)})")
    if not array.flags.c_contiguous:
        raise CheckpointError(f"{where}: the array is not contiguous; pass a contiguous one")
    if name == "bfloat16":
        array = array.view(np.uint16)
    if not array.dtype.isnative:
        raise CheckpointError(f"{where}: the array is not in this machine's byte order")
    return array.reshape(-1), _CODE_BY_NUMPY[name]


# --- plain values -----------------------------------------------------------------------------------------

def encode_value(value: Any, path: Path) -> str:
    """Return the JSON text of a plain value; tuples and NumPy scalars keep their types.

    Raises:
        CheckpointError: A value JSON cannot carry (an object, a set, bytes, ...).

    """
    try:
        return json.dumps(_tagged(value, path), sort_keys=True, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint: {dotted(path)} cannot be stored: {exc}") from None


def _tagged(value: Any, path: Path) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return {"__numpy__": value.dtype.name, "value": value.item()}
    if isinstance(value, tuple):
        return {"__tuple__": [_tagged(v, path) for v in value]}
    if isinstance(value, list):
        return [_tagged(v, path) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            # Integer keys would come back as strings: say so rather than change them.
            return {"__dict__": [[_tagged(k, path), _tagged(v, path)] for k, v in value.items()]}
        return {k: _tagged(v, path) for k, v in value.items()}
    raise TypeError(f"a {type(value).__name__} is not a tensor, number, string, list, tuple or dict")


def decode_value(text: str) -> Any:
    """Return the value :func:`encode_value` encoded."""
    return _untagged(json.loads(text))


def _untagged(value: Any) -> Any:
    if isinstance(value, list):
        return [_untagged(v) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value and len(value) == 1:
            return tuple(_untagged(v) for v in value["__tuple__"])
        if "__numpy__" in value and len(value) == 2:
            return np.dtype(value["__numpy__"]).type(value["value"])
        if "__dict__" in value and len(value) == 1:
            return {_untagged(k): _untagged(v) for k, v in value["__dict__"]}
        return {k: _untagged(v) for k, v in value.items()}
    return value


def put_values(state: dict[Any, Any], values: dict[Path, Any]) -> None:
    """Replace the plain leaves of ``state`` at ``values``' paths with the given values.

    Tuples cannot change in place, so a tuple that holds a replaced value is rebuilt in its parent.
    """
    def rebuild(node: Any, path: Path) -> Any:
        if path in values:
            return values[path]
        if isinstance(node, dict):
            for key in list(node):
                node[key] = rebuild(node[key], (*path, key))
            return node
        if isinstance(node, list) and _holds_tensor(node):
            for index, item in enumerate(node):
                node[index] = rebuild(item, (*path, index))
            return node
        if isinstance(node, tuple) and _holds_tensor(node):
            return type(node)(rebuild(item, (*path, index)) for index, item in enumerate(node))
        return node

    if values:
        rebuild(state, ())

