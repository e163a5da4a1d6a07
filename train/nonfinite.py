"""Non-finite steps: never applied, counted on the device, traced to a layer when they stop the run.

A step is *bad* when its loss (mean over the ranks) or its global gradient norm is not finite.
Both are already global tensors on the device, so every rank reaches the same verdict with no
extra collective, and :meth:`NonFiniteGuard.update` turns it into the ``found_inf`` flag that the
fused AdamW kernel reads: a flagged step leaves the parameters, the moments and the step count
as they were, with no host sync (the GradScaler mechanism of ``torch.optim``; checked on CPU and
under FSDP's DTensors). Other state a step changes (the routers' selection biases) is restored
through :meth:`NonFiniteGuard.guarded`.

``train.on_nonfinite``:

- ``stop``: the flag is sticky, so from the first bad step on nothing changes the model; the
  host reads the counters where it syncs anyway (logging steps, before a checkpoint, at the
  end) and the run stops there with an error naming the step and the first non-finite layer
  (:func:`first_nonfinite`, a replay of that step's batch). The parameters are those after the
  last good step, and no checkpoint is written after a bad one.
- ``skip``: each bad step's update is dropped (its batch and schedule position are consumed, as
  in Megatron-LM's skipped iterations), ``train/skipped_steps`` counts them, and the run stops once
  more than ``train.max_skipped_steps`` were skipped.
"""

import contextlib
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel import flight


class NonFiniteGuard:
    """The device-side bookkeeping of bad steps for one optimizer (which must be fused)."""

    def __init__(self, optimizer: torch.optim.Optimizer, policy: str, device: torch.device):
        if not all(g.get("fused") for g in optimizer.param_groups):
            raise ValueError("NonFiniteGuard needs a fused optimizer: only the fused kernels read found_inf")
        self.policy = policy
        self.skip = torch.zeros((), dtype=torch.float32, device=device)  # 1.0: this step changes nothing
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)
        # the first and the latest bad step, -1 while there is none
        self.bad_steps = torch.full((2,), -1, dtype=torch.int64, device=device)
        optimizer.found_inf = self.skip

    def update(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Judge ``step`` (1-based) from its global loss and gradient norm, before the optimizer
        step; device ops only."""
        bad = ~(torch.isfinite(loss).all() & torch.isfinite(grad_norm))
        if self.policy == "stop":
            self.skip.copy_(torch.maximum(self.skip, bad.float()))
        else:
            self.skip.copy_(bad.float())
        self.skipped += bad
        first, latest = self.bad_steps.unbind()
        self.bad_steps.copy_(torch.stack([torch.where(bad & (first < 0), step, first), torch.where(bad, step, latest)]))

    @contextlib.contextmanager
    def guarded(self, tensors: Iterable[torch.Tensor]):
        """Changes made to ``tensors`` inside the block are undone when the step is skipped."""
        tensors = list(tensors)
        saved = [t.detach().clone() for t in tensors]
        yield
        with torch.no_grad():
            for t, s in zip(tensors, saved):
                t.copy_(torch.where(self.skip > 0, s, t))

    def read(self) -> tuple[int, int, int]:
        """``(skipped steps, first bad step, latest bad step)``, -1 for none: one host sync."""
        skipped, first, latest = torch.cat([self.skipped.view(1), self.bad_steps]).tolist()
        return skipped, first, latest


def _floating(value) -> list[torch.Tensor]:
    """The floating-point tensors in a module's output (a tensor, a tuple, a dataclass...)."""
    leaves = torch.utils._pytree.tree_leaves(value)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _nonfinite(tensors: list[torch.Tensor]) -> bool:
    return any(not bool(torch.isfinite(t.detach()).all()) for t in tensors)


def first_nonfinite(model: nn.Module, run: Callable[[], torch.Tensor], group=None) -> str:
    """Where a step's values first went non-finite, found by running it again with hooks.

    ``run()`` repeats the step's forward passes and returns its loss (every rank calls this
    together: the replay makes the step's collectives). Forward hooks check every submodule's
    output in the order the submodules finish; hooks on those outputs check the gradients in the
    order the backward reaches them; then the parameters' gradients. The model's own output is not
    hooked: it is the loss (``model(tokens, targets)``: the LM head and the cross-entropy in one
    function) or the logits it is computed from, so a non-finite one after finite submodules is
    named as the loss. The earliest finding over the ranks (forward before backward) is returned
    as one phrase, e.g. ``"the output of blocks.1.ffn.router (forward, rank 1)"``. Costs one
    forward and backward with a host sync per module: only run once a step has gone bad.
    """
    found: dict[int, str] = {}  # phase (0 forward, 1 backward, 2 parameter gradients) -> the first finding

    def on_grad(name: str):
        def hook(grad: torch.Tensor) -> None:
            if 1 not in found and _nonfinite([grad]):
                found[1] = f"the gradient of {name}'s output (backward)"
        return hook

    def on_forward(name: str):
        def hook(module, args, output) -> None:
            outs = _floating(output)
            if 0 not in found and _nonfinite(outs):
                found[0] = f"the output of {name} (forward)"
            for t in outs:
                if t.requires_grad:
                    t.register_hook(on_grad(name))
        return hook

    handles = [m.register_forward_hook(on_forward(n)) for n, m in model.named_modules() if m is not model]
    try:
        loss = run()
        if not found and not bool(torch.isfinite(loss.detach()).all()):
            found[0] = "the loss, with every layer's output finite (forward)"
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    for name, p in model.named_parameters():
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        if grad is not None and _nonfinite([grad]):
            found.setdefault(2, f"the gradient of parameter {name}")
            break
    model.zero_grad(set_to_none=True)
    phase = min(found, default=3)
    mine = (phase, found.get(phase, ""), dist.get_rank(group) if dist.is_initialized() else 0)
    everyone = [mine]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size(group)
        flight.record("all_gather of the non-finite findings", group)
        dist.all_gather_object(everyone, mine, group=group)
    phase, what, rank = min(everyone)
    if phase == 3:
        return "nowhere on replay (every output and gradient was finite the second time)"
    return f"{what}, on rank {rank}"
