#!/usr/bin/env python3
"""Hugging Face transformers.Trainer with shardgrad's ShardedAdamW as its optimizer.

    # 2 processes (gloo process group, Comm.from_torch):
    torchrun --nproc_per_node 2 examples/python/hf_trainer.py
    # 1 process:
    python3 examples/python/hf_trainer.py
    # more steps, another clipping threshold:
    torchrun --nproc_per_node 2 examples/python/hf_trainer.py --steps 50 --max-grad-norm 0.5

Needs transformers and accelerate (Trainer requires accelerate): pip install transformers
accelerate. Nothing is downloaded: the model is a 2-layer GPT-2 built from a config, trained on
sequences that count up by a stride (learnable in a few steps).

What it shows:
 - the process group is created first (torch.distributed.init_process_group), then the
   communicator from it (sg.Comm.from_torch()), then ShardedAdamW over the model, handed to
   Trainer as optimizers=(opt, scheduler). ShardedAdamW reduces the gradients itself, so
   Trainer does not wrap the model in DistributedDataParallel.
 - max_grad_norm clips through accelerate, which computes the norm from every p.grad: for
   ShardedAdamW these are ShardGrads whose norm is the true global norm of the reduced gradient
   (docs/torch-grads.md). Rank 0 prints the gradient norm Trainer logged at every step: never 0.
Exits with status 1 if a logged gradient norm is 0 or the loss did not fall.
"""

import argparse
import os
import socket
import sys


def _args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps (default: 10)")
    ap.add_argument("--max-grad-norm", type=float, default=1.0,
                    help="Trainer's max_grad_norm (default: 1.0)")
    ap.add_argument("--lr", type=float, default=3e-3, help="learning rate (default: 0.003)")
    return ap.parse_args()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _init_process_group(dist):
    """torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; a plain `python` run is a
    world of one on a free local port."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=_free_port())
    dist.init_process_group("gloo")


def main():
    args = _args()
    try:
        import accelerate  # noqa: F401  (Trainer needs it)
        import torch
        import torch.distributed as dist
        from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
        from transformers.utils import logging as hf_logging
    except ImportError as e:
        print("hf_trainer.py needs torch, transformers and accelerate (pip install "
              "transformers accelerate): %s" % e, file=sys.stderr)
        return 2
    import shardgrad as sg
    from shardgrad.torch import ShardedAdamW

    _init_process_group(dist)
    rank, world = dist.get_rank(), dist.get_world_size()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)

    class Counting(torch.utils.data.Dataset):
        def __init__(self, n, seq, vocab):
            g = torch.Generator().manual_seed(0)
            start = torch.randint(0, vocab, (n, 1), generator=g)
            stride = torch.randint(1, 4, (n, 1), generator=g)
            self.x = (start + stride * torch.arange(seq)) % vocab

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"input_ids": self.x[i], "labels": self.x[i]}

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=2,
                                       n_head=2))
    comm = sg.Comm.from_torch()  # after init_process_group
    opt = ShardedAdamW(model, comm, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    targs = TrainingArguments(output_dir=os.path.join("/tmp", "hf_trainer_out"),
                              max_steps=args.steps, per_device_train_batch_size=4,
                              logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                              dataloader_num_workers=0, seed=0, max_grad_norm=args.max_grad_norm,
                              disable_tqdm=True, lr_scheduler_type="constant")
    trainer = Trainer(model=model, args=targs, train_dataset=Counting(4 * world * args.steps,
                                                                      32, 64),
                      optimizers=(opt, sched))
    trainer.train()
    logs = [x for x in trainer.state.log_history if "loss" in x]
    if rank == 0:
        print("ShardedAdamW under transformers.Trainer, %d rank%s, %s" % (
            world, "" if world == 1 else "s", type(trainer.model_wrapped).__name__))
        for i, x in enumerate(logs):
            print("step %3d  loss %.4f  grad_norm %.4f" % (i + 1, x["loss"], x["grad_norm"]))
    ok = all(x.get("grad_norm", 0) > 0 for x in logs) and logs[-1]["loss"] < logs[0]["loss"]
    opt.close()
    comm.close()
    dist.destroy_process_group()
    if not ok and rank == 0:
        print("FAILED: a gradient norm of 0, or the loss did not fall", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
