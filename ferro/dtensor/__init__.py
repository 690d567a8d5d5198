"""Distributed tensors: a global tensor spread over a DeviceMesh, with real redistribution.

``Shard(dim)`` splits a dimension as ``torch.chunk`` does (a ferro shard equals
torch's for the same mesh, uneven ones included), ``Replicate()`` copies,
``Partial(op)`` holds terms awaiting a reduction. :meth:`DTensor.redistribute`
moves between any two placements with the cheapest collective per mesh
dimension (see :mod:`ferro.dtensor.redistribute`).

Example::

    # 2 ranks: a tensor-parallel MLP layer pair
    from ferro.dtensor import DTensor, Replicate, Shard, distribute_tensor
    mesh = ferro.init_device_mesh((2,))
    x = distribute_tensor(x_full, mesh, [Replicate()])
    w1 = distribute_tensor(w1_full, mesh, [Shard(1)])      # column-wise
    w2 = distribute_tensor(w2_full, mesh, [Shard(0)])      # row-wise
    h = x @ w1                                             # Shard(1), no communication
    h = h * (h > 0)                                        # ReLU, local
    y = (h @ w2).redistribute([Replicate()])               # Partial -> one allreduce
"""

from ferro.dtensor.api import DTensor, distribute_tensor
from ferro.dtensor.convert import from_sharded_entries
from ferro.dtensor.placements import Partial, Placement, Replicate, Shard, matmul_placements
from ferro.dtensor.redistribute import Step, plan_redistribute

__all__ = ["DTensor", "Partial", "Placement", "Replicate", "Shard", "Step", "distribute_tensor", "from_sharded_entries",
           "matmul_placements", "plan_redistribute"]
