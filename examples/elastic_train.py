"""Train through a lost rank: kill any rank mid-run (rank 0 included) and the job still finishes, exit 0.

    ferro run --nproc-per-node 4 --restart-policy rank --max-restarts 1 --min-size 2 examples/elastic_train.py
    ferro run --nproc-per-node 4 --restart-policy rank --max-restarts 1 --min-size 2 \
        examples/elastic_train.py --kill 0:50

While it trains, ``kill -9`` any rank's process from another shell (rank 0's pid is printed), or let
``--kill RANK:STEP`` do it: the other ranks abandon the step in flight, shrink their group in place and
redo that step with their shares of its samples; ``ferro run`` starts a replacement, which joins at a
step boundary and receives the model and optimizer state from a healthy rank. With ``--stop RANK:STEP``
the rank freezes itself instead (SIGSTOP): ``ferro run`` sees its heartbeat stop and kills it.

``--torch-ddp`` trains through torch's own ``DistributedDataParallel`` on the "ferro" backend;
``--replica-size 2`` shards the model over pairs of ranks (hybrid-sharded ``ferro.FSDP``): a pair
that loses a rank waits out of training until its replacement has joined, the other pair trains on.

Each step trains the same 64 samples whatever the world size (``ElasticSampler``), weighted so the
gradient is the mean over all of them: the final parameters equal those of one process training on
the whole batch (``--out`` saves them for that comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import numpy as np

from ferro import nn
from ferro.elastic import ElasticSampler, Manager


def data(samples: int, features: int, dtype: type) -> tuple[np.ndarray, np.ndarray]:
    """Return a fixed regression problem: targets from a random linear map plus a nonlinearity."""
    rng = np.random.default_rng(1234)
    x = rng.standard_normal((samples, features)).astype(dtype)
    w = rng.standard_normal((features, 4)).astype(dtype)
    return x, np.tanh(x @ w).astype(dtype)


def model_and_optimizer(features: int, hidden: int, dtype: type, lr: float) -> tuple[nn.Module, nn.Optimizer]:
    """Return the same initial model on every rank that builds it (the manager makes it rank 0's anyway)."""
    rng = np.random.default_rng(7)
    net = nn.Sequential(nn.Linear(features, hidden, rng=rng, dtype=dtype), nn.Tanh(),
                        nn.Linear(hidden, 4, rng=rng, dtype=dtype))
    return net, nn.SGD(net.parameters(), lr=lr, momentum=0.9)


def torch_model_and_optimizer(features: int, hidden: int, dtype: type, lr: float):
    """Return the same model in PyTorch (``--torch``), initialised from the ferro.nn one's values."""
    import torch

    reference, _ = model_and_optimizer(features, hidden, dtype, lr)
    net = torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 4))
    net = net.to(torch.float64 if dtype is np.float64 else torch.float32)
    net.load_state_dict({name: torch.from_numpy(value) for name, value in reference.state_dict().items()})
    return net, torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)


def _member_event(spec: str | None, rank: int, step: int) -> bool:
    if not spec:
        return False
    return any(int(r) == rank and int(s) == step for r, s in (item.split(":") for item in spec.split(",")))


def main() -> int:
    """Train; return 0."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--float64", action="store_true", help="train in float64 (for exact comparisons)")
    parser.add_argument("--kill", help="RANK:STEP[,RANK:STEP]: that launch rank SIGKILLs itself in that step")
    parser.add_argument("--stop", help="RANK:STEP[,...]: that launch rank SIGSTOPs itself (freezes) in that step")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds of extra work per step (slows the demo)")
    parser.add_argument("--torch", action="store_true", help="the same model in PyTorch, through the same DDP")
    parser.add_argument("--torch-ddp", action="store_true",
                        help="the PyTorch model through torch's own DistributedDataParallel (the 'ferro' backend)")
    parser.add_argument("--replica-size", type=int, default=1,
                        help="ranks per replica: >1 shards the model within each replica (hybrid-sharded FSDP)")
    parser.add_argument("--wait-for-size", type=int, default=0,
                        help="slow each of the last 20 steps by 0.5 s while fewer ranks than this train, so a "
                             "replacement has time to join before the end (the tests use it)")
    parser.add_argument("--backend", default="tcp", choices=("tcp", "shm"), help="each epoch's group")
    parser.add_argument("--out", help="rank 0 saves the final parameters here (.npz) with a log of the steps")
    args = parser.parse_args()

    dtype = np.float64 if args.float64 else np.float32
    x, y = data(1024, 16, dtype)
    args.torch = args.torch or args.torch_ddp
    if args.torch:
        import torch

        net, optimizer = torch_model_and_optimizer(16, args.hidden, dtype, args.lr)
        x, y = torch.from_numpy(x), torch.from_numpy(y)
    else:
        net, optimizer = model_and_optimizer(16, args.hidden, dtype, args.lr)
    manager = Manager(backend=args.backend, replica_size=args.replica_size)  # min_size: ferro run --min-size
    if args.replica_size > 1:
        model = manager.fsdp(net)  # this rank's shards are what a rejoining rank receives
        optimizer = (torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9) if args.torch else
                     nn.SGD(model.parameters(), lr=args.lr, momentum=0.9))
        manager.register(optimizer=optimizer)
    else:
        if args.torch_ddp:
            from ferro.interop.torch_elastic import elastic_ddp

            model = elastic_ddp(manager, net)  # torch's own DistributedDataParallel, re-pointed at each change
        else:
            model = manager.ddp(net)
        manager.register(model=net, optimizer=optimizer)
    criterion = nn.MSELoss()
    sampler = ElasticSampler(len(x), args.batch_size, seed=0)
    launch_rank, first_life = int(os.environ["RANK"]), os.environ.get("FERRO_RESTART_COUNT", "0") == "0"
    if manager.rank == 0:
        print(f"training {args.steps} steps on {manager.world_size} ranks (rank 0 is pid {os.getpid()})", flush=True)
    log = []
    for step in manager.steps(args.steps, sampler):
        with step:
            shard = step.shard
            assert shard is not None
            optimizer.zero_grad()
            index = shard.indices
            if args.torch:
                loss_tensor = torch.nn.functional.mse_loss(model(x[index]), y[index]) * shard.loss_weight
                loss = float(loss_tensor.detach()) / shard.loss_weight
            else:
                loss = criterion(model(x[index]), y[index])
            if first_life and _member_event(args.kill, launch_rank, step.number):
                os.kill(os.getpid(), signal.SIGKILL)
            if first_life and _member_event(args.stop, launch_rank, step.number):
                os.kill(os.getpid(), signal.SIGSTOP)
            if args.sleep:
                time.sleep(args.sleep)
            if step.world_size < args.wait_for_size and step.number >= args.steps - 20:
                time.sleep(0.5)
            if args.torch:
                loss_tensor.backward()  # DDP averages the buckets during backward
            else:
                model.backward(criterion.backward() * shard.loss_weight)
            optimizer.step()
            log.append((step.number, step.world_size, time.time()))
            if step.rank == 0 and step.number % 50 == 0:
                print(f"step {step.number}: loss {loss:.5f} on {step.world_size} ranks", flush=True)
    final = model.full_state_dict() if args.replica_size > 1 else net.state_dict()  # FSDP: collective
    if manager.rank == 0:
        changes = [(c.epoch, len(c.members), c.cause.split(":")[0]) for c in manager.history]
        print(f"done: {manager.step} steps; membership changes seen by this rank: {changes}", flush=True)
        if args.out:
            final = {name: value.detach().numpy() if args.torch else value for name, value in final.items()}
            np.savez(args.out, **final)
            with open(args.out + ".json", "w") as handle:
                json.dump({"log": log, "history": [c.__dict__ for c in manager.history]}, handle)
    manager.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
