"""Remote procedure calls between the processes of a job, over authenticated connections of their own.

``init_rpc(name)`` joins; ``rpc_sync`` / ``rpc_async`` run a function on another
worker; ``shutdown()`` waits for every worker's calls, then closes. RPC runs code
on request: it is exactly as safe as the job secret that authenticates its
connections.

Example::

    # worker "trainer1" of a job launched with `ferro run --nproc-per-node 3 job.py`
    ferro.rpc.init_rpc(f"trainer{rank}" if rank else "ps")
    weights = ferro.rpc.rpc_sync("ps", get_weights)          # runs on the parameter server
    future = ferro.rpc.rpc_async("ps", push_gradients, (grads,))
    future.wait()
    ferro.rpc.shutdown()
"""

from ferro.rpc.agent import Future, RpcAgent, WorkerInfo
from ferro.rpc.api import get_worker_info, init_rpc, rpc_async, rpc_sync, shutdown
from ferro.rpc.rref import RRef, owned_count, remote

__all__ = ["Future", "RRef", "RpcAgent", "WorkerInfo", "get_worker_info", "init_rpc", "owned_count", "remote",
           "rpc_async", "rpc_sync", "shutdown"]
