"""A job of many ranks (``ferro run --nproc-per-node 64``, TCP forced): every collective, checked against NumPy.

Each rank prints ``ok <rank> <connected peers>``; a wrong result raises.
"""

from __future__ import annotations

import numpy as np

import ferro


def main() -> None:
    group = ferro.init_process_group(backend="tcp", timeout=300)
    rank, n = group.rank, group.world_size
    everyone = np.arange(n, dtype=np.float64)

    small = np.full(3, float(rank))  # recursive doubling
    ferro.allreduce(small)
    assert np.array_equal(small, np.full(3, everyone.sum())), small
    large = np.arange(1 << 17, dtype=np.float64) * (rank + 1)  # 1 MiB: halving-doubling on a power of two
    ferro.allreduce(large)
    assert np.array_equal(large, np.arange(1 << 17, dtype=np.float64) * (n * (n + 1) // 2)), large[:4]

    gathered = np.empty(2 * n)
    ferro.all_gather(np.array([rank, -rank], np.float64), out=gathered)  # Bruck
    assert np.array_equal(gathered, np.stack([everyone, -everyone], axis=1).ravel())

    root = 37 % n
    value = np.array([7.0 * rank])
    ferro.broadcast(value, root=root)  # binomial tree from a root that is not 0
    assert value[0] == 7.0 * root

    far = (rank + n // 2) % n  # p2p with a rank no collective connected (the pairing is mutual: n is even)
    got = ferro.sendrecv(np.array([float(rank)]), far)
    assert got[0] == far, got

    odd = list(range(n - 4))  # 60 ranks: not a power of two, so the fold and the ring
    sub = ferro.new_group(odd)
    if rank in odd:
        x = np.full(5, 1.0 + rank)
        ferro.allreduce(x, group=sub)
        assert np.array_equal(x, np.full(5, sum(1.0 + r for r in odd)))
        y = np.arange(1 << 17, dtype=np.float64) + rank  # the ring
        ferro.allreduce(y, group=sub)
        assert np.array_equal(y, np.arange(1 << 17, dtype=np.float64) * len(odd) + sum(odd))
    ferro.barrier()
    print(f"ok {rank} {len(group.connected_peers)}", flush=True)
    ferro.destroy_process_group()


if __name__ == "__main__":
    main()
