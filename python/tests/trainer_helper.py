"""Run by test_trainer.py under torchrun --nproc_per_node 2 (gloo; or mpirun -np 2):
transformers.Trainer on a 2-layer GPT-2 built from a config (nothing downloaded), twice on the
same data: with torch.optim.AdamW under DDP (what Trainer does by itself with several
processes: accelerate wraps the model in DistributedDataParallel) and with shardgrad's
ShardedAdamW passed as optimizers=(opt, scheduler). max_grad_norm (Trainer's default 1.0)
clips in both through accelerate's clip_grad_norm_, which (accelerate >= 1.16) computes the norm
from p.grad itself: for ShardedAdamW, the ShardGrads (docs/torch-grads.md). Rank 0 writes the
per-step losses and gradient norms Trainer logged.

usage: trainer_helper.py OUT_JSON STEPS
"""

import json
import os
import sys

# accelerate and torch.distributed read the ranks from these (mpirun sets OMPI_*)
os.environ.setdefault("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
os.environ.setdefault("WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
os.environ.setdefault("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import (GPT2Config, GPT2LMHeadModel, Trainer,  # noqa: E402
                          TrainingArguments)
from transformers.utils import logging as hf_logging  # noqa: E402

import shardgrad as sg  # noqa: E402
from shardgrad.torch import ShardedAdamW  # noqa: E402

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class Tokens(torch.utils.data.Dataset):
    """Sequences that count up by a stride modulo the vocabulary: learnable."""

    def __init__(self, n, seq, vocab):
        g = torch.Generator().manual_seed(0)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.x = (start + stride * torch.arange(seq)) % vocab

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def model():
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def train(which, steps, outdir, data):
    m = model()
    args = TrainingArguments(output_dir=outdir, max_steps=steps, per_device_train_batch_size=4,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             dataloader_num_workers=0, seed=0, data_seed=0, max_grad_norm=1.0,
                             disable_tqdm=True, lr_scheduler_type="constant")
    if which == "torch":
        opt = torch.optim.AdamW(m.parameters(), **HP)
    else:
        opt = ShardedAdamW(m, sg.Comm.from_torch(), **HP, timeout_ms=120000)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    tr = Trainer(model=m, args=args, train_dataset=data, optimizers=(opt, sched))
    tr.train()
    logs = [x for x in tr.state.log_history if "loss" in x]
    wrapped = type(tr.model_wrapped).__name__
    if which == "sharded":
        opt.close()
    return dict(loss=[x["loss"] for x in logs], grad_norm=[x.get("grad_norm") for x in logs],
                wrapped=wrapped)


def main():
    out, steps = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    if not dist.is_initialized():  # Comm.from_torch needs the process group first
        dist.init_process_group("gloo")
    hf_logging.set_verbosity_error()
    data = Tokens(4 * 2 * steps, 32, 64)
    res = {w: train(w, steps, os.path.dirname(out), data) for w in ("torch", "sharded")}
    if int(os.environ["RANK"]) == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
