"""DeviceMesh lays ranks out row-major, as torch does, and its sub-groups really connect those ranks."""

import numpy as np
import pytest

import ferro
from ferro.testing import run_processes, run_threads


def rank_mesh(group, shape, names):
    mesh = ferro.init_device_mesh(shape, names, group=group)
    seen = {"shape": mesh.shape, "ndim": mesh.ndim, "coordinate": mesh.get_coordinate(), "dims": []}
    for dim in range(mesh.ndim):
        sub = mesh.get_group(dim)
        # Sum the global ranks along the dimension: proves who is really in the sub-group.
        members = ferro.all_gather(np.array([group.rank]), group=sub)
        seen["dims"].append({"size": mesh.size(dim), "local_rank": mesh.get_local_rank(dim), "sub_rank": sub.rank,
                             "members": members.tolist(), "same_object": mesh.get_group(dim) is sub})
    if names:
        sub_mesh = mesh[names[-1]]
        seen["named"] = (sub_mesh.shape, sub_mesh.get_group().world_size, sub_mesh.get_local_rank(),
                         sub_mesh.get_group() is mesh.get_group(mesh.ndim - 1))
    return seen


@pytest.mark.parametrize(("shape", "names"), [((2, 2), ("replicate", "shard")), ((2, 3), None), ((3, 2), ("a", "b")),
                                              ((6,), ("dp",)), ((1, 2, 3), ("x", "y", "z"))])
def test_mesh_is_row_major_with_one_sub_group_per_dimension(shape, names):
    results = run_threads(rank_mesh, int(np.prod(shape)), args=(shape, names), timeout=60)
    grid = np.arange(int(np.prod(shape))).reshape(shape)
    for rank, seen in enumerate(results):
        coordinate = tuple(int(c) for c in np.argwhere(grid == rank)[0])
        assert seen["shape"] == shape and seen["ndim"] == len(shape) and seen["coordinate"] == coordinate
        for dim, entry in enumerate(seen["dims"]):
            line = grid[coordinate[:dim] + (slice(None),) + coordinate[dim + 1:]]  # torch's layout
            assert entry["members"] == line.tolist()
            assert entry["local_rank"] == entry["sub_rank"] == coordinate[dim]
            assert entry["size"] == shape[dim] and entry["same_object"]
        if names:
            assert seen["named"] == ((shape[-1],), shape[-1], coordinate[-1], True)


def test_mesh_sub_groups_over_real_processes():
    results = run_processes(rank_mesh, 4, args=((2, 2), ("replicate", "shard")), backend="tcp", timeout=120)
    assert [r["dims"][1]["members"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dims"][0]["members"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def test_bad_shapes_and_names_are_refused():
    group = ferro.SimulatedBackend.create_group(1)[0]
    with pytest.raises(ValueError, match=r"mesh_shape \(2, 2\) holds 4 ranks but the group has world size 1"):
        ferro.init_device_mesh((2, 2), group=group)
    with pytest.raises(ValueError, match="positive ints"):
        ferro.init_device_mesh((0,), group=group)
    with pytest.raises(ValueError, match="distinct strings"):
        ferro.init_device_mesh((1, 1), ("a", "a"), group=group)
    mesh = ferro.init_device_mesh((1, 1), ("a", "b"), group=group)
    with pytest.raises(KeyError, match="no dimension named 'c'"):
        mesh["c"]
    with pytest.raises(ValueError, match="outside a 2-d mesh"):
        mesh.get_group(2)
    assert repr(mesh) == "DeviceMesh([[0]], mesh_dim_names=('a', 'b'))"
