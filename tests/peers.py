"""G local buffers standing for G ranks' symmetric memory, for the one-process tests of the
peer-store kernels (tests/test_p2p_rows.py, tests/test_gather_sum.py): the buffers' addresses
form the pointer table that ``torch.distributed._symmetric_memory`` would give."""

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
G = 3


def buffer_ptrs(bufs: list[torch.Tensor]) -> torch.Tensor:
    """(len(bufs),) int64 addresses of the buffers, on the test device."""
    return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=DEVICE)
