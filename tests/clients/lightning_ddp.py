"""Lightning's DDP strategy on CPU, over each backend named: ``lightning_ddp.py OUT_DIR BACKEND...``.

One script trains once per backend (Lightning starts the other rank's process
once, at the first fit, and it runs the same fits), destroying the process
group between fits so that the next strategy makes its own.
"""

import sys

import lightning as L
import torch
from _common import GLOBAL_BATCH, LR, loss_of, make_data, make_model, params_of, write_result
from lightning.pytorch.strategies import DDPStrategy


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()

    def training_step(self, batch, _):
        return loss_of(self.net, *batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        # In order, as one process reads it (Lightning's own sampler would shuffle): rank r takes r, r + 2, ...
        data = torch.utils.data.TensorDataset(*make_data())
        sampler = torch.utils.data.DistributedSampler(data, shuffle=False)
        return torch.utils.data.DataLoader(data, batch_size=GLOBAL_BATCH // 2, sampler=sampler)


if __name__ == "__main__":
    import os

    import torch.distributed as dist

    out_dir, backends = sys.argv[1], sys.argv[2:]
    for backend in backends:
        model = Model()
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend=backend),
                            precision="64-true", max_epochs=2, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model)
        if trainer.global_rank == 0:
            write_result(os.path.join(out_dir, f"{backend}.json"), dist.get_backend(), params_of(model.net))
        dist.destroy_process_group()
