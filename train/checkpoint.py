"""Atomic, resumable, expert-sharded checkpoints.

Layout of one checkpoint, ``<dir>/step_00000100/``:

- ``dense.pt`` (rank 0): non-expert parameters and buffers, their AdamW state (by parameter
  name), the schedule, the step.
- ``rank00003.pt`` (every rank): this rank's experts with their global index range, their AdamW
  state, the rank's RNG states and data-stream position.
- ``meta.json`` (rank 0, written last): step, world size, EP size, experts per layer.

Atomicity: everything is written into ``step_XXXXXXXX.tmp/``; after a barrier rank 0 renames it to
``step_XXXXXXXX/`` (one ``os.replace``) and then points ``latest`` at it (a temporary file and
``os.replace``). A crash at any point leaves either the previous checkpoint or the complete new
one to be found: ``*.tmp`` directories are never read, and a directory without ``meta.json`` is
never chosen. All ranks must see one file system (one host, or a shared mount across nodes).

Changing the EP size (and the world size) on resume is supported for the model and optimizer:
every rank reads the shards of EP group 0 (ranks ``0..ep_old-1`` together hold every expert),
concatenates each expert tensor along the expert dimension to the global ``(E, ...)`` tensor
(``torch.load(mmap=True)``, so only the slices used are read) and takes its new slice; AdamW's
moments are resliced the same way. RNG states and data positions are per rank: they are restored
exactly when the world size is unchanged; otherwise each rank restarts its new shard at rank 0's
saved epoch and cursor, so the continued run is equivalent but not bit-identical.
"""

import json
import os
import random
import re
import shutil

import numpy as np
import torch
import torch.nn as nn

from train.model import expert_ranges

STEP_DIR = re.compile(r"^step_(\d{8})$")


def _rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _optim_state_by_name(model: nn.Module, optimizer: torch.optim.Optimizer, names: set[str]) -> dict:
    out = {}
    for name, p in model.named_parameters():
        if name in names and p in optimizer.state:
            out[name] = {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
    return out


def _set_optim_state(optimizer: torch.optim.Optimizer, p: torch.Tensor, state: dict) -> None:
    # the moments live with the parameter; AdamW keeps `step` on the CPU unless fused/capturable
    step_on_device = bool(optimizer.defaults.get("fused") or optimizer.defaults.get("capturable"))
    optimizer.state[p] = {
        k: v.to(p.device if (k != "step" or step_on_device) else "cpu") if torch.is_tensor(v) else v
        for k, v in state.items()
    }


def save_checkpoint(ckpt_dir: str, step: int, model: nn.Module, optimizer, schedule, data_state: dict, dist, keep: int = 0) -> str:
    """Collective: every rank calls it. Returns the final directory."""
    name = f"step_{step:08d}"
    final = os.path.join(ckpt_dir, name)
    tmp = final + ".tmp"
    if os.path.isdir(final):  # this step is already saved (a resumed run reaching it again)
        return final
    if dist.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
        os.makedirs(tmp)
    dist.barrier()

    ranges = expert_ranges(model)
    state = model.state_dict()
    experts = {n: state[n].detach().cpu() for n in ranges}
    torch.save(
        {
            "experts": experts,
            "expert_range": ranges,
            "optim": _optim_state_by_name(model, optimizer, set(ranges)),
            "rng": _rng_state(),
            "data": data_state,
            "rank": dist.rank,
        },
        os.path.join(tmp, f"rank{dist.rank:05d}.pt"),
    )
    if dist.rank == 0:
        dense_names = {n for n, _ in model.named_parameters()} - set(ranges)
        torch.save(
            {
                "model": {n: t.detach().cpu() for n, t in state.items() if n not in ranges},
                "optim": _optim_state_by_name(model, optimizer, dense_names),
                "schedule": schedule.state_dict(),
                "step": step,
            },
            os.path.join(tmp, "dense.pt"),
        )
    dist.barrier()
    if dist.rank == 0:
        meta = {"step": step, "world_size": dist.world_size, "ep": dist.ep}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f)
        os.replace(tmp, final)
        pointer = os.path.join(ckpt_dir, "latest")
        with open(pointer + ".tmp", "w") as f:
            f.write(name + "\n")
        os.replace(pointer + ".tmp", pointer)
        if keep > 0:
            for old in sorted(list_checkpoints(ckpt_dir))[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def list_checkpoints(ckpt_dir: str) -> list[str]:
    """Complete checkpoint directories (with meta.json), oldest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    found = [d for d in os.listdir(ckpt_dir) if STEP_DIR.match(d) and os.path.isfile(os.path.join(ckpt_dir, d, "meta.json"))]
    return [os.path.join(ckpt_dir, d) for d in sorted(found)]


def find_checkpoint(ckpt_dir: str, resume: str) -> str | None:
    """``resume``: ``none``, ``auto`` (``latest``, else the newest complete one) or a directory."""
    if resume == "none":
        return None
    if resume != "auto":
        if not os.path.isfile(os.path.join(resume, "meta.json")):
            raise FileNotFoundError(f"checkpoint.resume={resume!r} is not a complete checkpoint (no meta.json)")
        return resume
    pointer = os.path.join(ckpt_dir, "latest")
    if os.path.isfile(pointer):
        with open(pointer) as f:
            path = os.path.join(ckpt_dir, f.read().strip())
        if os.path.isfile(os.path.join(path, "meta.json")):
            return path
    found = list_checkpoints(ckpt_dir)
    return found[-1] if found else None


# Parameters renamed since checkpoints were first written: old name suffix -> new. A checkpoint
# saved under an old name loads under the new one (its tensors are the same).
RENAMED_PARAMETERS = {".experts.w1_LDH": ".experts.w1_LDU"}


def _current_name(name: str) -> str:
    for old, new in RENAMED_PARAMETERS.items():
        if name.endswith(old):
            return name[:-len(old)] + new
    return name


def _load(path: str) -> dict:
    """One checkpoint file, its parameter-keyed sections under today's parameter names."""
    saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    for section in ("model", "optim", "experts", "expert_range"):
        if isinstance(saved.get(section), dict):
            saved[section] = {_current_name(name): v for name, v in saved[section].items()}
    return saved


def _gather_expert_slice(shards: list[dict], key: str, name: str, first: int, count: int, sub: str | None = None) -> torch.Tensor:
    """Rows ``[first, first + count)`` of the global expert tensor spread over ``shards``."""
    pieces = []
    for shard in shards:
        lo, n, _ = shard["expert_range"][name]
        a, b = max(first, lo), min(first + count, lo + n)
        if a < b:
            t = shard[key][name] if sub is None else shard[key][name][sub]
            pieces.append(t[a - lo:b - lo])
    out = torch.cat(pieces)
    if out.shape[0] != count:
        raise ValueError(f"checkpoint shards hold {out.shape[0]} of experts [{first}, {first + count}) of {name}")
    return out


def load_checkpoint(path: str, model: nn.Module, optimizer, schedule, dist) -> dict:
    """Load into this rank's model/optimizer/schedule. Returns ``{"step", "data", "exact"}``
    where ``data`` is the data-stream state to restore and ``exact`` says the world matched."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    dense = _load(os.path.join(path, "dense.pt"))
    ranges = expert_ranges(model)
    same_layout = meta["world_size"] == dist.world_size and meta["ep"] == dist.ep
    if same_layout:
        shards = [_load(os.path.join(path, f"rank{dist.rank:05d}.pt"))]
    else:
        shards = [_load(os.path.join(path, f"rank{r:05d}.pt")) for r in range(meta["ep"])]

    state = dict(dense["model"])
    for name, (first, count, total) in ranges.items():
        saved_total = shards[0]["expert_range"][name][2]
        if saved_total != total:
            raise ValueError(f"{name}: checkpoint has {saved_total} experts, the model {total}")
        state[name] = _gather_expert_slice(shards, "experts", name, first, count)
    model.load_state_dict(state, strict=True)

    params = dict(model.named_parameters())
    for name, s in dense["optim"].items():
        _set_optim_state(optimizer, params[name], s)
    for name, (first, count, _) in ranges.items():
        if name not in shards[0]["optim"]:
            continue
        s = dict(shards[0]["optim"][name])
        for k, v in s.items():
            if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == shards[0]["expert_range"][name][1]:
                s[k] = _gather_expert_slice(shards, "optim", name, first, count, sub=k)
        _set_optim_state(optimizer, params[name], s)
    schedule.load_state_dict(dense["schedule"])

    exact = meta["world_size"] == dist.world_size
    if same_layout or not exact:
        own = shards[0]  # this rank's file, or (world changed) rank 0's data position
    else:
        own = _load(os.path.join(path, f"rank{dist.rank:05d}.pt"))
    if exact:
        _set_rng_state(own["rng"])
    return {"step": int(dense["step"]), "data": own["data"], "exact": exact}
