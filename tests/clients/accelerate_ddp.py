"""accelerate on CPU over the backend named on the command line, started by torchrun: ``accelerate_ddp.py BACKEND OUT``.

accelerate accepts only gloo and mpi for CPU in ``InitProcessGroupKwargs``; it
adopts a process group that already exists, so the script makes it first.
"""

import sys

import torch
import torch.distributed as dist
from _common import GLOBAL_BATCH, LR, loss_of, make_data, make_model, params_of, write_result

if __name__ == "__main__":
    backend, out = sys.argv[1], sys.argv[2]
    dist.init_process_group(backend)
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*make_data()), batch_size=GLOBAL_BATCH // 2)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    for _ in range(2):
        for x, y in data:
            optimizer.zero_grad()
            accelerator.backward(loss_of(model, x, y))
            optimizer.step()
    if accelerator.is_main_process:
        write_result(out, dist.get_backend(), params_of(accelerator.unwrap_model(model)))
    dist.destroy_process_group()
