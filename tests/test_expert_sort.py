"""The counting sort of moe/kernels/expert_sort.py against ``torch.argsort(stable=True)``.

On CPU the kernels run under the interpreter (blocks of 512 / next_pow2(bins) keys, so every
case but the smallest walks several blocks and the scan several row chunks); on a GPU the same
tests run compiled, plus a plan-sized case.
"""

import pytest
import torch

from moe.kernels.expert_sort import MAX_BINS, sort_by_key, sort_by_key_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check(key, num_bins):
    order, count = sort_by_key(key, num_bins, backend="triton")
    ref_order, ref_count = sort_by_key_reference(key, num_bins)
    assert order.dtype == torch.int64 and count.dtype == torch.int64
    assert torch.equal(order, ref_order)  # stable: the exact permutation, ties in index order
    assert torch.equal(count, ref_count)


# empty, one key, one bin, ragged tails, bins not a power of two, every key in one bin, the
# plan's E + 1 bins (dropped pairs last)
@pytest.mark.parametrize("P,bins", [(0, 4), (1, 1), (1, 7), (5, 1), (37, 3), (100, 8), (257, 33),
                                    (1000, 64), (1000, 65), (3000, 129)])
def test_matches_stable_argsort(P, bins):
    _check(torch.randint(0, bins, (P,), device=DEVICE), bins)


@pytest.mark.parametrize("bins", [1, 16, 65])
def test_all_keys_equal_and_extremes(bins):
    _check(torch.full((300,), bins - 1, device=DEVICE, dtype=torch.int64), bins)
    _check(torch.zeros(300, device=DEVICE, dtype=torch.int64), bins)


def test_sorted_and_reversed_input():
    key = torch.arange(40, device=DEVICE).repeat_interleave(7)
    _check(key, 40)
    _check(key.flip(0), 40)


def test_largest_bin_count():
    _check(torch.randint(0, MAX_BINS, (700,), device=DEVICE), MAX_BINS)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="key_P must be 1-D int64"):
        sort_by_key(torch.zeros(4, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="key_P must be 1-D int64"):
        sort_by_key(torch.zeros(2, 2, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="num_bins must be in"):
        sort_by_key(torch.zeros(4, dtype=torch.int64), MAX_BINS + 1, backend="triton")
    with pytest.raises(ValueError, match="num_bins must be in"):
        sort_by_key(torch.zeros(4, dtype=torch.int64), 0)


def test_more_keys_than_the_kernels_take_run_the_reference():
    # a plan of 2048 experts (capacity and dropless) sorts as before, through the PyTorch ops
    key = torch.randint(0, 2049, (500,), device=DEVICE)
    order, count = sort_by_key(key, 2049)
    ref_order, ref_count = sort_by_key_reference(key, 2049)
    assert torch.equal(order, ref_order) and torch.equal(count, ref_count)


@pytest.mark.gpu
def test_plan_sized():
    # 16k tokens × top-8 over 128 experts, and the dropped-pairs key
    _check(torch.randint(0, 128, (131072,), device="cuda"), 128)
    _check(torch.randint(0, 129, (131072,), device="cuda"), 129)
