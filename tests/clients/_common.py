"""What every client script trains: one model, one data set, one optimiser, so ferro, gloo and one process compare.

A global step takes 12 samples in order (6 per rank on 2 ranks), so the ranks'
averaged gradient is the gradient of one process on the same 12 samples.
"""

import json

import torch

SAMPLES, GLOBAL_BATCH, EPOCHS, LR = 48, 12, 2, 0.1


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(SAMPLES, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (SAMPLES,), generator=g)


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(x), y)


def rank_batches(rank: int, world_size: int):
    """This rank's share of each global batch, in step order (what DistributedSampler and accelerate hand out)."""
    x, y = make_data()
    for _ in range(EPOCHS):
        for start in range(0, SAMPLES, GLOBAL_BATCH):
            yield x[start:start + GLOBAL_BATCH][rank::world_size], y[start:start + GLOBAL_BATCH][rank::world_size]


def single_process_params() -> list[list[float]]:
    """The parameters one process reaches on whole global batches."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in rank_batches(0, 1):
        optimizer.zero_grad()
        loss_of(model, x, y).backward()
        optimizer.step()
    return params_of(model)


def params_of(model: torch.nn.Module) -> list[list[float]]:
    return [p.detach().flatten().tolist() for p in model.parameters()]


def write_result(path: str, backend: str, params: list[list[float]]) -> None:
    with open(path, "w") as f:
        json.dump({"backend": backend, "params": params}, f)
