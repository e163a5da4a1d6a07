"""Plain PyTorch reference of the grouped matmul the Triton kernels implement.

Legend: M packed rows (sorted by group), K input width, N output width, G groups.
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
    x_MK: torch.Tensor,
    w_GKN: torch.Tensor,
    offsets_G: torch.Tensor,
    activation: str | None = None,
) -> torch.Tensor:
    """``y[rows of s] = act(x[rows of s] @ w[s % G])``, one ``torch.matmul`` per row segment.

    Args:
        x_MK: (M, K) packed rows, segment s holds rows ``offsets[s-1]:offsets[s]``.
        w_GKN: (G, K, N) one weight per group.
        offsets_G: (S,) int cumulative end offsets, non-decreasing, ``offsets[-1] <= M``; S a
            multiple of G (S = G: one segment per group).
        activation: None, ``"swiglu"`` (output width N/2) or ``"gelu"``.

    Returns:
        (M, N or N/2) in x's dtype; rows at or past ``offsets[-1]`` are zero (dropped pairs
        ride at the end of the packed buffer and must contribute nothing, also in backward).
    """
    G = w_GKN.shape[0]
    check_segments(offsets_G, G)
    n_out = w_GKN.shape[2] // 2 if activation == "swiglu" else w_GKN.shape[2]
    y = x_MK.new_zeros(x_MK.shape[0], n_out)
    # an empty product keeps y in x's and w's graph when every segment is empty, as the Triton
    # path does: a rank that receives no rows must still run the dispatch's backward (collective)
    y[:0] = apply_activation(x_MK[:0] @ w_GKN[0], activation)
    start = 0
    for g, end in enumerate(offsets_G.tolist()):
        if end > start:
            y[start:end] = apply_activation(x_MK[start:end] @ w_GKN[g % G], activation)
        start = end
    return y
