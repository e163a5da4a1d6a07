"""Load a real-shaped Hugging Face MoE checkpoint with ``train.init_from``'s loader: time and logits.

Run (one process per GPU; EP = the number of processes)::

    python bench/hf_load.py                                   # 1 GPU, EP 1
    torchrun --standalone --nproc_per_node=2 bench/hf_load.py # 2 GPUs, EP 2

Rank 0 builds a Qwen3-MoE-shaped model with ``transformers`` (random weights, the real widths of
Qwen3-30B-A3B: D 2048, 128 experts of F 768, top-8, 32 query / 4 key-value heads of 128, q/k
RMSNorm, vocabulary 151,936; depth reduced to ``--layers``) and saves it in bf16 safetensors
shards (2 GB each), as a hub checkpoint is. Then every rank builds our model for EP = world size
and loads the directory (timed; each rank reads only its experts), and rank 0 times the anchor,
``AutoModelForCausalLM.from_pretrained`` of the same directory onto the GPU.

Logits check, on 2 × 256 random tokens: ours (bf16 autocast, as training runs) against
transformers in fp32 (the fp32 weights of the bf16 files), beside transformers' own bf16 forward
against the same fp32 reference, as max-abs and mean-abs differences and top-1 agreement; ours
must be as close as transformers' own bf16 run is (within 2× its mean error). Writes
``bench/results/hf_load.md``.
"""

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel import ParallelDims, init_distributed  # noqa: E402
from train.config import load_config  # noqa: E402
from train.hf import load_weights  # noqa: E402
from train.model import MoETransformer  # noqa: E402


def build_checkpoint(directory: str, layers: int) -> None:
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():  # norm gains away from 1, so a misplaced one shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory, max_shard_size="2GB")


def compare(a: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    d = (a.float() - ref).abs()
    return d.max().item(), d.mean().item(), (a.argmax(-1) == ref.argmax(-1)).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dir", default="/tmp/qwen3_moe_shaped")
    parser.add_argument("--out", default="bench/results/hf_load.md")
    args = parser.parse_args()
    rank, world, device = init_distributed(seed=0)
    if rank == 0 and not os.path.exists(os.path.join(args.dir, "config.json")):
        t0 = time.perf_counter()
        build_checkpoint(args.dir, args.layers)
        print(f"built {args.dir} in {time.perf_counter() - t0:.1f} s", flush=True)
    if world > 1:
        dist.barrier()
    cfg = load_config([f"--train.init_from={args.dir}", f"--parallel.ep={world}", "--data.seq_len=256"], world_size=world)
    dims = ParallelDims(world, ep=world).build_mesh("cuda") if world > 1 else None
    with device:
        model = MoETransformer(cfg, dispatcher=dims.dispatcher() if dims else None)
    model.init_weights(1)
    torch.cuda.synchronize()
    ours_s = load_weights(model, args.dir, cfg)
    torch.cuda.synchronize()
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 256), generator=g).to(device)
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        ours = model(tokens)
    loads = [ours_s]
    if world > 1:
        loads = [None] * world
        dist.all_gather_object(loads, ours_s)
    if rank == 0:
        import transformers

        del model
        torch.cuda.empty_cache()
        t0 = time.perf_counter()
        ref = transformers.AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.float32).to(device).eval()
        torch.cuda.synchronize()
        hf_s = time.perf_counter() - t0
        with torch.no_grad():
            want = ref(tokens).logits.float()
            ref.to(torch.bfloat16)
            hf_bf16 = ref(tokens).logits
        o, h = compare(ours, want), compare(hf_bf16, want)
        files = sorted(f for f in os.listdir(args.dir) if f.endswith(".safetensors"))
        size = sum(os.path.getsize(os.path.join(args.dir, f)) for f in files) / 2**30
        ok = o[1] <= 2 * h[1]
        lines = [
            "# Loading a Hugging Face MoE checkpoint (train.init_from)", "",
            f"{torch.cuda.get_device_name()} × {world}, EP {world}; torch {torch.__version__}, transformers "
            f"{transformers.__version__}; {datetime.date.today()}",
            f"Command: `{'torchrun --standalone --nproc_per_node=' + str(world) if world > 1 else 'python'} bench/hf_load.py "
            f"--layers {args.layers}`", "",
            f"Model: Qwen3-MoE-shaped (Qwen3-30B-A3B widths: D 2048, 128 experts × F 768, top-8, 32/4 heads of 128, q/k "
            f"norm, V 151,936), {args.layers} layers, random weights; {len(files)} bf16 safetensors files, {size:.2f} GiB.", "",
            "| load | seconds |", "|---|---|",
            *(f"| ours, rank {r} (its {128 // world} experts per layer) | {s:.2f} |" for r, s in enumerate(loads)),
            f"| transformers `from_pretrained` (fp32) + `.to(cuda)`, rank 0 | {hf_s:.2f} |", "",
            "Logits on 2 × 256 random tokens against transformers in fp32:", "",
            "| forward | max abs diff | mean abs diff | top-1 agreement |", "|---|---|---|---|",
            f"| ours, bf16 autocast | {o[0]:.4f} | {o[1]:.5f} | {o[2]:.4f} |",
            f"| transformers, bf16 | {h[0]:.4f} | {h[1]:.5f} | {h[2]:.4f} |", "",
            f"Check (ours' mean error <= 2× transformers' own bf16 mean error): {'PASS' if ok else 'FAIL'}",
        ]
        text = "\n".join(lines) + "\n"
        print(text)
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
