"""The DTensor: this rank's piece of a global tensor, the mesh it is spread over, and how.

Example::

    # 2 ranks, a 1-d mesh over the default group
    mesh = ferro.init_device_mesh((2,))
    w = ferro.dtensor.distribute_tensor(np.arange(10.0).reshape(5, 2), mesh, [Shard(0)])
    # rank 0: w.to_local() = rows 0-2   rank 1: rows 3-4   (torch.chunk's split: 3 + 2)
    r = w.redistribute([Replicate()])     # one all_gather
    # both ranks: r.to_local() = the whole 5 x 2 array
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ferro import collective
from ferro.backend.base import Backend
from ferro.dtensor import _arrays as xp
from ferro.dtensor import ops
from ferro.dtensor.device_mesh import DeviceMesh
from ferro.dtensor.layout import flat_ranges, local_box
from ferro.dtensor.placements import Placement, Replicate, Shard, normalize_placements
from ferro.dtensor.redistribute import Step, plan_redistribute, run_plan
from ferro.errors import SizeMismatchError

__all__ = ["DTensor", "distribute_tensor"]


def _as_mesh(mesh: DeviceMesh | Backend) -> DeviceMesh:
    """Take a DeviceMesh, or a process group as the 1-d mesh of its ranks."""
    if isinstance(mesh, DeviceMesh):
        return mesh
    if isinstance(mesh, Backend):
        return DeviceMesh(mesh, np.arange(mesh.world_size), None, [mesh])
    raise TypeError(f"expected a ferro.DeviceMesh or a process group, got {type(mesh).__name__}")


def _check_array(x: Any, where: str) -> None:
    if not (isinstance(x, np.ndarray) or xp.is_torch(x)):
        raise TypeError(f"{where}: expected a NumPy array or a torch CPU tensor, got {type(x).__name__}")
    if xp.is_torch(x) and x.device.type != "cpu":
        raise TypeError(f"{where}: ferro.dtensor holds CPU tensors; this one is on {x.device}")


class DTensor:
    """A tensor spread over a :class:`~ferro.DeviceMesh`: this rank's local piece plus its placements.

    Make one with :func:`distribute_tensor` or :meth:`DTensor.from_local`. Each
    mesh dimension has one placement: :class:`Shard` (split along a tensor
    dimension, ``torch.chunk``'s rule), :class:`Replicate` or :class:`Partial`
    (terms awaiting a reduction). The local piece is a NumPy array or a torch
    CPU tensor, and stays that kind through every operation.

    Supported operations: :meth:`redistribute`, :meth:`full_tensor`,
    elementwise arithmetic (``+ - * / **``, comparisons, NumPy ufuncs) on
    DTensors of the same placements, :meth:`sum`/:meth:`mean`, ``@`` for the
    tensor-parallel layouts (see :func:`ferro.dtensor.ops.matmul_placements`) and
    ``.T``. Anything else raises ``NotImplementedError`` naming the operation.

    Attributes:
        device_mesh: The mesh.
        placements: One placement per mesh dimension.
        shape: The global shape.

    """

    __slots__ = ("_local", "device_mesh", "placements", "shape")
    __array_priority__ = 100.0  # NumPy defers `array op dtensor` to us (we refuse it with a reason)

    def __init__(self, local: Any, device_mesh: DeviceMesh, placements: tuple[Placement, ...],
                 shape: tuple[int, ...]) -> None:
        """Wrap a checked local piece; use :func:`distribute_tensor` or :meth:`from_local` instead."""
        self._local = local
        self.device_mesh = device_mesh
        self.placements = placements
        self.shape = shape

    # --- making one ------------------------------------------------------------------------------

    @staticmethod
    def from_local(local: Any, device_mesh: DeviceMesh | Backend, placements: Sequence[Placement], *,
                   shape: Sequence[int] | None = None, timeout: float | None = None) -> DTensor:
        """Wrap this rank's piece ``local`` of a global tensor; no data moves.

        Args:
            local: This rank's piece (NumPy array or torch CPU tensor), not copied.
            device_mesh: The mesh (a process group means the 1-d mesh of its ranks).
            placements: One per mesh dimension.
            shape: The global shape. Without it, every rank's piece shape is
                all-gathered once to find it (and checked against the chunk rule).
            timeout: Seconds for that exchange.

        Raises:
            SizeMismatchError: ``local``'s shape is not the piece this rank holds of
                ``shape`` under ``placements`` (names the rank and both shapes).
            ValueError: Bad placements.

        Example::

            # 2 ranks: each holds 3 of the 6 columns of a 4 x 6 weight
            w = DTensor.from_local(np.ones((4, 3)), mesh, [Shard(1)], shape=(4, 6))

        """
        _check_array(local, "DTensor.from_local")
        mesh = _as_mesh(device_mesh)
        local_shape = tuple(int(n) for n in local.shape)
        chosen = normalize_placements(placements, mesh.ndim, len(local_shape), "DTensor.from_local")
        if shape is None:
            global_shape = _infer_shape(local_shape, chosen, mesh, timeout)
        else:
            global_shape = tuple(int(n) for n in shape)
            if len(global_shape) != len(local_shape):
                raise SizeMismatchError(f"DTensor.from_local: the local piece has {len(local_shape)} dimensions but "
                                        f"the global shape {global_shape} has {len(global_shape)}",
                                        len(global_shape), len(local_shape))
        expected = tuple(length for _, length in local_box(global_shape, chosen, mesh.shape,
                                                            mesh.get_coordinate()))
        if expected != local_shape:
            raise SizeMismatchError(
                f"DTensor.from_local: rank {mesh.get_rank()} (mesh coordinate {mesh.get_coordinate()}) holds a "
                f"piece of shape {local_shape}, but its piece of a {global_shape} tensor placed {list(chosen)} "
                f"has shape {expected}", math.prod(expected), math.prod(local_shape))
        return DTensor(local, mesh, chosen, global_shape)

    # --- what it is ------------------------------------------------------------------------------

    @property
    def dtype(self) -> Any:
        """The local piece's dtype (a NumPy dtype, or a torch dtype)."""
        return self._local.dtype

    @property
    def ndim(self) -> int:
        """The number of dimensions."""
        return len(self.shape)

    def to_local(self) -> Any:
        """Return this rank's piece (not a copy)."""
        return self._local

    def local_offset(self) -> tuple[int, ...]:
        """Return the global index of this rank's piece's first element, per dimension."""
        return tuple(offset for offset, _ in self._box())

    def flat_ranges(self) -> np.ndarray:
        """Return the ``[start, stop)`` ranges of the flattened global tensor this piece holds, in its order.

        A row block is one range; a column block one per row. This is how
        checkpoints store DTensors, and how they meet FSDP's flat shards.
        """
        return flat_ranges(self.shape, self._box())

    def _box(self) -> list[tuple[int, int]]:
        return local_box(self.shape, self.placements, self.device_mesh.shape, self.device_mesh.get_coordinate())

    # --- moving data -----------------------------------------------------------------------------

    def redistribute(self, placements: Sequence[Placement], *, timeout: float | None = None) -> DTensor:
        """Return this tensor with new placements, communicating over the mesh dimensions that change.

        Every rank of the mesh calls it with the same placements. The plan
        (:meth:`redistribute_plan`) uses one collective per changing mesh
        dimension: Shard -> Replicate ``all_gather``, Partial -> Replicate
        ``allreduce``, Partial -> Shard ``reduce_scatter``, Shard(i) -> Shard(j)
        ``all_to_all``; Replicate -> Shard and Replicate -> Partial are local.
        This DTensor is left as it was. With a torch piece that requires grad
        it is differentiable: backward redistributes the gradient the other way
        (a Partial's gradient is Replicate).

        Raises:
            ValueError: Bad placements.
            DistributedError: As the collectives raise (a lost peer, a timeout, ranks asking differently).

        Example::

            # 3 ranks; x is Shard(0) of a 7 x 5 array: local rows 3, 3, 1
            y = x.redistribute([Shard(1)])   # one all_to_all: local columns 2, 2, 1, all 7 rows

        """
        target = normalize_placements(placements, self.device_mesh.ndim, self.ndim, "DTensor.redistribute")
        if ops.tracks_grad(self._local):
            from ferro.dtensor import _autograd

            local = _autograd.redistribute(self._local, self.shape, self.placements, target, self.device_mesh,
                                           timeout)
        else:
            steps = plan_redistribute(self.placements, target)
            local = run_plan(self._local, self.shape, self.placements, steps, self.device_mesh, timeout)
        return DTensor(local, self.device_mesh, target, self.shape)

    def redistribute_plan(self, placements: Sequence[Placement]) -> list[Step]:
        """Return the steps :meth:`redistribute` would run (which collective over which mesh dimension)."""
        target = normalize_placements(placements, self.device_mesh.ndim, self.ndim, "DTensor.redistribute_plan")
        return plan_redistribute(self.placements, target)

    def full_tensor(self, *, timeout: float | None = None) -> Any:
        """Return the whole global tensor on every rank (a redistribution to all-Replicate)."""
        return self.redistribute([Replicate()] * self.device_mesh.ndim, timeout=timeout).to_local()

    # --- operations (rules in ferro.dtensor.ops) -------------------------------------------------

    def _piece(self) -> ops.Piece:
        return ops.Piece(self._local, self.placements, self.shape, self.device_mesh)

    def _with(self, local: Any, placements: tuple[Placement, ...], shape: tuple[int, ...]) -> DTensor:
        return DTensor(local, self.device_mesh, placements, shape)

    def _binary(self, other: Any, name: str, reflected: bool = False) -> DTensor:
        args = [_piece(other), self._piece()]
        return self._with(*ops.elementwise(name, args if reflected else args[::-1]))

    def __add__(self, other: Any) -> DTensor:
        return self._binary(other, "add")

    def __radd__(self, other: Any) -> DTensor:
        return self._binary(other, "add", True)

    def __sub__(self, other: Any) -> DTensor:
        return self._binary(other, "subtract")

    def __rsub__(self, other: Any) -> DTensor:
        return self._binary(other, "subtract", True)

    def __mul__(self, other: Any) -> DTensor:
        return self._binary(other, "multiply")

    def __rmul__(self, other: Any) -> DTensor:
        return self._binary(other, "multiply", True)

    def __truediv__(self, other: Any) -> DTensor:
        return self._binary(other, "divide")

    def __rtruediv__(self, other: Any) -> DTensor:
        return self._binary(other, "divide", True)

    def __pow__(self, other: Any) -> DTensor:
        return self._binary(other, "power")

    def __gt__(self, other: Any) -> DTensor:
        return self._binary(other, "greater")

    def __ge__(self, other: Any) -> DTensor:
        return self._binary(other, "greater_equal")

    def __lt__(self, other: Any) -> DTensor:
        return self._binary(other, "less")

    def __le__(self, other: Any) -> DTensor:
        return self._binary(other, "less_equal")

    def __neg__(self) -> DTensor:
        return self._with(*ops.elementwise("negative", [self._piece()]))

    __hash__ = object.__hash__  # `==` stays identity (elementwise equality would make DTensors unhashable)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        """Apply an elementwise NumPy ufunc to the local pieces, under the same rules as the operators."""
        if method != "__call__" or kwargs:
            raise NotImplementedError(f"DTensor: numpy.{ufunc.__name__}.{method} (with {sorted(kwargs)}) is not "
                                      f"supported; only plain elementwise calls are")
        return self._with(*ops.elementwise(ufunc.__name__, [_piece(x) for x in inputs], ufunc))

    def __matmul__(self, other: Any) -> DTensor:
        return self._with(*ops.matmul(self._piece(), _piece(other)))

    def __rmatmul__(self, other: Any) -> DTensor:
        return self._with(*ops.matmul(_piece(other), self._piece()))

    @property
    def T(self) -> DTensor:  # noqa: N802 - the array convention
        """The transpose of a 2-d DTensor (Shard(0) and Shard(1) swap)."""
        return self._with(*ops.transpose(self._piece()))

    def sum(self, dim: int | Sequence[int] | None = None, keepdim: bool = False) -> DTensor:
        """Sum over ``dim`` (all dimensions when None); a sharded dimension summed becomes ``Partial(sum)``.

        Example::

            # x: Shard(0) over 2 ranks
            s = x.sum(0)          # Partial(sum): each rank summed its rows
            s.full_tensor()       # one allreduce: the column sums

        """
        return self._with(*ops.reduce_sum(self._piece(), dim, keepdim, mean=False))

    def mean(self, dim: int | Sequence[int] | None = None, keepdim: bool = False) -> DTensor:
        """Mean over ``dim``: :meth:`sum` divided by the number of elements summed (also Partial when sharded)."""
        return self._with(*ops.reduce_sum(self._piece(), dim, keepdim, mean=True))

    def __getattr__(self, name: str) -> Any:
        # AttributeError, so hasattr() and copy/pickle probes still work; the text names the operation.
        raise AttributeError(f"DTensor: {name!r} is not supported (supported: redistribute, full_tensor, "
                                  f"to_local, elementwise arithmetic, sum, mean, @ and .T); work on to_local() "
                                  f"or redistribute first")

    def __repr__(self) -> str:
        kind = "torch" if xp.is_torch(self._local) else "numpy"
        return (f"DTensor(shape={self.shape}, dtype={self.dtype}, placements={list(self.placements)}, "
                f"mesh={self.device_mesh.shape}, local={kind} {tuple(self._local.shape)})")


def _piece(x: Any) -> Any:
    """Return a DTensor's parts for the rules in ops; anything else as it is."""
    return x._piece() if isinstance(x, DTensor) else x


def distribute_tensor(tensor: Any, device_mesh: DeviceMesh | Backend, placements: Sequence[Placement]) -> DTensor:
    """Cut a full tensor that every rank holds into this rank's piece; no communication.

    ``Partial`` placements keep the value as exact terms (SUM: the value on
    coordinate 0, zeros elsewhere; AVG, MAX, MIN: the value everywhere).

    Args:
        tensor: The whole tensor, the same on every rank (NumPy array or torch CPU tensor).
        device_mesh: The mesh (a process group means the 1-d mesh of its ranks).
        placements: One per mesh dimension.

    Returns:
        A DTensor whose local piece is new memory (a copy of the chunk), except a
        dimension-0 chunk, which may be a view of ``tensor``.

    Example::

        # 4 ranks, 2 x 2 mesh
        w = distribute_tensor(np.ones((5, 3)), mesh, [Shard(0), Shard(1)])
        # coordinate (0, 0): rows 0-2, columns 0-1    (1, 1): rows 3-4, column 2

    """
    _check_array(tensor, "distribute_tensor")
    mesh = _as_mesh(device_mesh)
    shape = tuple(int(n) for n in tensor.shape)
    chosen = normalize_placements(placements, mesh.ndim, len(shape), "distribute_tensor")
    replicated = (Replicate(),) * mesh.ndim
    local = run_plan(xp.contiguous(tensor), shape, replicated, plan_redistribute(replicated, chosen), mesh, None)
    if local is tensor:
        local = xp.copy(local)
    return DTensor(local, mesh, chosen, shape)


def _infer_shape(local_shape: tuple[int, ...], placements: tuple[Placement, ...], mesh: DeviceMesh,
                 timeout: float | None) -> tuple[int, ...]:
    """Find the global shape from every rank's piece shape (one small all_gather over the mesh's group)."""
    if not any(isinstance(p, Shard) for p in placements):
        return local_shape
    shapes = collective.all_gather(np.array(local_shape, np.int64), group=mesh.group, timeout=timeout)
    shapes = shapes.reshape(mesh.group.world_size, len(local_shape))
    coordinates = np.argwhere(mesh.mesh >= 0)  # row-major: coordinate i is mesh rank i
    ranks = [int(r) for r in mesh.mesh.reshape(-1)]
    found = [0] * len(local_shape)
    for dim in range(len(local_shape)):
        sharded = [m for m, p in enumerate(placements) if p == Shard(dim)]
        # Sum the pieces along the sharding mesh dimensions, at coordinate 0 of the others.
        found[dim] = sum(int(shapes[rank][dim]) for rank, coordinate in zip(ranks, coordinates, strict=True)
                         if all(coordinate[m] == 0 for m in range(mesh.ndim) if m not in sharded))
    shape = tuple(found)
    # Every rank checks every piece, so a wrong one is reported everywhere, not only where it lies.
    for rank, coordinate in zip(ranks, coordinates, strict=True):
        expected = tuple(length for _, length in local_box(shape, placements, mesh.shape, tuple(coordinate)))
        if expected != tuple(int(n) for n in shapes[rank]):
            raise SizeMismatchError(
                f"DTensor.from_local: rank {rank} (mesh coordinate {tuple(int(c) for c in coordinate)}) holds a "
                f"piece of shape {tuple(int(n) for n in shapes[rank])}, but the pieces make a {shape} tensor "
                f"placed {list(placements)}, whose piece there has shape {expected} (torch.chunk's split)",
                math.prod(expected), int(np.prod(shapes[rank])))
    return shape
