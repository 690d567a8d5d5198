"""Train an MLP classifier data-parallel on the handwritten digits that ship with scikit-learn.

    ferro run --nproc-per-node 2 examples/train_mlp.py            # ferro.nn model
    ferro run --nproc-per-node 2 examples/train_mlp.py --torch    # the same model in PyTorch

Every rank takes its share of each global batch; ferro.DDP averages the
gradients, so the run trains exactly as one process would on the whole batch.
Rank 0 prints each epoch's loss, test accuracy and time.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import ferro
from ferro import nn


def load_digits_or_explain() -> tuple[np.ndarray, np.ndarray]:
    """Return the digits (scaled to [0, 1]) and their labels, or say what to install."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        print("this example needs scikit-learn's bundled digits: pip install 'ferro[examples]' "
              "(or pip install scikit-learn)", file=sys.stderr)
        raise SystemExit(2) from None
    digits = load_digits()
    return (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int64)


def build(use_torch: bool, hidden: int, seed: int, lr: float):
    """Return ``(step(x, y) -> loss, predict)`` for the chosen model, wrapped in ferro.DDP."""
    if use_torch:
        import torch

        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
        ddp = ferro.DDP(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        criterion = torch.nn.CrossEntropyLoss()

        def step(x, y):
            optimizer.zero_grad()
            loss = criterion(ddp(torch.from_numpy(x)), torch.from_numpy(y))
            loss.backward()  # buckets are averaged during backward
            optimizer.step()
            return float(loss.detach())

        def predict(x):
            with torch.no_grad():
                return model(torch.from_numpy(x)).numpy()
        return step, predict
    rng = np.random.default_rng(seed)
    model = nn.Sequential(nn.Linear(64, hidden, rng=rng), nn.ReLU(), nn.Linear(hidden, 10, rng=rng))
    ddp = ferro.DDP(model)
    optimizer = nn.SGD(model.parameters(), lr=lr, momentum=0.9)
    criterion = nn.CrossEntropyLoss()

    def step(x, y):
        loss = criterion(ddp(x), y)
        optimizer.zero_grad()
        ddp.backward(criterion.backward())
        optimizer.step()
        return loss

    return step, model


def main() -> int:
    """Train and report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torch", action="store_true", help="train the PyTorch version of the model")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split over the ranks")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    x, y = load_digits_or_explain()
    group = ferro.init_process_group()
    rank, world = group.rank, group.world_size
    order = np.random.default_rng(1234).permutation(len(x))  # the same split on every rank
    test_idx, train_idx = order[:360], order[360:]
    step, predict = build(args.torch, args.hidden, args.seed, args.lr)
    if rank == 0:
        print(f"training {'PyTorch' if args.torch else 'ferro.nn'} MLP 64-{args.hidden}-10 on {len(train_idx)} digits, "
              f"{world} ranks, global batch {args.batch_size}", flush=True)
    for epoch in range(1, args.epochs + 1):
        start = time.perf_counter()
        shuffled = np.random.default_rng(args.seed + epoch).permutation(train_idx)  # same on every rank
        losses = []
        for begin in range(0, len(shuffled) - args.batch_size + 1, args.batch_size):
            batch = np.array_split(shuffled[begin:begin + args.batch_size], world)[rank]
            losses.append(step(x[batch], y[batch]))
        mean_loss = np.array([np.mean(losses)])
        ferro.allreduce(mean_loss, ferro.ReduceOp.MEAN)
        accuracy = float(np.mean(np.argmax(predict(x[test_idx]), axis=1) == y[test_idx]))
        if rank == 0:
            print(f"epoch {epoch:2d}  loss {mean_loss[0]:.4f}  test accuracy {accuracy:.3f}  "
                  f"time {time.perf_counter() - start:.2f} s", flush=True)
    ferro.destroy_process_group()
    return 0

if __name__ == "__main__":
    sys.exit(main())
