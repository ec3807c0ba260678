"""Benchmark: torchft 0.2.0's LocalSGD and DiLoCo syncs beside localclip's rounds, same model, same run.

Two processes (``localclip.comm.launch.spawn``, FileStore rendezvous, default gloo group for the
baseline and for localclip), each also a torchft replica: a ``Manager`` with torchft's
``ProcessGroupGloo``, its own ``TCPStore`` on a free port, and a ``LighthouseServer`` (started
here, port 0) for the quorum. torchft's own tests set up replicas the same way
(``torchft/local_sgd_integ_test.py``). Each process runs at ``--threads`` intra-op threads
(default 1); one lighthouse per algorithm (a lighthouse waits for half of every replica it has
seen). Interleaved per round, each after a ``dist.barrier()``, slowest rank per round:

  (i)   BASELINE: one ``dist.all_reduce`` of a preallocated flat float32 buffer of the model's size;
  (ii)  localclip ``PeriodicAverager.average()``;
  (v)   localclip ``average()`` with ``OuterSGD(0.7, 0.9, nesterov=True)``;
  (t1)  torchft ``LocalSGD.sync()`` (a quorum, then one all-reduce per parameter tensor);
  (t2)  torchft ``DiLoCo`` with ``sync_every=1``: one inner ``optimizer.step()`` without gradients
        (a no-op for SGD) whose post-step hook runs the quorum, the pseudo-gradient all-reduce and
        the outer Nesterov SGD step (lr 0.7, momentum 0.9) against its CPU backup of the weights.

    pip install torchft==0.2.0
    PYTHONPATH=src python benchmarks/bench_torchft.py            # ~2-4 min
"""

from __future__ import annotations

import argparse
import datetime
import functools
import logging
import os
import platform
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from localclip import OuterSGD, PeriodicAverager  # noqa: E402
from localclip.comm import current  # noqa: E402
from localclip.comm.launch import spawn  # noqa: E402
from localclip.models import AWDLSTM  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_averaging import _interleave, _slowest, _table, build  # noqa: E402

NAMES = ("(i) dist.all_reduce, flat float32 [BASELINE]", "(ii) localclip average()", "(v) localclip average(), OuterSGD Nesterov",
         "(t1) torchft LocalSGD.sync()", "(t2) torchft DiLoCo sync (Nesterov outer)")


def worker(lighthouses: list, repeats: int, warmup: int, threads: int):
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo, LocalSGD

    logging.getLogger("torchft").setLevel(logging.WARNING)
    torch.set_num_threads(threads)
    comm = current()
    rank = comm.rank
    model_ii = build(rank)
    averager = PeriodicAverager(model_ii, period=1, group=comm)
    outer = PeriodicAverager(build(rank), period=1, group=comm, outer_optimizer=OuterSGD(0.7, 0.9, nesterov=True))
    flat = torch.zeros(averager.flat_buffers[0].numel())

    def manager(model, opt, tag, lighthouse):
        store = dist.TCPStore("localhost", 0, 1, is_master=True, wait_for_workers=False)
        return Manager(
            pg=ProcessGroupGloo(), min_replica_size=2, load_state_dict=lambda sd: None, state_dict=lambda: {},
            replica_id=f"{tag}{rank}", store_addr="localhost", store_port=store.port, rank=0, world_size=1,
            lighthouse_addr=lighthouse, port=0, hostname="localhost", timeout=timedelta(seconds=120),
            use_async_quorum=False,
        ), store

    m1 = AWDLSTM(10000)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    man1, store1 = manager(m1, o1, "localsgd", lighthouses[0])
    local_sgd = LocalSGD(man1, m1, o1, sync_every=1 << 30).__enter__()
    m2 = AWDLSTM(10000)
    inner = torch.optim.SGD(m2.parameters(), lr=0.1)
    outer_opt = torch.optim.SGD(m2.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    man2, store2 = manager(m2, inner, "diloco", lighthouses[1])
    diloco = DiLoCo(man2, [m2], inner, outer_opt, sync_every=1, pin_memory=False).__enter__()
    ops = dict(zip(NAMES, (lambda: dist.all_reduce(flat), functools.partial(averager.average, force=True), functools.partial(outer.average, force=True), local_sgd.sync, inner.step)))
    times = _slowest(_interleave(ops, repeats, warmup))
    for m in (man1, man2):
        m.shutdown(wait=False)
    return {"times": times, "numel": flat.numel(), "threads": torch.get_num_threads()} if rank == 0 else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    import torchft
    from torchft._torchft import LighthouseServer

    print(f"bench_torchft  {datetime.date.today()}  torch {torch.__version__}  torchft {getattr(torchft, '__version__', '0.2.0')}  "
          f"{platform.machine()} cpus={os.cpu_count()}  load avg {os.getloadavg()[0]:.2f}")
    # One lighthouse per algorithm: a lighthouse waits for half of all the replicas it has seen.
    lighthouses = [LighthouseServer(bind="[::]:0", min_replicas=2) for _ in range(2)]
    t0 = time.perf_counter()
    try:
        res = spawn(worker, 2, [h.address() for h in lighthouses], args.repeats, args.warmup, args.threads,
                    timeout=600, join_timeout=1800)[0]
    finally:
        for h in lighthouses:
            h.shutdown()
    print(f"\n=== 2 workers (gloo, {res['threads']} torch thread(s)/worker): {res['numel']:,} float32; {args.repeats} rounds "
          f"interleaved; slowest rank per round; {time.perf_counter() - t0:.0f}s ===")
    _table("One sync (ratio = median / median of (i); paired = median of per-round ratios)", res["times"])
    print(f"load avg at end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    from _record import run

    sys.exit(run("bench_torchft", main, sys.argv[1:]))
