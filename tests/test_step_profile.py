"""bench/step_profile.py's GPU-only split of a step (the exposed exchange and its wait for a later
rank), on hand-made traces whose answers are counted by hand."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("step_profile", Path(__file__).resolve().parents[1] / "bench" / "step_profile.py")
sp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sp)


def _kernel(ts, dur, name):
    return {"cat": "kernel", "ts": ts, "dur": dur, "name": name}


def test_exchange_kernels_are_those_mostly_in_the_exchange():
    kernels = [(0, 10, "dispatch/combine", "d"), (5, 20, "expert GEMMs", "g"), (20, 30, "all-to-all", "a"),
               (30, 31, "norms", "d"), (31, 40, "dispatch/combine", "n"), (40, 60, "norms", "n")]
    assert sp.exchange_kernels(kernels) == {"d", "a"}  # n: 9 of its 29 µs in the exchange


def test_graph_replays_take_the_category_their_name_had_in_the_eager_step():
    eager = [(0, 10, "dispatch/combine", "d"), (10, 30, "attention", "mm"), (30, 35, "LM head + loss", "mm"),
             (35, 36, "elementwise, other", "add")]
    names = sp.name_categories(eager)
    assert names == {"d": "dispatch/combine", "mm": "attention", "add": "elementwise, other"}
    replayed = [(0, 10, "elementwise, other", "d"), (10, 20, "elementwise, other", "mm"),
                (20, 21, "optimizer + clip", "mm"), (21, 22, "elementwise, other", "new")]
    assert sp.recategorise(replayed, names) == [(0, 10, "dispatch/combine", "d"), (10, 20, "attention", "mm"),
                                                (20, 21, "optimizer + clip", "mm"), (21, 22, "elementwise, other", "new")]


def test_the_exchange_kernels_are_claimed_by_name_under_ep():
    kernels = [(0, 10, "router + routing plan", "_push_back_kernel"), (10, 20, "router + routing plan", "_router_kernel"),
               (20, 30, "elementwise, other", "_gather_sum_kernel"), (30, 40, "expert GEMMs", "_grouped_mm_kernel")]
    assert [c for _, _, c, _ in sp.claim_exchange(kernels)] == [
        "dispatch/combine", "router + routing plan", "dispatch/combine", "expert GEMMs"]
    dtod = "Memcpy DtoD (Device -> Device)"
    copies = [(0, 5, "dispatch/combine", dtod), (5, 6, sp.OTHER, "Memcpy HtoD"),
              (6, 7, "router + routing plan", "Memcpy PtoP (Device -> Device)"),
              (7, 8, sp.OTHER, "_signal_peers_kernel"), (8, 9, sp.OTHER, "_expand_rows_kernel"), (9, 10, sp.OTHER, dtod),
              (10, 11, "gradient sync", dtod)]
    assert [c for _, _, c, _ in sp.claim_exchange(copies)] == [
        "dispatch/combine", sp.OTHER, "router + routing plan", "dispatch/combine", "dispatch/combine", sp.OTHER,
        "gradient sync"]
    # the copy-engine mode's transfer (the peer memcpys and the signal after them) is the all-to-all;
    # no within-device copy is (the own block is read in place)
    assert [c for _, _, c, _ in sp.claim_exchange(copies, copies=True)] == [
        "dispatch/combine", sp.OTHER, sp.ALL_TO_ALL, sp.ALL_TO_ALL, "dispatch/combine", sp.OTHER, "gradient sync"]
    import importlib

    p2p_rows, token_rows, floor = (importlib.import_module(m) for m in
                                   ("parallel.p2p_rows", "parallel.token_rows", "kernel_floor.gather_sum"))
    defined = {n for m in (p2p_rows, token_rows, floor) for n in vars(m) if n.endswith("_kernel")}
    assert sp.EP_EXCHANGE_KERNELS <= defined  # no stale name (a renamed kernel would go unclaimed)
    assert {n for n in vars(p2p_rows) if n.endswith("_kernel")} <= sp.EP_EXCHANGE_KERNELS


def test_light_split_clips_to_the_profiled_steps_and_splits_them():
    # rank 0's trace also holds a kernel of an earlier profile (at 0): outside the last 45 µs
    events = [_kernel(0, 5, "old"), _kernel(100, 10, "d"), _kernel(110, 20, "g"), _kernel(130, 10, "d"),
              {"cat": "cpu_op", "ts": 0, "dur": 500, "name": "aten::mm"}]
    kernels = sp.light_kernels(events, own_ms=0.045)
    assert [n for _, _, n in kernels] == ["d", "g", "d"]
    own, exposed, idle = sp.light_split(kernels, {"d"}, step_ms=0.050, steps=1)
    assert (own, exposed) == (pytest.approx(0.020), pytest.approx(0.020))
    assert idle == pytest.approx(0.010)  # 50 µs step, 40 µs covered


def test_wait_split_charges_the_early_rank_for_the_late_one():
    d, c = "_exchange_counts_kernel", "Memcpy PtoP (Device -> Device)"  # one that waits, one that does not
    r0 = sp.light_kernels([_kernel(100, 10, d), _kernel(110, 20, "g"), _kernel(130, 10, d), _kernel(140, 4, c)], 0.049)
    r1 = sp.light_kernels([_kernel(90, 3, d), _kernel(104, 6, d), _kernel(110, 25, "g"), _kernel(135, 5, d),
                           _kernel(148, 4, c)], 0.062)
    launches = [sp.exchange_launches(r, {d, c}) for r in (r0, r1)]
    assert all(set(la) == {d} for la in launches)  # the copy, 8 µs earlier on rank 0, waits for nothing
    waits, spread = sp.wait_split(launches, steps=1)
    # aligned at the ends: r1's first "d" (at 90) has no partner. Launch 1: r0 starts at 100, r1 at
    # 104 -> r0 waits 4 µs; launch 2: 130 against 135 -> r0 waits 5 µs; r1 never waits
    assert waits == [pytest.approx(0.009), 0.0]
    assert spread == 0  # both launches end together on both ranks
    # a wait is at most the kernel's own duration (a rank whose peer starts long after it ends)
    waits, _ = sp.wait_split([{"d": [(0, 2)]}, {"d": [(50, 52)]}], steps=2)
    assert waits == [pytest.approx(0.001), 0.0]


def test_the_exchange_exposed_counts_its_categories_overlap_once():
    # an all-to-all copy (0-10) beside a dispatch/combine kernel (5-15), a GEMM (12-20): the exchange
    # is exposed 0-12 (12 µs), though its categories alone are exposed only 0-5 and 10-12 (7 µs)
    kernels = [(0, 10, sp.ALL_TO_ALL, "Memcpy PtoP"), (5, 15, "dispatch/combine", "_expand_rows_kernel"),
               (12, 20, "expert GEMMs", "_grouped_mm_tma_kernel")]
    rows = sp.summarise(kernels, step_ms=0.020, steps=1)
    exposed = {c: x for c, _, x in rows}
    assert exposed[sp.ALL_TO_ALL] == pytest.approx(0.005) and exposed["dispatch/combine"] == pytest.approx(0.002)
    assert sp._exchange_ms(rows) == pytest.approx(0.012)
    assert sp._compute_ms(rows) == pytest.approx(0.005)  # the GEMM's 15-20


def test_idle_gaps_by_length_and_the_longest():
    # kernels (µs): 0-10, 5-20 (overlaps: no gap), gap 5 µs, 25-30, gap 50 µs, 80-90, gap 2000 µs, 2090-2100
    kernels = [(0, 10, "a"), (5, 20, "b"), (25, 30, "c"), (80, 90, "d"), (2090, 2100, "e")]
    per_step, top = sp.idle_gaps(kernels, steps=2)
    assert per_step == [(0.5, pytest.approx(0.0025)), (0.5, pytest.approx(0.025)), (0, 0), (0.5, pytest.approx(1.0)),
                        (0, 0)]
    assert top[0] == (pytest.approx(2.0), pytest.approx(0.09), "d", "e")
    assert top[1][2:] == ("c", "d") and top[2][2:] == ("b", "c")  # "b" ends last before the 5 µs gap
    lines = sp.gap_table([sp.idle_gaps(kernels, steps=1, longest=1)])
    assert lines[-2] == "| 0 | 1 / 0.0 | 1 / 0.1 | 0 / 0.0 | 1 / 2.0 | 0 / 0.0 | 2.00 at 0.1: `d` → `e` |"
