"""Lightning's Trainer with DDP over the plait backend (CPU).

    torchrun --nproc-per-node 2 examples/clients/lightning_ddp.py --backend plait
    torchrun --nproc-per-node 2 examples/clients/lightning_ddp.py --backend gloo

The one plait line is the strategy:

    from lightning.pytorch.strategies import DDPStrategy
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend="plait"))

Under torchrun (or any launcher that sets RANK/WORLD_SIZE) Lightning joins the launched processes;
run as a plain `python` script it starts the other ranks itself.
"""

import lightning as L
import torch
import torch.distributed as dist
import torch.nn as nn
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from _client import TinyNet, args, emit, global_batch


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = TinyNet(hidden=64)
        self.losses = []

    def training_step(self, batch, i):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(self.all_gather(loss.detach()).mean().item())   # the loss averaged over ranks
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main():
    a = args(__doc__, steps=6, nproc=dict(type=int, default=2, help="ranks (devices=) when not under torchrun"))
    xs, ys = zip(*(global_batch(step, 16) for step in range(a.steps * a.nproc)))
    data = DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=8, shuffle=False)
    model = Regressor()
    trainer = L.Trainer(
        accelerator="cpu", devices=a.nproc, strategy=DDPStrategy(process_group_backend=a.backend),
        max_steps=a.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=True,
    )
    trainer.fit(model, data)
    emit("lightning_ddp", a.backend, model.losses, model.net.parameters(), torch_backend=dist.get_backend())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
