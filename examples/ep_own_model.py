"""Expert parallelism in your own model and training loop, equal to one process.

Run (CPU: gloo; on GPUs: NCCL, one GPU per process)::

    torchrun --standalone --nproc_per_node=2 examples/ep_own_model.py    # EP=2: each rank holds 4 of the 8 experts
    python examples/ep_own_model.py                                      # one process: all 8 experts, the whole batch

Both print ``step <s> loss <x>`` per step (the loss of the global batch: cross-entropy plus the MoE
aux losses), and the two runs print the same losses: N ranks train exactly like one process on
the concatenated batch. What makes that so, each a line of ``main``:

1. ``init_distributed(seed=...)`` seeds torch identically on every rank, so every rank builds the
   same dense and router weights (nothing broadcasts them), and ``MoELayer`` draws each *global*
   expert from its own generator, so rank r's experts are exactly the one-process model's experts
   ``[r·L, (r+1)·L)``. ``check_replicas_agree`` verifies it after building, and again at the end.
2. Every rank reads its own equal slice of the global batch; its loss is the mean over its tokens.
3. ``sync_gradients`` after the backward: dense gradients averaged over the world, expert gradients
   over their expert-data-parallel group (divided by the world size). Then any optimizer step.

Options: ``--steps``, ``--ep`` (default: the world size; it must divide the world and the 8
experts), ``--batch`` (global sequences per step, a multiple of the world size), ``--seed``,
``--out FILE.json`` (the losses and the world/EP layout), ``--save-state FILE.pt`` (the full state
after the steps, experts gathered from the EP group: what a one-process run would hold).

The model: token embedding → blocks (an attention-free causal token mixing — each position sees
itself and the previous position — then an ``MoELayer``, both pre-norm residual) → norm → head,
trained on a synthetic next-token task (noisy affine sequences) that every rank generates
identically from ``--seed`` and the step, then slices.
"""

import argparse
import gc
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from moe import GroupedExperts, MoELayer, moe_aux_loss  # noqa: E402
from parallel import ParallelDims, check_replicas_agree, init_distributed, sync_gradients  # noqa: E402

VOCAB, DIM, HIDDEN, EXPERTS, TOP_K, SEQ = 64, 32, 48, 8, 2, 16


class Block(nn.Module):
    def __init__(self, dim: int, dispatcher):
        super().__init__()
        self.mix_norm = nn.RMSNorm(dim)
        self.mix = nn.Linear(2 * dim, dim, bias=False)  # [x_t, x_{t-1}] -> D: causal, attention-free
        self.moe_norm = nn.RMSNorm(dim)
        self.moe = MoELayer(dim, HIDDEN, EXPERTS, TOP_K, dispatcher=dispatcher)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        h = self.mix_norm(x_BSD)
        prev = F.pad(h, (0, 0, 1, 0))[:, :-1]  # x_{t-1}, zeros before the first position
        x_BSD = x_BSD + self.mix(torch.cat([h, prev], dim=-1))
        return x_BSD + self.moe(self.moe_norm(x_BSD))


class TinyLM(nn.Module):
    def __init__(self, dispatcher=None, n_blocks: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM, dispatcher) for _ in range(n_blocks))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens_BS)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def global_batch(step: int, batch: int, seed: int) -> torch.Tensor:
    """(batch, SEQ) tokens, the same on every rank: t_{i+1} = (a·t_i + b) mod V, 10% noise."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    a = torch.randint(1, 8, (batch, 1), generator=g)
    b = torch.randint(0, VOCAB, (batch, 1), generator=g)
    tokens = torch.empty(batch, SEQ, dtype=torch.int64)
    tokens[:, 0] = torch.randint(0, VOCAB, (batch,), generator=g)
    for i in range(1, SEQ):
        tokens[:, i] = (a[:, 0] * tokens[:, i - 1] + b[:, 0]) % VOCAB
    noise = torch.rand(batch, SEQ, generator=g) < 0.1
    return torch.where(noise, torch.randint(0, VOCAB, (batch, SEQ), generator=g), tokens)


def full_state(model: nn.Module, dims: ParallelDims | None) -> dict[str, torch.Tensor]:
    """The parameters as one process holds them: each rank's expert shard gathered over its EP group."""
    expert_ids = {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    state = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if dims is not None and dims.ep > 1 and id(p) in expert_ids:
            parts = [torch.empty_like(t) for _ in range(dims.ep)]
            dist.all_gather(parts, t.contiguous(), group=dims.ep_group)
            t = torch.cat(parts)
        state[name] = t.cpu().clone()
    return state


def train_steps(model, optimizer, dims, args, rank: int, world: int, device) -> list[float]:
    """``args.steps`` optimizer steps on this rank's slices of the global batches; the mean loss
    over the world of each. Its graph dies with this frame: the autograd nodes of the dispatches
    hold the process groups, which must go before they are destroyed (see main)."""
    losses = []
    per_rank = args.batch // world
    for step in range(args.steps):
        # 2. this rank's slice of the global batch
        tokens = global_batch(step, args.batch, args.seed)[rank * per_rank:(rank + 1) * per_rank].to(device)
        logits = model(tokens)
        ce = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))
        aux = moe_aux_loss(model).to(ce.device)  # over the global batch already (the dispatcher reduces its inputs)
        loss = ce + aux
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        # 3. dense grads: mean over the world; expert grads: over their EDP group, / world
        if dims is not None:
            sync_gradients(model, dims)
        optimizer.step()
        logged = torch.stack([loss.detach(), ce.detach(), aux.detach()]).float()
        if dims is not None:
            dist.all_reduce(logged, group=dims.world_group)
            logged /= world
        total, ce_mean, aux_mean = logged.tolist()
        losses.append(total)
        if rank == 0:
            print(f"step {step} loss {total:.6f} ce {ce_mean:.6f} aux {aux_mean:.6f}", flush=True)
    return losses


def main(argv=None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: the world size)")
    parser.add_argument("--batch", type=int, default=8, help="global sequences per step")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the losses as JSON here (rank 0)")
    parser.add_argument("--save-state", default=None, help="torch.save the full parameters here after the steps (rank 0)")
    args = parser.parse_args(argv)

    # 1. the same seed on every rank, set after joining: identical dense/router weights everywhere
    rank, world, device = init_distributed(seed=args.seed)
    ep = args.ep or world
    dims = None
    if world > 1:
        dims = ParallelDims(world, ep)
        dims.check_experts(EXPERTS)
        dims.build_mesh(device.type)
    if args.batch % world:
        raise SystemExit(f"--batch={args.batch} must be a multiple of the world size {world}")

    with device:
        model = TinyLM(dims.dispatcher() if dims is not None else None)
    compared = check_replicas_agree(model, dims) if dims is not None else 0
    if rank == 0 and dims is not None:
        local = EXPERTS // ep
        print(f"world {world}, ep {ep}, edp {world // ep}: EP rank r holds experts [{local}r, {local}(r+1)); "
              f"replicas agree after init ({compared} comparisons)", flush=True)
    elif rank == 0:
        print(f"one process: all {EXPERTS} experts, the whole batch", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    losses = train_steps(model, optimizer, dims, args, rank, world, device)

    compared = check_replicas_agree(model, dims) if dims is not None else 0
    state = full_state(model, dims) if args.save_state else None
    if rank == 0:
        if dims is not None:
            print(f"replicas agree after {args.steps} steps ({compared} comparisons)", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"world": world, "ep": ep if dims else 1, "batch": args.batch, "losses": losses}, f)
        if args.save_state:
            torch.save(state, args.save_state)
    if dist.is_initialized():
        # free what holds the process groups (the mesh, the dispatcher) before tearing them down:
        # left to the interpreter's exit, rank 0 aborted there ("terminate called without an
        # active exception") in about 1 run of 5 on a loaded 2-core CPU; 0 of 48 since (the
        # training graph, which holds them too, is gone with train_steps' frame)
        del model, optimizer, dims
        gc.collect()
        dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
