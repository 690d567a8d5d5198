"""Ray Train's TorchTrainer on a local Ray, with ``TorchConfig(backend=...)`` for each backend named on the command
line: ``ray_train.py OUT_DIR BACKEND...``. Ray builds the process group in its workers before the loop runs, so
nothing in them imports ferro: "ferro" must be a torch backend by name.
"""

import os
import sys

import ray
from ray.train import ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer


def loop(config):
    import torch
    import torch.distributed as dist
    from _common import LR, loss_of, make_model, params_of, rank_batches, write_result
    from ray.train.torch import prepare_model

    rank, size = dist.get_rank(), dist.get_world_size()
    model = prepare_model(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in rank_batches(rank, size):
        optimizer.zero_grad()
        loss_of(model, x, y).backward()
        optimizer.step()
    if rank == 0:
        write_result(config["out"], dist.get_backend(), params_of(model.module))


if __name__ == "__main__":
    out_dir, backends = sys.argv[1], sys.argv[2:]
    here = os.path.dirname(os.path.abspath(__file__))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"PYTHONPATH": here, "FERRO_SECRET": os.environ["FERRO_SECRET"],
                                       "FERRO_BACKEND": os.environ.get("FERRO_BACKEND", "auto")}})
    for backend in backends:
        TorchTrainer(loop, train_loop_config={"out": os.path.join(out_dir, f"{backend}.json")},
                     scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                     torch_config=TorchConfig(backend=backend)).fit()
    ray.shutdown()
