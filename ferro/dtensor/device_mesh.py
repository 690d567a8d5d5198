"""DeviceMesh: a process group's ranks laid out as an n-dimensional grid, with a sub-group per dimension.

Ranks fill the grid in row-major order, as ``torch.distributed.init_device_mesh``
lays them out: in a ``(2, 3)`` mesh of six ranks, row ``i`` holds ranks
``3i .. 3i+2``. Along dimension ``d``, the ranks that differ only in their
``d``-th coordinate form one sub-group; :meth:`DeviceMesh.get_group` returns the
one this rank belongs to. Every sub-group is made when the mesh is made,
collectively, so later calls never communicate.

The name is torch's; there are no devices here: each coordinate is one rank of
the group (a process, with whatever device it drives).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ferro.backend.base import Backend
from ferro.collective.process_group import get_default_group, new_group

__all__ = ["DeviceMesh", "init_device_mesh"]


class DeviceMesh:
    """An n-dimensional grid of a group's ranks, with one sub-group per dimension.

    Build it with :func:`init_device_mesh`.

    Attributes:
        group: The process group whose ranks the mesh lays out.
        mesh: The grid: ``mesh[coordinate]`` is a rank of ``group``.
        mesh_dim_names: A name per dimension, or ``None``.

    """

    def __init__(self, group: Backend, mesh: np.ndarray, mesh_dim_names: tuple[str, ...] | None,
                 dim_groups: list[Backend]) -> None:
        self.group = group
        self.mesh = mesh
        self.mesh_dim_names = mesh_dim_names
        self._dim_groups = dim_groups
        where = np.argwhere(mesh == group.rank)
        self._coordinate = tuple(int(c) for c in where[0])

    @property
    def shape(self) -> tuple[int, ...]:
        """The grid's extent along each dimension."""
        return tuple(int(n) for n in self.mesh.shape)

    @property
    def ndim(self) -> int:
        """The number of dimensions."""
        return int(self.mesh.ndim)

    def size(self, dim: int | str | None = None) -> int:
        """Return the number of ranks along ``dim``, or in the whole mesh when ``dim`` is None."""
        return int(self.mesh.size) if dim is None else self.shape[self._dim(dim)]

    def get_group(self, dim: int | str = 0) -> Backend:
        """Return the sub-group of the ranks that differ from this one only along ``dim``.

        Example::

            # 4 ranks, mesh = init_device_mesh((2, 2), ("replicate", "shard"))
            mesh.get_group("shard")       # ranks 0, 1: {0, 1};  ranks 2, 3: {2, 3}
            mesh.get_group("replicate")   # ranks 0, 2: {0, 2};  ranks 1, 3: {1, 3}

        """
        return self._dim_groups[self._dim(dim)]

    def get_local_rank(self, dim: int | str = 0) -> int:
        """Return this rank's coordinate along ``dim`` (its rank in :meth:`get_group`)."""
        return self._coordinate[self._dim(dim)]

    def get_coordinate(self) -> tuple[int, ...]:
        """Return this rank's coordinate in the grid."""
        return self._coordinate

    def get_rank(self) -> int:
        """Return this process's rank in :attr:`group`."""
        return self.group.rank

    def __getitem__(self, name: str | tuple[str]) -> DeviceMesh:
        """Return the 1-d mesh along the dimension called ``name`` that holds this rank.

        Raises:
            KeyError: No dimension has that name (or the mesh has no names).

        """
        if isinstance(name, tuple):
            if len(name) != 1:
                raise KeyError(f"DeviceMesh: slicing several dimensions ({name!r}) is not supported; "
                               f"take one dimension by name")
            name = name[0]
        dim = self._dim(name, lookup=KeyError)
        sub = self._dim_groups[dim]
        # The sub-mesh lays out its own group, so its grid holds that group's ranks (0..n-1).
        return DeviceMesh(sub, np.arange(sub.world_size), (name,), [sub])

    def _dim(self, dim: int | str, lookup: type[Exception] = ValueError) -> int:
        if isinstance(dim, str):
            if self.mesh_dim_names is None or dim not in self.mesh_dim_names:
                raise lookup(f"DeviceMesh: no dimension named {dim!r} (names: {self.mesh_dim_names})")
            return self.mesh_dim_names.index(dim)
        if isinstance(dim, bool) or not isinstance(dim, int) or not -self.ndim <= dim < self.ndim:
            raise lookup(f"DeviceMesh: dimension {dim!r} is outside a {self.ndim}-d mesh")
        return dim % self.ndim

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh({self.mesh.tolist()}{names})"


def init_device_mesh(mesh_shape: Sequence[int], mesh_dim_names: Sequence[str] | None = None,
                     group: Backend | None = None, *, timeout: float | None = None) -> DeviceMesh:
    """Lay out ``group``'s ranks as a grid of ``mesh_shape`` and make every dimension's sub-groups.

    Every rank of ``group`` must call it, with the same arguments: making the
    sub-groups is collective.

    Args:
        mesh_shape: The grid's extent along each dimension; the product must be the group's size.
        mesh_dim_names: A distinct name per dimension (for ``mesh["name"]``), or None.
        group: The group to lay out (default: the default group).
        timeout: Seconds for connecting the sub-groups (default: the group's).

    Returns:
        The mesh.

    Raises:
        ValueError: The shape's product is not the world size, a dimension is not
            a positive int, or the names are not one distinct string per dimension.

    Example::

        # 4 ranks
        mesh = ferro.init_device_mesh((2, 2), mesh_dim_names=("replicate", "shard"), group=world)
        # rank 3: mesh.get_local_rank("replicate") == 1, mesh.get_local_rank("shard") == 1
        # rank 3: mesh["shard"].get_group().rank == 1 (its group is ranks {2, 3})

    """
    g = group if group is not None else get_default_group()
    shape = tuple(mesh_shape)
    if not shape or any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1 for n in shape):
        raise ValueError(f"init_device_mesh: mesh_shape must be positive ints, got {mesh_shape!r}")
    shape = tuple(int(n) for n in shape)
    if math.prod(shape) != g.world_size:
        raise ValueError(f"init_device_mesh: mesh_shape {shape} holds {math.prod(shape)} ranks but the group has "
                         f"world size {g.world_size}")
    names: tuple[str, ...] | None = None
    if mesh_dim_names is not None:
        names = tuple(mesh_dim_names)
        if (len(names) != len(shape) or len(set(names)) != len(names)
                or not all(isinstance(n, str) for n in names)):
            raise ValueError(f"init_device_mesh: mesh_dim_names needs {len(shape)} distinct strings, "
                             f"got {mesh_dim_names!r}")
    mesh = np.arange(g.world_size).reshape(shape)
    return DeviceMesh(g, mesh, names, [_dim_group(g, mesh, dim, timeout) for dim in range(len(shape))])


def _dim_group(group: Backend, mesh: np.ndarray, dim: int, timeout: float | None) -> Backend:
    """Make every sub-group along ``dim`` (in one order on every rank) and return this rank's."""
    if mesh.shape[dim] == mesh.size:
        return group  # the dimension spans the whole group: no new connections needed
    mine: Any = None
    others = [range(n) for i, n in enumerate(mesh.shape) if i != dim]
    for rest in itertools.product(*others):
        index = rest[:dim] + (slice(None),) + rest[dim:]
        ranks = [int(r) for r in mesh[index]]
        made = new_group(ranks, group, timeout=timeout)
        if made is not None:
            mine = made
    assert mine is not None, "every rank lies on exactly one line along each dimension"
    return mine
