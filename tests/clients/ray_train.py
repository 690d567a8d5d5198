"""Ray Train's TorchTrainer on a local Ray with ``TorchConfig(backend="ferro")``: ``ray_train.py OUT_DIR``.

Ray builds the process group in its workers before the loop runs, so nothing in
them imports ferro: "ferro" must be a torch backend by name. The loop trains
once on Ray's group and once more on a gloo group made beside it in the same
workers (one Ray job instead of two: a TorchTrainer's start costs ~15 s here).
"""

import os
import sys

import ray
from ray.train import ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer


def loop(config):
    import os

    import torch
    import torch.distributed as dist
    from _common import LR, loss_of, make_model, params_of, rank_batches, write_result
    from ray.train.torch import prepare_model

    rank, size = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    for backend, model in ((dist.get_backend(), prepare_model(make_model())),
                           ("gloo", torch.nn.parallel.DistributedDataParallel(make_model(), process_group=gloo))):
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        for x, y in rank_batches(rank, size):
            optimizer.zero_grad()
            loss_of(model, x, y).backward()
            optimizer.step()
        if rank == 0:
            write_result(os.path.join(config["out"], f"{backend}.json"), backend, params_of(model.module))


if __name__ == "__main__":
    out_dir = sys.argv[1]
    here = os.path.dirname(os.path.abspath(__file__))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"PYTHONPATH": here, "FERRO_SECRET": os.environ["FERRO_SECRET"],
                                       "FERRO_BACKEND": os.environ.get("FERRO_BACKEND", "auto")}})
    TorchTrainer(loop, train_loop_config={"out": out_dir}, scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                 torch_config=TorchConfig(backend="ferro")).fit()
    ray.shutdown()
