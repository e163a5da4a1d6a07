"""Training throughput of this tree against another checkout of the project, alternated.

    python bench/train_ab.py --anchor <dir of the other checkout> --config configs/olmoe_bench.yaml \
        --gpus 2 --rounds 3 --steps 30 --out bench/results/<name>.md [--section.key=value ...]

Each round runs the anchor's ``train/train.py`` and then this tree's under ``torchrun`` with the
same config and overrides, and reads ``perf/tokens_per_s`` from each run's metrics.jsonl: the
median of the logged windows after the first (which holds start-up and autotuning). The claim is
the median over rounds of ours / anchor; the A-vs-A row is the anchor's round-to-round ratio, the
noise floor.
"""

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(tree: str, args: argparse.Namespace, extra: list[str], log_dir: str) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.gpus}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=localhost:{_free_port()}", "--nnodes=1", os.path.join(tree, "train", "train.py"),
           "--config", os.path.join(HERE, args.config), f"--train.steps={args.steps}", "--log.every=10",
           "--log.wandb_mode=disabled", "--log.progress=false", f"--log.dir={log_dir}", "--log.run_name=run", *extra]
    env = {**os.environ, "PYTHONPATH": tree}
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode:
        raise RuntimeError(f"{tree}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    with open(os.path.join(log_dir, "run", "metrics.jsonl")) as f:
        windows = [r["perf/tokens_per_s"] for r in map(json.loads, f) if "perf/tokens_per_s" in r]
    return statistics.median(windows[1:] or windows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--anchor", required=True, help="another checkout of the project (the baseline)")
    ap.add_argument("--config", default="configs/olmoe_bench.yaml")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--label", default="this tree", help="what ours is, for the table")
    ap.add_argument("--out", required=True)
    args, extra = ap.parse_known_args()
    anchor, ours = [], []
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
            anchor.append(run(os.path.abspath(args.anchor), args, extra, a))
            ours.append(run(HERE, args, extra, b))
        print(f"round {r}: anchor {anchor[-1]:,.0f} tok/s, ours {ours[-1]:,.0f} tok/s, ratio {ours[-1] / anchor[-1]:.3f}",
              flush=True)
    ratios = [o / a for o, a in zip(ours, anchor)]
    a_vs_a = [x / y for x, y in zip(anchor[1:], anchor[:-1])]
    lines = [
        f"# Training throughput: {args.label} vs the anchor checkout",
        "",
        f"- device: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu'} × {args.gpus}; "
        f"torch {torch.__version__}; date {datetime.date.today()}",
        f"- command: `python bench/train_ab.py --anchor {args.anchor} --config {args.config} --gpus {args.gpus} "
        f"--rounds {args.rounds} --steps {args.steps} {' '.join(extra)}`",
        "- tokens/s: median of the logged 10-step windows after the first, per run; rounds alternate anchor, ours",
        "",
        "| round | anchor tok/s | ours tok/s | ours / anchor |",
        "|---|---|---|---|",
        *[f"| {i} | {a:,.0f} | {o:,.0f} | {o / a:.3f} |" for i, (a, o) in enumerate(zip(anchor, ours))],
        f"| **median** | | | **{statistics.median(ratios):.3f}** |",
        f"| A-vs-A (anchor, round to round) | | | {', '.join(f'{x:.3f}' for x in a_vs_a) or '-'} |",
    ]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
