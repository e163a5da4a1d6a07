"""Atomic, resumable, reshardable checkpoints through ``torch.distributed.checkpoint`` (DCP).

One checkpoint, ``<dir>/step_00000100/``: DCP's files (``.metadata`` and one data file per rank)
and ``meta.json`` (rank 0, written last: step, world size, EP size, data-parallel mode, format).
The DCP state holds, under global names and shapes:

- ``model``: every parameter and persistent buffer. Dense tensors as the run holds them (whole,
  or FSDP's shards of the whole). Each expert tensor as the (E, ...) tensor its EP group holds in
  slices: a DTensor over the run's ``(edp, ep)`` mesh, ``Shard(0)`` over ep (EP rank i holds
  experts ``[i·L, (i+1)·L)``) and, over edp, FSDP's ``Shard(1)`` or ``Replicate()``.
- ``optim``: AdamW's per-parameter state, shaped like the parameters. The hyperparameters are
  not saved: they come from the config of the run that resumes, the lr from the schedule.
- ``train``: the step and the schedule position; ``rank<r>``: rank r's RNG states and
  data-stream position.

Resharding: DCP reads every tensor by global offsets, so a checkpoint loads into any world size,
EP size or data-parallel mode (replicate ↔ fsdp) whose model has the same global shapes. RNG
states and data positions are per rank: restored exactly when the world size is unchanged;
otherwise each rank restarts its new shard at rank 0's saved epoch and cursor, so the continued
run is equivalent but not bit-identical.

Atomicity: everything is written into ``step_XXXXXXXX.tmp/``; once every rank has written, rank 0
adds ``meta.json``, renames the directory (one ``os.replace``) and then points ``latest`` at it.
A crash at any point leaves the previous checkpoint or the complete new one: ``*.tmp``
directories are never read, and a directory without ``meta.json`` is never chosen. All ranks
must see one file system (one host, or a shared mount across nodes).

Async (``checkpoint.async_save``): ``dcp.async_save`` copies the state to host memory during the
call and writes the files from a background thread, over a gloo group of its own so that its
collectives never interleave with the training's. The checkpoint becomes visible (meta.json,
rename, ``latest``) at the next save or at :meth:`Checkpointer.finish`, once every rank's write
has completed.
"""

import json
import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard

from train.model import expert_parameter_names

STEP_DIR = re.compile(r"^step_(\d{8})$")
FORMAT = "dcp-1"


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


def _global_expert(t: torch.Tensor, dims) -> torch.Tensor:
    """This rank's (L, ...) expert tensor (or FSDP's shard of it) as a view of the global
    (E, ...) tensor: shares storage, so DCP's load writes straight into it."""
    if isinstance(t, DTensor):  # FSDP over the EDP mesh (parallel.fully_shard_moe: Shard(1))
        local, over_edp = t.to_local(), t.placements[0]
    else:
        local, over_edp = t, Replicate()
    return DTensor.from_local(local, dims.mesh, [over_edp, Shard(0)], run_check=False)


class Checkpointer:
    """Saves and loads the run's checkpoints in ``ckpt_dir``; every method is a collective.

    Args:
        ckpt_dir: where ``step_XXXXXXXX/`` directories and ``latest`` live.
        rt: the run's :class:`~train.runtime.Runtime` (rank, world size, EP size, mesh).
        keep: newest complete checkpoints kept, 0: all.
        async_save: write in the background (see the module docstring).
        data_parallel: recorded in meta.json (``replicate`` | ``fsdp``).
    """

    def __init__(self, ckpt_dir: str, rt, keep: int = 0, async_save: bool = False, data_parallel: str = "replicate"):
        self.ckpt_dir = ckpt_dir
        self.rt = rt
        self.keep = keep
        self.async_save = async_save
        self.data_parallel = data_parallel
        # every rank creates the group (a collective), and only when it is used
        self.group = dist.new_group(backend="gloo") if async_save and rt.distributed else None
        self._pending = None  # (future, tmp dir, final dir, step) of an async save in flight

    def _view(self, state: dict, experts: set[str]) -> dict:
        """``state`` (name → tensor) with expert tensors as global views (one process: as is)."""
        if self.rt.dims is None:
            return dict(state)
        return {n: _global_expert(t, self.rt.dims) if n in experts else t for n, t in state.items()}

    def _state(self, model: nn.Module, optimizer, schedule, data_state: dict, step: int, own: str):
        """The DCP state dict and the two state dicts its tensors are views of."""
        experts = expert_parameter_names(model)
        model_sd = get_model_state_dict(model)
        optim_sd = get_optimizer_state_dict(model, optimizer)
        state = {
            "model": self._view(model_sd, experts),
            # AdamW's moments are shaped like their parameter; its step count is a scalar
            "optim": {n: self._view(s, {k for k, v in s.items() if n in experts and torch.is_tensor(v) and v.dim() > 0})
                      for n, s in optim_sd["state"].items()},
            "train": {"step": step, "schedule": schedule.state_dict()},
            own: {"rng": _rng_state(), "data": data_state},
        }
        return state, model_sd, optim_sd

    def save(self, step: int, model: nn.Module, optimizer, schedule, data_state: dict) -> str:
        """Write the checkpoint of ``step``; returns its final directory (visible at once, or
        when the next save begins or :meth:`finish` runs, if async)."""
        self.finish()
        name = f"step_{step:08d}"
        final = os.path.join(self.ckpt_dir, name)
        if os.path.isdir(final):  # this step is already saved (a resumed run reaching it again)
            return final
        tmp = final + ".tmp"
        if self.rt.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
            os.makedirs(tmp)
        self.rt.barrier()
        state, _, _ = self._state(model, optimizer, schedule, data_state, step, f"rank{self.rt.rank}")
        if self.async_save:
            future = dcp.async_save(state, checkpoint_id=tmp, process_group=self.group)
            self._pending = (future, tmp, final, step)
        else:
            dcp.save(state, checkpoint_id=tmp)
            self._publish(tmp, final, step)
        return final

    def finish(self) -> None:
        """Publish the async save in flight, if any, once every rank's write has completed."""
        if self._pending is None:
            return
        future, tmp, final, step = self._pending
        self._pending = None
        future.result()
        self._publish(tmp, final, step)

    def _publish(self, tmp: str, final: str, step: int) -> None:
        self.rt.barrier()  # every rank's files are written
        if self.rt.rank == 0:
            meta = {"format": FORMAT, "step": step, "world_size": self.rt.world_size, "ep": self.rt.ep,
                    "data_parallel": self.data_parallel}
            with open(os.path.join(tmp, "meta.json"), "w") as f:
                json.dump(meta, f)
            os.replace(tmp, final)
            pointer = os.path.join(self.ckpt_dir, "latest")
            with open(pointer + ".tmp", "w") as f:
                f.write(os.path.basename(final) + "\n")
            os.replace(pointer + ".tmp", pointer)
            if self.keep > 0:
                for old in list_checkpoints(self.ckpt_dir)[:-self.keep]:
                    shutil.rmtree(old, ignore_errors=True)
        self.rt.barrier()

    def load(self, path: str, model: nn.Module, optimizer, schedule) -> dict:
        """Load ``path`` into this rank's model, optimizer and schedule (and RNG, when the world
        size matches). Returns ``{"step", "data", "exact"}``: ``data`` is the data-stream state
        to restore, ``exact`` says the world size matched."""
        meta = read_meta(path)
        exact = meta["world_size"] == self.rt.world_size
        own = f"rank{self.rt.rank if exact else 0}"
        state, model_sd, optim_sd = self._state(model, optimizer, schedule, {"epoch": 0, "cursor": 0}, 0, own)
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, model_sd)  # the views wrote into these tensors
        set_optimizer_state_dict(model, optimizer, optim_sd)
        schedule.load_state_dict(state["train"]["schedule"])
        if exact:
            _set_rng_state(state[own]["rng"])
        return {"step": int(state["train"]["step"]), "data": state[own]["data"], "exact": exact}


def read_meta(path: str) -> dict:
    """A checkpoint's meta.json; one clear error for a checkpoint of the pre-DCP format."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"{path} is a checkpoint of the pre-DCP format (dense.pt + rank*.pt files), which this version does not "
            f"read: finish that run with the version that wrote it (commit c43e526 or earlier), or start afresh "
            f"(checkpoint.resume=none, or another checkpoint.dir)"
        )
    return meta


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
