"""G local buffers standing for G ranks' symmetric memory, for the one-process tests of the
peer-store kernels (tests/test_p2p_rows.py, tests/test_gather_sum.py): the buffers' addresses
form the pointer table that ``torch.distributed._symmetric_memory`` would give."""

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
G = 3


def buffer_ptrs(bufs: list[torch.Tensor]) -> torch.Tensor:
    """(len(bufs),) int64 addresses of the buffers, on the test device."""
    return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=DEVICE)


def share_one_gpu() -> None:
    """Let the P2P dispatcher run with every rank of a gloo group (the world its EP group) on
    cuda:0 (call first thing in each rank): ``torch.distributed._symmetric_memory`` refuses ranks
    that share a device ("detected allocations from overlapping devices", torch 2.11), so the
    buffers become ``SharedGpuBuffer``, and the launches that spin on a peer's flag wait on the
    host for every rank first. What this proves on one GPU: the kernels' peer stores, flags and
    waits, the autograd wiring and the slots, with the ranks' processes running concurrently
    (their kernels time-sliced); not NVLink's speed, nor orderings that only a skew between the
    ranks would expose."""
    import parallel.p2p_dispatcher as p2p

    class SharedGpuBuffer(p2p._SymmetricBuffer):
        """The ranks' buffers shared by CUDA IPC handles (gathered over the gloo group); the
        barrier waits for this rank's device work, then for every rank on the host."""

        def _empty(self, nbytes, device):
            return torch.empty(nbytes, dtype=torch.uint8, device=device)

        def _exchange(self, group, buf):
            import torch.distributed as dist
            from torch.multiprocessing.reductions import reduce_tensor

            rebuild, args = reduce_tensor(buf)
            handles = [None] * dist.get_world_size(group)
            dist.all_gather_object(handles, args, group=group)
            me = dist.get_rank(group)
            self.peers = [buf if g == me else rebuild(*a) for g, a in enumerate(handles)]
            self.group = group
            return [t.data_ptr() for t in self.peers]

        def _peer_bytes(self, g):
            return self.peers[g]

        def barrier(self):
            import torch.distributed as dist

            torch.cuda.synchronize()
            dist.barrier(group=self.group)

    def after_peers(launch):
        """``launch`` once this rank's device work is done and every rank got here: a spinning wait
        holds the shared GPU until the time slice ends, so a rank that still launches or autotunes
        (a Triton autotuner's timings) while its peer spins crawls (a cold cache ran past 500 s;
        warm, the same test takes 30 s)."""
        import torch.distributed as dist

        def wrapped(*args, **kwargs):
            torch.cuda.synchronize()
            dist.barrier()  # the world: these tests' EP group
            return launch(*args, **kwargs)
        return wrapped

    torch.cuda.set_device(0)
    p2p._SymmetricBuffer = SharedGpuBuffer
    p2p.dispatch_rows, p2p.sum_returned = after_peers(p2p.dispatch_rows), after_peers(p2p.sum_returned)
