"""Models, data and the single-process torch reference shared by the torch tests and the MPI
helper script. Import only where torch is present."""

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP. The key projection has no bias: a key bias
    gets an exactly-zero gradient (softmax is shift invariant), and Adam would turn the rounding
    noise of that zero into full-size updates that no two summation orders agree on."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        b, n, d = x.shape
        h = self.ln1(x)
        q, k, v = (t.view(b, n, self.heads, d // self.heads).transpose(1, 2)
                   for t in (self.q(h), self.k(h), self.v(h)))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    """A small GPT-style language model: token + position embeddings, pre-norm causal
    attention blocks, a final norm and an output head. One frozen parameter
    (requires_grad=False) checks that ShardedAdamW leaves it alone."""

    def __init__(self, vocab=48, d=32, heads=4, layers=2, seq=16):
        super().__init__()
        self.seq = seq
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.frozen_gain = nn.Parameter(torch.ones(d), requires_grad=False)

    def forward(self, x):
        h = self.tok(x) + self.pos[: x.shape[1]]
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h) * self.frozen_gain)


def lm_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def make_model(seed=0, **kw):
    torch.manual_seed(seed)
    return TinyLM(**kw)


def make_batches(seed, steps, micro, world, per_rank, seq=16, vocab=48):
    """tokens[step][micro][rank]: (per_rank, seq + 1) int64 sequences with learnable structure
    (each sequence counts up by a random stride modulo vocab)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(micro):
            start = torch.randint(0, vocab, (world, per_rank, 1), generator=g)
            stride = torch.randint(1, 4, (world, per_rank, 1), generator=g)
            t = (start + stride * torch.arange(seq + 1)) % vocab
            step.append([t[r] for r in range(world)])
        out.append(step)
    return out


def param_groups_like_sharded(model, weight_decay):
    """AdamW groups that match ShardedAdamW's default, which is torch's: every parameter decays."""
    return [{"params": [p for p in model.parameters() if p.requires_grad],
             "weight_decay": weight_decay}]


def torch_reference(model, batches, lr, weight_decay, max_grad_norm=0.0, betas=(0.9, 0.999),
                    eps=1e-8, per_rank=False):
    """Single-process torch.optim.AdamW on the combined batch (all ranks concatenated), with
    the same accumulation (loss / micro per micro-batch) and clipping. Returns the model, the
    per-step losses (mean over micro-batches), the per-step gradient norms before clipping
    and the optimizer."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(param_groups_like_sharded(model, weight_decay), lr=lr, betas=betas,
                            eps=eps, foreach=False)
    losses, norms = [], []
    for step in batches:
        tot = 0.0
        for micro in step:
            if per_rank:
                for part in micro:
                    loss = lm_loss(model, part) / len(step)
                    loss.backward()
                    tot += loss.item() / len(micro)
                continue
            loss = lm_loss(model, torch.cat(micro)) / len(step)
            loss.backward()
            tot += loss.item()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if per_rank:  # DDP averages the summed gradients after the backward passes
            for g in grads:
                g.div_(len(step[0]))
        norms.append(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())
        if max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(tot)
    return model, losses, norms, opt


def train_sharded(model, opt, batches, rank, use_no_sync=False):
    """One rank's loop with ShardedAdamW: its slice of every micro-batch, loss / micro, the
    first micro-batches under no_sync when asked. Returns the per-step local losses and the
    step infos."""
    losses, infos = [], []
    for step in batches:
        tot = 0.0
        for m, micro in enumerate(step):
            last = m == len(step) - 1
            if use_no_sync and not last:
                with opt.no_sync():
                    loss = lm_loss(model, micro[rank]) / len(step)
                    loss.backward()
            else:
                loss = lm_loss(model, micro[rank]) / len(step)
                loss.backward()
            tot += loss.item()
        opt.step()
        losses.append(tot)
        infos.append(opt.last_step_info)
    return losses, infos


def max_param_diff(a, b):
    """Largest |a - b| over the trainable parameters, and the largest |b|."""
    d, m = 0.0, 0.0
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb
        d = max(d, (pa.detach().float() - pb.detach().float()).abs().max().item())
        m = max(m, pb.detach().abs().max().item())
    return d, m
