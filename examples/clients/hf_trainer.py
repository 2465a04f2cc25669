"""The transformers Trainer over the plait backend (CPU), with a tiny GPT-2 built from a config
(no download) and a synthetic dataset.

    HF_HUB_OFFLINE=1 torchrun --nproc-per-node 2 examples/clients/hf_trainer.py --backend plait
    HF_HUB_OFFLINE=1 torchrun --nproc-per-node 2 examples/clients/hf_trainer.py --backend gloo

On CPU the Trainer hands `ddp_backend` to Accelerate, which accepts only gloo (or mpi) there:
`ddp_backend="plait"` raises "Your assigned backend plait is not available, please use gloo".
The Trainer (through Accelerate) uses the default process group if one exists, so create it first
and leave `ddp_backend` unset:

    import torch.distributed as dist
    dist.init_process_group("plait")                     # before TrainingArguments
    args = TrainingArguments(..., use_cpu=True)           # no ddp_backend

`use_cpu=True` matters on a machine without a GPU: without it the Trainer does not see a
distributed CPU run and trains each rank alone (no DDP).
"""

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from _client import args, emit


class Tokens(torch.utils.data.Dataset):
    """Synthetic token sequences (a fixed seed: the same on every rank and every run)."""

    def __init__(self, n=64, length=16, vocab=64):
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    a = args(__doc__, steps=6, out=dict(default="/tmp/plait-hf-trainer"))
    dist.init_process_group(a.backend)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    targs = TrainingArguments(
        output_dir=f"{a.out}-{a.backend}", use_cpu=True, max_steps=a.steps, per_device_train_batch_size=4,
        learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], seed=0,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=Tokens())
    assert trainer.args.parallel_mode.name == "DISTRIBUTED", trainer.args.parallel_mode
    assert dist.get_backend() == a.backend, dist.get_backend()
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    emit("hf_trainer", a.backend, losses, trainer.model.parameters(), torch_backend=dist.get_backend())
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
