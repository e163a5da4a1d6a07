"""Routing health under training: which remedy keeps the expert load balanced from the start?

Each variant is one training run of the OLMoE-shaped benchmark model at reduced depth, on one
GPU (EP 1, 8,192 tokens a step, BPE data, the default coefficients: aux 0.01, z 0.001), run in
its own process. ``shipped`` is configs/olmoe_bench.yaml as it is: since 2026-11-24's fifth
session with the embedding at std 1.0, ``model.lm_head_bias``, ``moe.router_centre: causal`` and
``moe.expert_bias``. Every other variant starts from the config without those four
(:data:`PLAIN`, the config before), ``base`` being that plain config. The table lists each logged
step's worst layer's load max/mean (8.0 = every token sends a slot to the same expert, the most
top-8 of 64 allows) and the step from which it stays ≤ 2.0. Variants built from the library's
options set them; the others are patches of this process, to decide whether one is worth
building:

- ``centre``: router logits centred per expert over the step's tokens (forward and backward).
  The route of a token then depends on the other tokens of its batch.
- ``grad_centre``: the forward untouched; the gradient that reaches the logits through the
  combine weights (the LM's) is centred per expert over the step's tokens, so the LM cannot
  raise or lower an expert's mean logit; the aux and z-losses keep their whole gradient.
- ``router_lr_0.1`` / ``router_lr_0``: the router weights in their own AdamW group at a tenth of
  the rate / frozen at their initialisation (a diagnosis: does the load drift because the router
  learns, or because its input changes?).
- ``lm_bias``: ``model.lm_head_bias`` (the LM head's bias, set to the training split's centred
  log unigram frequencies), so the residual stream need not carry the unigram distribution as a
  component common to every token. The rows dated before the fifth session ran it as a patch
  (counts of the rank's shard + 0.1, the bias as an extra input coordinate of 1).
- ``embed_x10`` / ``embed_x50``: ``model.embed_init_std`` at 10 or 50 × ``init_std`` (0.2, 1.0);
  before the fifth session, a patch scaling the initialised embedding.
- ``project``: the router's input with its component along the running mean of that input
  (an exponential average over forwards, momentum 0.9, no gradient) removed: ``centre`` made
  independent of the batch (a token's route depends only on the weights and that one vector)
  and exportable (the projection folds into the router weight: ``W (I − u uᵀ)``).
- ``causal_centre``: ``moe.router_centre: causal``, the router's input minus the mean of the
  same sequence's inputs at the positions before it (position 0 unchanged; built on the logits,
  which are linear in it): a token's route depends on its own prefix only, so it is causal and
  batch-independent, and it removes the per-sequence common component that the causal attention's
  near-uniform averages put into the stream (at initialisation, D 256 on CPU, it took the worst
  layer's load from 7.7 to 2.2; a batch-wide mean (``project``) only to 3.5). Before the fifth
  session's last runs, a patch of the router's input.
- ``diagnose``: the base run, printing every 5th training forward, per router, the load
  max/mean of its input as is, minus the batch's mean, minus each sequence's mean, minus each
  position's causal prefix mean, of the input through the router's initial weights, and the
  shares of the input's mean square in the batch mean and the sequences' means; and per block
  the RMS of the stream and of the attention's and the FFN's outputs, each with the RMS of its
  mean over the batch (stderr; a run without activation checkpointing).
- ``expert_bias*``: the library's rule (``moe.expert_bias``). Since 2026-11-24 it adds the bias
  to a softmax router's logits (a token picks by ``p_e · exp(b_e)``, whatever E) at a default
  rate of 3e-2; the tables' ``expert_bias*`` rows dated before ran it on the probabilities (at
  1e-3 unless named), and their ``logit_bias_*`` rows ran today's rule through a patch.

    python bench/routing_health.py --steps 300 [--layers 6] [--variants base,expert_bias,...] [--seeds 0,1,2]
        [--section.key=value ...]   (config overrides for every run, after the variant's)
"""

import argparse
import dataclasses
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.append(os.path.dirname(os.path.abspath(__file__)))

# configs/olmoe_bench.yaml without its routing-health options: the model every variant but
# "shipped" starts from (the benchmark's config before 2026-11-24's fifth session)
PLAIN = ["--model.embed_init_std=0.02", "--model.lm_head_bias=false", "--moe.router_centre=none",
         "--moe.expert_bias=false"]
# the library's options that variants combine
LM_BIAS, CAUSAL, BIAS = "--model.lm_head_bias=true", "--moe.router_centre=causal", "--moe.expert_bias=true"
EMBED_1, EMBED_02 = "--model.embed_init_std=1.0", "--model.embed_init_std=0.2"
# name: (config overrides after PLAIN, router patches); "shipped": the config as it is
VARIANTS = {
    "shipped": ([], []),
    "base": ([], []),
    "expert_bias": ([BIAS], []),
    "router_lr_0.1": ([], ["router_lr_0.1"]),
    "router_lr_0": ([], ["router_lr_0"]),
    "warmup_100": (["--optim.warmup_steps=100"], []),
    "centre": ([], ["centre"]),
    "centre+expert_bias": ([BIAS], ["centre"]),
    "grad_centre": ([], ["grad_centre"]),
    "grad_centre+expert_bias": ([BIAS], ["grad_centre"]),
    "lm_bias": ([LM_BIAS], []),
    "embed_x10": ([EMBED_02], []),
    "embed_x10+lm_bias": ([EMBED_02, LM_BIAS], []),
    "embed_x50+lm_bias": ([EMBED_1, LM_BIAS], []),
    "embed_x50": ([EMBED_1], []),
    "embed_x50+lm_bias+expert_bias": ([BIAS, EMBED_1, LM_BIAS], []),
    "embed_x50+lm_bias+expert_bias_1e-2": ([BIAS, "--moe.bias_update_rate=1e-2", EMBED_1, LM_BIAS], []),
    "expert_bias_1e-2": ([BIAS, "--moe.bias_update_rate=1e-2"], []),
    "no_renormalize": (["--moe.renormalize=false"], []),
    "project": ([], ["project"]),
    "causal_centre": ([CAUSAL], []),
    "causal_centre+expert_bias": ([CAUSAL, BIAS], []),
    "project+expert_bias": ([BIAS], ["project"]),
    "lr_1e-4": (["--optim.lr=1e-4"], []),
    "diagnose": ([], ["diagnose"]),
    "diagnose+router_lr_0": ([], ["diagnose", "router_lr_0"]),
    "diagnose+embed_x50": ([EMBED_1], ["diagnose"]),
    "diagnose+embed_x50+lm_bias": ([EMBED_1, LM_BIAS], ["diagnose"]),
    "diagnose+lm_bias": ([LM_BIAS], ["diagnose"]),
    "diagnose+embed_x50+causal_centre": ([EMBED_1, CAUSAL], ["diagnose"]),
    "embed_x50+causal_centre": ([EMBED_1, CAUSAL], []),
    "embed_x50+causal_centre+expert_bias": ([EMBED_1, CAUSAL, BIAS], []),
    "embed_x50+lm_bias+causal_centre": ([EMBED_1, LM_BIAS, CAUSAL], []),
    "embed_x50+lm_bias+causal_centre+expert_bias": ([EMBED_1, LM_BIAS, CAUSAL, BIAS], []),
}


def _patch(names: list[str]) -> None:
    """Apply the router patches of one variant to this process."""
    import torch

    import moe.router as mr
    import train.trainer as tt

    class CentreGrad(torch.autograd.Function):
        """Identity forward; the (T, E) gradient minus its mean over the tokens."""

        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return g - g.mean(0, keepdim=True)

    plain_logits, plain_forward, plain_build = mr.router_logits, mr.Router.forward, tt.build_optimizer
    if "centre" in names:
        def centred_logits(x, w, backend="auto"):
            logits_TE = plain_logits(x, w, backend)
            return logits_TE - logits_TE.mean(0, keepdim=True)
        mr.router_logits = centred_logits
    if "grad_centre" in names:
        def forward(self, x_TD, seq_len=None):
            out = plain_forward(self, x_TD, seq_len)
            lm_TE = CentreGrad.apply(out.logits_TE).softmax(dim=-1)
            priority_TK = lm_TE.gather(1, out.experts_TK)
            weights_TK = priority_TK / priority_TK.sum(dim=-1, keepdim=True).clamp_min(1e-20)
            return dataclasses.replace(out, priority_TK=priority_TK, weights_TK=weights_TK)
        mr.Router.forward = forward
    if "project" in names:
        def forward(self, x_TD, seq_len=None):
            with torch.no_grad():
                mean_D = x_TD.float().mean(0)
                if getattr(self, "running_mean_D", None) is None:
                    self.running_mean_D = mean_D
                elif torch.is_grad_enabled():  # training forwards move it; validation reads it
                    self.running_mean_D = 0.9 * self.running_mean_D + 0.1 * mean_D
                u_D = self.running_mean_D / self.running_mean_D.norm().clamp_min(1e-12)
            along_T1 = (x_TD.float() @ u_D)[:, None]
            return plain_forward(self, x_TD - (along_T1 * u_D).to(x_TD.dtype), seq_len)
        mr.Router.forward = forward
    if "diagnose" in names:
        routers = []

        def sampled(module) -> bool:
            """Count the module's training forwards (not validation, which runs without grad; not a
            recompute in the backward) and say whether this one is a 1st, 6th, 11th, ..."""
            if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
                return False
            module.forwards = getattr(module, "forwards", 0) + 1
            return module.forwards % 5 == 1

        def imbalance(logits_TE, k):
            load_E = torch.bincount(logits_TE.topk(k, dim=-1).indices.flatten(), minlength=logits_TE.shape[1])
            return float(load_E.max() / load_E.float().mean())

        @torch.no_grad()
        def diagnose(self, x_TD, seq_len):
            """One line: the load max/mean the router's weights give its input as is, minus the
            batch mean, minus each sequence's mean, minus each position's causal prefix mean; the
            input through the router's *initial* weights; the shares of the input's mean square in
            the batch mean and in the per-sequence means."""
            x_BSD = x_TD.float().view(-1, seq_len, x_TD.shape[-1])
            glob_D = x_BSD.mean((0, 1))
            seq_B1D = x_BSD.mean(1, keepdim=True)
            ms = x_BSD.square().mean()
            # the router's own centring (moe.router.causal_centre) works on any last dim: here D
            centred_BSD = mr.causal_centre(x_TD.float(), seq_len).view_as(x_BSD)
            cells = [imbalance(v.flatten(0, 1) @ self.weight.T, self.top_k)
                     for v in (x_BSD, x_BSD - glob_D, x_BSD - seq_B1D, centred_BSD)]
            cells.append(imbalance(x_BSD.flatten(0, 1) @ self.init_weight.T, self.top_k))
            cells += [float(glob_D.square().mean() / ms), float(seq_B1D.square().mean() / ms)]
            print(f"diagnose forward {self.forwards} router {routers.index(self)} | " + " ".join(f"{c:.2f}" for c in cells),
                  file=sys.stderr, flush=True)

        plain_diag_forward = mr.Router.forward
        import train.model as tm

        def block_forward(self, x_BSD):
            """The block's forward, printing every 5th training forward the RMS of the stream
            coming in, of the attention's and the FFN's outputs and of the stream going out, each
            with the RMS of its mean over the batch's tokens (the part common to every token)."""
            attn_BSD = self._attention(x_BSD)
            ffn_BSD = self.ffn(self.ffn_norm(x_BSD + attn_BSD))
            out_BSD = x_BSD + attn_BSD + ffn_BSD
            if sampled(self):
                with torch.no_grad():
                    cells = []
                    for v in (x_BSD, attn_BSD, ffn_BSD, out_BSD):
                        v_TD = v.float().flatten(0, 1)
                        cells.append(f"{v_TD.square().mean().sqrt():.3f}/{v_TD.mean(0).square().mean().sqrt():.3f}")
                print(f"stream forward {self.forwards} block {self.layer_idx} | in attn ffn out (rms/mean rms) | "
                      + " ".join(cells), file=sys.stderr, flush=True)
            return out_BSD
        tm.Block._forward = block_forward

        def forward(self, x_TD, seq_len=None):
            if self not in routers:  # the first forward is validation's, before any update
                routers.append(self)
                self.init_weight = self.weight.detach().float().clone()
            if sampled(self):
                diagnose(self, x_TD, seq_len)
            return plain_diag_forward(self, x_TD, seq_len)
        mr.Router.forward = forward
    router_lr = [float(n[len("router_lr_"):]) for n in names if n.startswith("router_lr_")]
    if router_lr:
        def build(model, cfg):
            opt = plain_build(model, cfg)
            router = {id(p) for n, p in model.named_parameters() if n.endswith("router.weight")}
            groups = []
            for g in opt.param_groups:
                for params, mult in (([p for p in g["params"] if id(p) not in router], 1.0),
                                     ([p for p in g["params"] if id(p) in router], router_lr[0])):
                    if params:
                        groups.append({**g, "params": params, "base_lr": g["base_lr"] * mult, "lr": g["lr"] * mult})
            return torch.optim.AdamW(groups, betas=opt.defaults["betas"], eps=opt.defaults["eps"], fused=True)
        tt.build_optimizer = build


def _summary(path: str) -> tuple[list[tuple[int, float, list[float]]], dict]:
    """Per logged step (step, train loss, every layer's load max/mean), and the run's last
    value of each key (the final validation loss among them)."""
    from train.plots import read_metrics

    rows, last = [], {}
    for r in read_metrics(path):
        keys = sorted((k for k in r if k.startswith("moe/layer") and k.endswith("/load_imbalance")),
                      key=lambda k: int(k.split("/")[1][5:]))
        if keys:
            rows.append((r["step"], r.get("train/loss", float("nan")), [r[k] for k in keys]))
        last.update(r)
    return rows, last


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--seeds", default="0", help="comma-separated train.seed values: one run per variant and seed")
    p.add_argument("--out", default=os.path.join(ROOT, "bench/results/routing_health.md"))
    p.add_argument("--log-dir", default="/tmp/routing_health")
    p.add_argument("--run", help=argparse.SUPPRESS)  # a child: one variant's training run
    args, train_args = p.parse_known_args()
    if args.run:
        _patch(VARIANTS[args.run][1])
        from train.train import cli
        cli(train_args)
        return
    names = args.variants.split(",")
    common = ["--config", os.path.join(ROOT, "configs/olmoe_bench.yaml"), "--parallel.ep=1",
              f"--model.n_layers={args.layers}", f"--train.steps={args.steps}", "--log.every=10",
              "--log.heatmap_every=0", "--log.wandb_mode=disabled", f"--log.dir={args.log_dir}", "--log.overwrite=true"]
    from common import header, write_results
    md = header("Routing health: load max/mean of the worst layer while training", "bench/routing_health.py",
                f"model: configs/olmoe_bench.yaml at {args.layers} layers, EP 1 (one GPU), "
                + (f"with {' '.join(train_args)}, " if train_args else "8,192 tokens a step, ") +
                f"warmup 10 steps, aux 0.01, z 0.001, seeds {args.seeds}; the variants are described in the script's "
                "docstring",
                "a cell: the worst layer's load max/mean at that step (every layer's, in the last column); "
                "'worst after step 10': the highest of the logged steps after the warm-up (every 10 steps); "
                "'≤ 2.0 from': the first logged step after which every logged step stays ≤ 2.0")
    marks = list(range(30, args.steps + 1, 30))
    md += ["| variant | " + " | ".join(f"step {s}" for s in marks)
           + " | worst after step 10 | ≤ 2.0 from | loss / val at end | layers at end |",
           "|---" * (len(marks) + 5) + "|"]
    seeds = [int(x) for x in args.seeds.split(",")]
    for name, seed in ((n, sd) for n in names for sd in seeds):
        label = name if seeds == [0] else f"{name}, seed {seed}"
        # '+' is not a character the device tool brings back in a file name
        run_name = (name if seeds == [0] else f"{name}_seed{seed}").replace("+", "_")
        cmd = [sys.executable, os.path.abspath(__file__), "--run", name, *common, f"--train.seed={seed}",
               f"--log.run_name={run_name}", *([] if name.startswith("shipped") else PLAIN), *VARIANTS[name][0],
               *train_args]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        with open(os.path.join(args.log_dir, f"{run_name}.stderr"), "w") as f:
            f.write(proc.stderr)
        if proc.returncode:
            print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
            md.append(f"| {label} | failed (exit {proc.returncode}) |")
            continue
        rows, last = _summary(os.path.join(args.log_dir, run_name, "metrics.jsonl"))
        worst = {s: max(imb) for s, _, imb in rows}
        healthy = next((s for s, _, _ in rows if all(worst[t] <= 2.0 for t in worst if t >= s)), None)
        after_warmup = max((v for s, v in worst.items() if s > 10), default=float("nan"))
        md.append(f"| {label} | " + " | ".join(f"{worst[s]:.1f}" if s in worst else "" for s in marks)
                  + f" | {after_warmup:.2f} | {healthy if healthy is not None else 'never'} | {rows[-1][1]:.2f} / {last.get('val/loss', float('nan')):.2f} | "
                  + " ".join(f"{v:.1f}" for v in rows[-1][2]) + " |")
        print(md[-1], flush=True)
    write_results(args.out, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
