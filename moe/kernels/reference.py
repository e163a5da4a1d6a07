"""Plain PyTorch reference of the grouped matmul the Triton kernels implement.

Legend: M packed rows (sorted by group), I input width, N output width,
L weight groups, J row segments (a multiple of L).
"""

import torch
import torch.nn.functional as F

from kernel_floor import check_segments


def apply_activation(y_MN: torch.Tensor, activation: str | None) -> torch.Tensor:
    """Activation applied to a grouped-matmul output.

    ``"swiglu"``: the N columns are ``[gate | up]`` halves, the result is ``silu(gate) * up``
    of width N/2, computed in fp32 and cast back. ``"gelu"``: tanh-approximate GELU.
    """
    if activation is None:
        return y_MN
    if activation == "swiglu":
        gate, up = y_MN.float().chunk(2, dim=-1)
        return (F.silu(gate) * up).to(y_MN.dtype)
    if activation == "gelu":
        return F.gelu(y_MN.float(), approximate="tanh").to(y_MN.dtype)
    raise ValueError(f"activation must be None, 'swiglu' or 'gelu', got {activation!r}")


def grouped_mm_reference(
    x_MI: torch.Tensor,
    w_LIN: torch.Tensor,
    offsets_J: torch.Tensor,
    activation: str | None = None,
) -> torch.Tensor:
    """``y[rows of s] = act(x[rows of s] @ w[s % L])``, one ``torch.matmul`` per row segment.

    Args:
        x_MI: (M, I) packed rows, segment s holds rows ``offsets[s-1]:offsets[s]``.
        w_LIN: (L, I, N) one weight per group.
        offsets_J: (J,) int cumulative end offsets, non-decreasing, ``offsets[-1] <= M``; J a
            multiple of L (J = L: one segment per group).
        activation: None, ``"swiglu"`` (output width N/2) or ``"gelu"``.

    Returns:
        (M, N or N/2) in x's dtype; rows at or past ``offsets[-1]`` are zero (dropped pairs
        ride at the end of the packed buffer and must contribute nothing, also in backward).
    """
    L = w_LIN.shape[0]
    check_segments(offsets_J, L)
    n_out = w_LIN.shape[2] // 2 if activation == "swiglu" else w_LIN.shape[2]
    y = x_MI.new_zeros(x_MI.shape[0], n_out)
    # an empty product keeps y in x's and w's graph when every segment is empty, as the Triton
    # path does: a rank that receives no rows must still run the dispatch's backward (collective)
    y[:0] = apply_activation(x_MI[:0] @ w_LIN[0], activation)
    start = 0
    for s, end in enumerate(offsets_J.tolist()):
        if end > start:
            y[start:end] = apply_activation(x_MI[start:end] @ w_LIN[s % L], activation)
        start = end
    return y
