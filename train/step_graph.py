"""One micro-batch's forward and backward as a CUDA graph (``train.cuda_graph``).

Why: at EP 2 the host needs about 90 % of the GPU's time to launch a step's ~21,000 kernels
(OLMoE-shaped, 16 layers, 8 micro-batches; bench/results/step_profile.md, twenty-first session),
so the rank whose host falls behind leaves its GPU idle in hundreds of short gaps a step and the
other rank waits for it in the exchange. A replayed graph costs the host one launch a
micro-batch; the GPU then runs the same kernels back to back.

What capture needs, and how the trainer provides it:

- *Fixed addresses.* The graph reads its inputs from :attr:`MicroBatchGraph.tokens_BS` and
  ``targets_BS`` (each replay copies the micro-batch there first), adds the gradients into the
  parameters' ``.grad`` in place (they exist before the capture and are zeroed, never freed,
  between steps: ``optimizer.zero_grad(set_to_none=False)``), and reads the experts' bf16 weight
  copies, which :func:`moe.master_weight_step` keeps and re-casts in place at each step's start.
- *No host sync, no host-side value* inside a micro-batch: true at EP 1 (the local dispatch
  sizes nothing on the host) and with the P2P dispatcher (fixed-size buffers; its flags'
  targets live on the device, advanced by its kernels: parallel/p2p_rows.py); not with the
  NCCL one, whose exact exchange sizes are read on the host (``train.config.check_cuda_graph``).
- *Fresh autograd accumulators.* ``MoELayer.last_aux.loss`` keeps its forward's autograd graph
  alive, and with it every parameter's ``AccumulateGrad`` node, which remembers the stream it was
  made on; a backward under capture that meets a node made on the default stream fails ("would
  make the legacy stream depend on a capturing blocking stream", measured on an H100 with
  torch 2.11). :meth:`capture` drops every layer's ``last_aux`` first, so the captured forward
  makes its own.
- *Warm kernels.* Capture happens at the launch's second step: the first, eager, compiles and
  autotunes the Triton kernels and sizes cuBLAS's workspaces.

Memory: the step's peak does not grow (92.4 GB a GPU eager and graphed, olmoe_bench at EP 2 on
2×H200): the gradients and expert copies it keeps are whole during the micro-batches anyway, and
the graph's private pool holds what one micro-batch's activations took. That pool stays reserved
between replays, so a validation pass's activations come on top of it (train/memory.py models
the training step, not validation).

Outputs live in the graph's memory pool and each replay overwrites them: the trainer reads the
losses with device ops right after each replay, and :meth:`replay` points every MoE layer's
``last_aux`` back at the captured tensors (an eager validation in between replaces it), in a
new :class:`moe.MoEStats` (the stats it derives are cached per object). A failed capture raises,
naming the option: nothing falls back silently.
"""

import dataclasses
from collections.abc import Callable

import torch
import torch.nn as nn

from moe import moe_layers


class MicroBatchGraph:
    """``run(micro, tokens_BS, targets_BS)``: the first call captures ``micro(tokens_BS,
    targets_BS) -> (ce, aux)`` (the forward, its losses and their backward) on static copies of its
    inputs, every call then replays it on the given micro-batch and returns the captured (ce, aux)."""

    def __init__(self, model: nn.Module):
        device = next(model.parameters()).device
        if device.type != "cuda":
            raise ValueError(f"train.cuda_graph=true needs the model on a CUDA GPU, got {device}")
        self.model = model
        self.device = device
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.layers = moe_layers(model)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.tokens_BS = self.targets_BS = None
        self.outputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.aux = {}  # MoE layer name -> its last_aux as captured
        self.grads: list[torch.Tensor] = []  # the gradient tensors the graph adds into
        self.replays = 0

    def run(self, micro: Callable, tokens_BS: torch.Tensor, targets_BS: torch.Tensor):
        if self.graph is None:
            self.capture(micro, tokens_BS, targets_BS)
        return self.replay(tokens_BS, targets_BS)

    def capture(self, micro: Callable, tokens_BS: torch.Tensor, targets_BS: torch.Tensor) -> None:
        for m in self.layers.values():
            m.last_aux = None
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.grads = [p.grad for p in self.params]
        self.tokens_BS = torch.empty_like(tokens_BS, device=self.device)
        self.targets_BS = torch.empty_like(targets_BS, device=self.device)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: a background thread's CUDA calls (an async checkpoint's copies, NCCL's
        # watchdog) are not this capture's business
        try:
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.outputs = micro(self.tokens_BS, self.targets_BS)
        except RuntimeError as err:
            raise RuntimeError(f"train.cuda_graph=true: the micro-batch could not be captured ({err}); something "
                               "in its forward or backward waits for the GPU or reads a value on the host: "
                               "train it with train.cuda_graph=false") from err
        self.aux = {n: m.last_aux for n, m in self.layers.items()}

    def replay(self, tokens_BS: torch.Tensor, targets_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if tokens_BS.shape != self.tokens_BS.shape or targets_BS.shape != self.targets_BS.shape:
            raise ValueError(f"MicroBatchGraph: captured for tokens {tuple(self.tokens_BS.shape)}, got "
                             f"{tuple(tokens_BS.shape)} (targets {tuple(targets_BS.shape)})")
        if any(p.grad is not g for p, g in zip(self.params, self.grads)):
            raise RuntimeError("MicroBatchGraph: a parameter's .grad was replaced or set to None since the capture (the "
                               "graph adds into the old tensors): zero the gradients in place "
                               "(zero_grad(set_to_none=False))")
        self.tokens_BS.copy_(tokens_BS, non_blocking=True)
        self.targets_BS.copy_(targets_BS, non_blocking=True)
        self.graph.replay()
        self.replays += 1
        for name, m in self.layers.items():
            # a new MoEStats each replay: the one read after the last replay cached the stats it
            # derived (cached_property) from that replay's tensors
            aux = self.aux[name]
            m.last_aux = dataclasses.replace(aux, stats=dataclasses.replace(aux.stats))
        return self.outputs

    def release(self) -> None:
        """Free the graph once its replays are done: a graph that holds NCCL work kept both
        ranks in ``destroy_process_group`` until it was reset (2×H200, replicate at EP 1)."""
        if self.graph is None:
            return
        torch.cuda.synchronize()
        self.graph.reset()
        self.graph, self.outputs, self.aux, self.grads = None, None, {}, []
        for m in self.layers.values():
            m.last_aux = None
