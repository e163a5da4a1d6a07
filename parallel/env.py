"""Process-group start-up from torchrun's environment."""

import datetime
import os

import torch
import torch.distributed as dist


def init_distributed(backend: str | None = None, timeout_s: float = 600.0,
                     seed: int | None = None) -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes; return ``(rank, world_size, device)``.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT. Without them (a plain ``python`` run)
    nothing is initialised and it returns ``(0, 1, device)``. backend: default ``"nccl"`` when
    CUDA is available, else ``"gloo"``. Under NCCL each process takes GPU LOCAL_RANK; under gloo
    the device is the CPU.
    ``timeout_s``: how long a collective may wait for the other ranks.

    ``seed``: when given, ``torch.manual_seed(seed)`` on every rank once it has joined (CPU and
    every GPU generator; a one-process run is seeded the same). Why: nothing broadcasts the
    model's initial weights. The dense and router parameters are replicas that
    :func:`~parallel.sync_gradients` keeps equal only if they start equal, and every process of
    torchrun starts with its own random seed, so without one shared seed each rank builds a
    different model and N ranks no longer train like one process. With it, a model built after
    this call is the same on every rank, and, because :class:`moe.MoELayer` draws each global
    expert from its own generator, rank r's experts are exactly the one-process model's experts
    ``[r·L, (r+1)·L)``. :func:`~parallel.check_replicas_agree` verifies it. Anything that should
    differ per rank (dropout masks, data sampling) then needs its own generator seeded from
    ``(seed, rank)``.

    Restarts (``torchrun --max-restarts``): every attempt talks through the keys of its own
    ``attempt_<TORCHELASTIC_RESTART_COUNT>/`` prefix of the store. torchrun's static rendezvous
    (``--master_port``, no ``--rdzv-backend``) keeps one store for all attempts, and the restarted
    workers found the dead attempt's keys there: measured on gloo (torch 2.13), the second attempt
    hung in ``init_process_group`` until killed; with the prefix it resumed and finished.
    """
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise TypeError(f"init_distributed: seed must be an int or None, got {seed!r}")
    # gloo on a GPU host (parallel.device=cpu) must not claim GPU LOCAL_RANK: there may be fewer
    cuda = torch.cuda.is_available() if backend is None else backend == "nccl"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if "WORLD_SIZE" not in os.environ:
        _seed(seed)
        return 0, 1, device
    if dist.is_initialized():
        _seed(seed)
        return dist.get_rank(), dist.get_world_size(), device
    backend = backend or ("nccl" if cuda else "gloo")
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"attempt_{attempt}/", store)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    _seed(seed)
    return dist.get_rank(), dist.get_world_size(), device


def _seed(seed: int | None) -> None:
    if seed is not None:
        torch.manual_seed(seed)  # the CPU generator and every CUDA device's
