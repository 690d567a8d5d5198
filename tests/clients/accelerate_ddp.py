"""accelerate on CPU over the backend named on the command line, started by torchrun: ``accelerate_ddp.py BACKEND OUT``.

accelerate accepts only gloo and mpi for CPU in ``InitProcessGroupKwargs``; it
adopts a process group that already exists, so the script makes it first.

It ends as torch asks: both ranks meet before the group is destroyed, and the
prepared objects (accelerate's DDP holds the process group) are let go first.
A ProcessGroupGloo still referenced when the interpreter shuts down is destroyed
with its worker threads running: ``terminate called without an active
exception`` (SIGABRT), which a loaded machine showed on gloo's rank 1.
"""

import gc
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
    accelerator.wait_for_everyone()  # neither rank tears down while the other still talks
    del model, optimizer, data
    accelerator.free_memory()
    gc.collect()
    dist.destroy_process_group()
