"""A parameter server over ferro.rpc: rank 0 ("ps") holds the model; trainers pull weights and push gradients.

Run: ``ferro run --nproc-per-node 3 examples/parameter_server.py [--steps 30] [--check]``.

Synchronous training: each step, every trainer pulls the current weights
(``rpc_sync("ps", get_weights)``), computes the gradient of its share of the
batch, and pushes it (``rpc_sync("ps", push_gradients, ...)``). The server
averages one gradient per trainer, takes one SGD step, and only then answers
that step's pushes. So the weights after N steps are those of one process
running SGD on the whole batch: ``--check`` computes that run on rank 0 and
prints the largest difference (float64).

RPC executes code on request: any process holding the job secret can call the
server's functions. ``ferro run`` generates a fresh secret per job.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading

import numpy as np

from ferro import nn, rpc

SIZES = (8, 16, 4)
BATCH, LR = 24, 0.1


def make_model(seed: int = 0) -> nn.Module:
    """Build the model every process builds alike (trainers overwrite its weights each step)."""
    rng = np.random.default_rng(seed)
    return nn.Sequential(nn.Linear(SIZES[0], SIZES[1], rng=rng, dtype=np.float64), nn.Tanh(),
                         nn.Linear(SIZES[1], SIZES[2], rng=rng, dtype=np.float64))


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """Return the whole batch of one step (every process can make it)."""
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((BATCH, SIZES[0]))
    return x, np.tanh(x[:, :SIZES[2]] * 2) + 0.1 * rng.standard_normal((BATCH, SIZES[2]))


class ParameterServer:
    """The model and its optimizer; applies one averaged step once every trainer pushed."""

    def __init__(self, trainers: int) -> None:
        self.model = make_model()
        self.optimizer = nn.SGD(self.model.parameters(), lr=LR)
        self.trainers = trainers
        self.step = 0
        self._pushed: list[dict[str, np.ndarray]] = []
        self._stepped = threading.Condition()

    def weights(self) -> dict[str, np.ndarray]:
        """Return a copy of the current weights."""
        with self._stepped:
            return self.model.state_dict()

    def push(self, step: int, grads: dict[str, np.ndarray]) -> int:
        """Take one trainer's gradient for ``step``; return once the step is applied."""
        with self._stepped:
            if step != self.step:
                raise ValueError(f"a gradient for step {step} arrived at step {self.step}")
            self._pushed.append(grads)
            if len(self._pushed) == self.trainers:
                for name, param in self.model.named_parameters():
                    param.grad = sum(g[name] for g in self._pushed) / self.trainers
                self.optimizer.step()
                self._pushed.clear()
                self.step += 1
                self._stepped.notify_all()
            else:
                self._stepped.wait_for(lambda: self.step > step, timeout=60)
            return self.step


_server: ParameterServer | None = None  # on rank 0 only: what the functions below act on


def get_weights() -> dict[str, np.ndarray]:
    """Return the current weights (runs on the server)."""
    assert _server is not None, "get_weights runs on the parameter server"
    return _server.weights()


def push_gradients(step: int, grads: dict[str, np.ndarray]) -> int:
    """Add this trainer's gradient and return the step reached (runs on the server)."""
    assert _server is not None, "push_gradients runs on the parameter server"
    return _server.push(step, grads)


def train(rank: int, trainers: int, steps: int) -> float:
    """One trainer's loop; returns its last loss."""
    model, criterion = make_model(), nn.MSELoss()
    loss = float("nan")
    for step in range(steps):
        model.load_state_dict(rpc.rpc_sync("ps", get_weights))
        x, y = batch(step)
        rows = slice((rank - 1) * BATCH // trainers, rank * BATCH // trainers)
        model.zero_grad()
        loss = criterion(model(x[rows]), y[rows])
        model.backward(criterion.backward())
        rpc.rpc_sync("ps", push_gradients, (step, {n: p.grad for n, p in model.named_parameters()}))
    return loss


def single_process(steps: int) -> dict[str, np.ndarray]:
    """Return the reference: SGD on the whole batch in one process."""
    model, criterion = make_model(), nn.MSELoss()
    optimizer = nn.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        x, y = batch(step)
        optimizer.zero_grad()
        criterion(model(x), y)
        model.backward(criterion.backward())
        optimizer.step()
    return model.state_dict()


def main() -> int:
    """Run this process's part: the server on rank 0, a trainer elsewhere."""
    global _server
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--check", action="store_true", help="compare with one process on the whole batch")
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    trainers = world_size - 1
    if trainers < 1 or BATCH % trainers:
        print(f"needs 2 or more processes, with {BATCH} divisible by the trainers", file=sys.stderr)
        return 2
    if rank == 0:
        _server = ParameterServer(trainers)  # before init_rpc: trainers may call as soon as it returns
        rpc.init_rpc("ps")
        rpc.shutdown()  # serves until every trainer is done
        print(f"[ps] {_server.step} steps from {trainers} trainers")
        if args.check:
            reference = single_process(args.steps)
            final = _server.model.state_dict()
            worst = max(float(np.max(np.abs(final[k] - reference[k]))) for k in reference)
            print(f"[ps] max |parameter server - single process| = {worst:.3e}")
        return 0
    rpc.init_rpc(f"trainer{rank}")
    loss = train(rank, trainers, args.steps)
    print(f"[trainer{rank}] last loss {loss:.4f}")
    rpc.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
