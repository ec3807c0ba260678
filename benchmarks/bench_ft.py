"""Benchmark: what fault tolerance costs: a fault-tolerant round (localclip.comm.ft: torchft's
quorum, the all-reduce over torchft's gloo group, the commit) against a plain gloo round of the
AWD-LSTM's 24,221,600 parameters, and the time a joiner takes to heal against the time to send
the model once.

Two worker processes, one torch thread each, meet through a ``FileStore`` (the default gloo
group: the plain rounds, the barriers, the timings) and torchft's lighthouse, which worker 0
starts in its own process (over a shaped link the workers see nothing but each other). Each
worker is also a :class:`~localclip.comm.ft.FaultTolerantMembership` (its own torchft replica
group). Interleaved per round, each after a ``dist.barrier()``, slowest rank per round:

  (i)   BASELINE: one ``dist.all_reduce`` of a preallocated flat float32 buffer of the model's size;
  (ii)  a plain round: ``PeriodicAverager.average()`` over the default gloo group;
  (ft)  a fault-tolerant round: the same averager's round under the membership
        (``start_quorum`` at the lighthouse, the weighted all-reduce over torchft's process
        group, ``should_commit``): what every round of ``--runtime ft`` costs.

Then, ``--heals`` times each: (s) rank 0 sends the flat model to rank 1 with ``dist.send``
(the time to send the model once, on rank 1); (h) rank 1 replaces its membership with a fresh
one (a restarted worker: a new torchft replica at step 0) whose join round heals it from rank 0
through torchft's HTTP checkpoint transport (the model's state dict), takes part with weight 0
and commits: the join's time on rank 1. The old replica's heartbeats are let expire first, so
that the lighthouse does not wait for it.

    PYTHONPATH=src python benchmarks/bench_ft.py                        # loopback
    sudo PYTHONPATH=src python benchmarks/bench_ft.py --link 1gbit      # and over a 1 Gbit/s link
    sudo PYTHONPATH=src python benchmarks/bench_ft.py --quick --link 1gbit   # 2 rounds, 1 heal (a few minutes)
    PYTHONPATH=src python benchmarks/bench_ft.py --phases --repeats 3 --heals 0   # where a round's time goes

``--phases`` times the plain and the fault-tolerant round phase by phase instead of the tables
(:class:`Phases`): the quorum (``start_quorum``: the RPC to the lighthouse through the replica's
torchft manager, and torchft's process group reconfigured when the quorum changed), the copy
that undoes a failed round, the all-reduce's transport, the work on the sums, the commit
(``should_commit``) and the rest, each in wall time and in the process's CPU time (every
thread's: on a loaded machine the CPU time is the one to read).

With ``--link RATE`` the two workers run in two network namespaces joined by a veth pair shaped
to RATE (bench_averaging's ``ShapedLink``: root, ``ip`` and ``tc``), after the loopback table
(``--no-loopback`` skips it).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_averaging import ShapedLink, _interleave, _slowest, _table, build, link_bits  # noqa: E402

BASELINE = "(i) dist.all_reduce, flat float32 [BASELINE]"
PLAIN = "(ii) localclip average(), plain gloo round"
FT = "(ft) localclip average(), fault-tolerant round"
SEND = "(s) dist.send of the model, rank 0 -> rank 1"
HEAL = "(h) a restarted worker's join round (heal)"
HEARTBEAT = 1.0  # the lighthouse's heartbeat timeout, seconds


class Phases:
    """Where a round's time goes: wrappers around the calls a round makes, each adding its wall
    time (``time.perf_counter``) and this process's CPU time (``time.process_time``: every
    thread's, gloo's and torchft's own threads included) to the round's phase. The round's
    total less its phases is ``rest`` (scaling and checking what is sent, bookkeeping)."""

    def __init__(self):
        self.now: dict[str, list[float]] = {}

    def add(self, phase: str, wall: float, cpu: float) -> None:
        w, c = self.now.get(phase, (0.0, 0.0))
        self.now[phase] = (w + wall, c + cpu)

    def timed(self, phase: str, fn):
        def wrapper(*args, **kwargs):
            w0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(phase, time.perf_counter() - w0, time.process_time() - c0)
        return wrapper

    def wrap_all_reduce(self, comm) -> None:
        """``comm``'s all-reduce as two phases: the transport, and the work on each arrived sum
        (the ``then`` callbacks: rescaling, the new anchor)."""
        inner = comm._all_reduce

        def all_reduce(tensors, op, then):
            finish = self.timed("finish (work on the sums)", then) if then is not None else None
            w0, c0 = time.perf_counter(), time.process_time()
            before = self.now.get("finish (work on the sums)", (0.0, 0.0))
            try:
                return inner(tensors, op, finish)
            finally:
                after = self.now.get("finish (work on the sums)", (0.0, 0.0))
                self.add("all-reduce (transport)", time.perf_counter() - w0 - (after[0] - before[0]),
                         time.process_time() - c0 - (after[1] - before[1]))
        comm._all_reduce = all_reduce

    def run(self, ops: dict, repeats: int, warmup: int) -> dict:
        """Each op ``repeats`` times after ``warmup`` (interleaved, each after a barrier); per op
        and phase, the per-round (wall, cpu) lists of this rank."""
        import torch.distributed as dist

        names = list(ops)
        out = {k: {} for k in names}
        for r in range(warmup + repeats):
            for k in names[r % len(names):] + names[: r % len(names)]:
                dist.barrier()
                self.now = {}
                w0, c0 = time.perf_counter(), time.process_time()
                ops[k]()
                wall, cpu = time.perf_counter() - w0, time.process_time() - c0
                if r < warmup:
                    continue
                phases = dict(self.now)
                phases["rest"] = (wall - sum(w for w, _ in phases.values()), cpu - sum(c for _, c in phases.values()))
                phases["total"] = (wall, cpu)
                for phase, (w, c) in phases.items():
                    out[k].setdefault(phase, ([], []))
                    out[k][phase][0].append(w)
                    out[k][phase][1].append(c)
        return out


def _membership(rank, lighthouse, host, model):
    from localclip import PeriodicAverager
    from localclip.comm.ft import FaultTolerantMembership

    membership = FaultTolerantMembership(rank, 2, lighthouse, timeout=600.0, hostname=host)
    averager = PeriodicAverager(model, period=1, group=membership.communicator)

    def load(state):
        with torch.no_grad():
            model.load_state_dict(state["model"])

    membership.attach(lambda: {"model": model.state_dict()}, load)
    averager.use_membership(membership)
    return membership, averager


def _phases(rank, ops, plain, membership, fault_tolerant, repeats, warmup) -> dict | None:
    """The plain and the fault-tolerant round, phase by phase (see :class:`Phases`): per op and
    phase, per round the slowest rank's wall and CPU time."""
    import torch.distributed as dist

    timer = Phases()
    manager = membership.manager
    manager.start_quorum = timer.timed("quorum (start_quorum)", manager.start_quorum)
    manager.should_commit = timer.timed("commit (should_commit)", manager.should_commit)
    fault_tolerant._pre_round_state = timer.timed("pre-round copy", fault_tolerant._pre_round_state)
    timer.wrap_all_reduce(membership.communicator)
    timer.wrap_all_reduce(plain.comm)
    res = timer.run({k: ops[k] for k in (PLAIN, FT)}, repeats, warmup)
    out = {}
    for op in res:
        out[op] = {}
        for phase in sorted(res[op]):
            walls, cpus = (torch.tensor(v, dtype=torch.float64) for v in res[op][phase])
            dist.all_reduce(walls, op=dist.ReduceOp.MAX)
            dist.all_reduce(cpus, op=dist.ReduceOp.MAX)
            out[op][phase] = (walls.tolist(), cpus.tolist())
    membership.shutdown()
    dist.barrier()
    return {"phases": out, "numel": plain.flat_buffers[0].numel(), "threads": torch.get_num_threads()} if rank == 0 else None


def worker(rank: int, store: str, host: str, peer_host: str, repeats: int, warmup: int, heals: int,
           phases: bool = False) -> dict | None:
    import torch.distributed as dist

    from localclip import PeriodicAverager
    from localclip.comm import distributed

    torch.set_num_threads(1)
    if host != "localhost":
        # torchft's checkpoint server names itself by the machine's hostname, which a network
        # namespace cannot reach: this worker's address on the link instead.
        socket.gethostname = lambda: host
    distributed.init(backend="gloo", rank=rank, world_size=2, store_path=store, timeout=600)
    lighthouse = None
    port = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        from localclip.comm import ft

        lighthouse = ft.start_lighthouse(2, join_timeout=60.0, heartbeat_timeout=HEARTBEAT)
        port.fill_(int(lighthouse.address().rsplit(":", 1)[1]))
    dist.broadcast(port, 0)
    address = f"http://{host if rank == 0 else peer_host}:{int(port.item())}"
    try:
        plain = PeriodicAverager(build(rank), period=1)
        flat = torch.zeros(plain.flat_buffers[0].numel())
        membership, fault_tolerant = _membership(rank, address, host, build(rank))
        membership.join(fault_tolerant)  # a fresh run's first round: nothing sent
        ops = {BASELINE: lambda: dist.all_reduce(flat), PLAIN: functools.partial(plain.average, force=True),
               FT: functools.partial(fault_tolerant.average, force=True)}
        if phases:
            return _phases(rank, ops, plain, membership, fault_tolerant, repeats, warmup)
        times = _slowest(_interleave(ops, repeats, warmup))
        sends, joins = [], []
        for _ in range(heals):
            dist.barrier()
            t0 = time.perf_counter()
            dist.send(flat, 1) if rank == 0 else dist.recv(flat, 0)
            sends.append(time.perf_counter() - t0)
        for _ in range(heals):
            if rank == 1:  # a restarted worker: a fresh replica, a fresh model
                membership.shutdown()
                membership, fault_tolerant = _membership(rank, address, host, build(rank + 10))
            time.sleep(2 * HEARTBEAT)  # the old replica's heartbeats expire
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 1:
                assert membership.join(fault_tolerant), "the joiner did not heal"
                joins.append(time.perf_counter() - t0)
            else:
                fault_tolerant.average(force=True)  # the round the joiner heals at
        sends_t = torch.tensor(sends, dtype=torch.float64)
        joins_t = torch.tensor(joins if rank == 1 else [0.0] * heals, dtype=torch.float64)
        dist.all_reduce(sends_t, op=dist.ReduceOp.MAX)
        dist.all_reduce(joins_t, op=dist.ReduceOp.MAX)
        membership.shutdown()
        dist.barrier()
        if rank == 0:
            return {"times": times, "heal": {SEND: sends_t.tolist(), HEAL: joins_t.tolist()}, "numel": flat.numel(),
                    "threads": torch.get_num_threads()}
        return None
    finally:
        if lighthouse is not None:
            lighthouse.shutdown()
        distributed.shutdown()


def _run_pair(args, link: ShapedLink | None) -> dict:
    """Start the two workers (in the link's namespaces, or here over loopback); rank 0's result."""
    with tempfile.TemporaryDirectory(prefix="lc-bench-ft-") as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "result.json")
        hosts = link.addresses if link is not None else ["localhost", "localhost"]
        procs = []
        for rank in range(2):
            argv = [sys.executable, os.path.abspath(__file__), "--_rank", str(rank), "--_store", store, "--_result", out,
                    "--_host", hosts[rank], "--_peer", hosts[1 - rank], "--repeats", str(args.repeats),
                    "--warmup", str(args.warmup), "--heals", str(args.heals)] + (["--phases"] if args.phases else [])
            cmd, env = link.command(rank, argv) if link is not None else (argv, dict(os.environ))
            procs.append(subprocess.Popen(cmd, env=env))
        try:
            codes = [p.wait(timeout=1800) for p in procs]
        finally:
            for p in procs:  # only the two this started, by pid
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(codes):
            raise SystemExit(f"bench_ft: a worker failed (exit codes {codes})")
        with open(out) as f:
            return json.load(f)


def _print_phases(res: dict) -> None:
    print("\n1. One round, phase by phase (median over rounds of the slowest rank's time; "
          "CPU: the process's, every thread's)")
    ops = list(res["phases"])
    print(f"{'':<34}" + "".join(f"{'wall ms ' + op[:4]:>16}{'CPU ms ' + op[:4]:>16}" for op in ops))
    phases = sorted({ph for op in ops for ph in res["phases"][op]}, key=lambda ph: (ph == "total", ph == "rest", ph))
    for ph in phases:
        cells = ""
        for op in ops:
            if ph in res["phases"][op]:
                walls, cpus = res["phases"][op][ph]
                cells += f"{1e3 * statistics.median(walls):>16.1f}{1e3 * statistics.median(cpus):>16.1f}"
            else:
                cells += f"{'-':>16}{'-':>16}"
        print(f"{ph:<34}{cells}")
    tot = {op: res["phases"][op]["total"] for op in ops}
    if len(ops) == 2:
        print(f"   {ops[1][:4]} / {ops[0][:4]}: wall {statistics.median(tot[ops[1]][0]) / statistics.median(tot[ops[0]][0]):.2f}x, "
              f"CPU {statistics.median(tot[ops[1]][1]) / statistics.median(tot[ops[0]][1]):.2f}x")


def _print(res: dict, title: str, elapsed: float, repeats: int, link: ShapedLink | None) -> None:
    numel = res["numel"]
    print(f"\n=== {title} ({res['threads']} torch thread/worker): {numel:,} float32 per round "
          f"({4 * numel / 2**20:.1f} MiB); {repeats} rounds interleaved; slowest rank per round; {elapsed:.0f}s ===")
    if link is not None:
        print(f"   link {link.rate}: the model once at the link's rate: {4 * numel * 8 / link.bits * 1e3:.0f} ms")
    if "phases" in res:
        return _print_phases(res)
    _table("1. One round (ratio = median / median of (ii), the plain round; paired = median of per-round ratios)",
           res["times"], base=PLAIN)
    times = res["times"]
    print(f"   (ft) / (ii): {statistics.median(times[FT]) / statistics.median(times[PLAIN]):.2f}x (target <= 1.2x at 1 Gbit/s); "
          f"(ft) / (i): {statistics.median(times[FT]) / statistics.median(times[BASELINE]):.2f}x")
    _table("2. Healing a restarted worker against sending the model once (ratio to (s); rank 1's time)", res["heal"], base=SEND)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=6, help="timed rounds per variant (default 6)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    ap.add_argument("--heals", type=int, default=3, help="timed sends and heals (default 3)")
    ap.add_argument("--quick", action="store_true", help="--repeats 2 --heals 1: the ratios in a few minutes")
    ap.add_argument("--link", nargs="+", metavar="RATE", help="also over a veth link shaped to each RATE (e.g. 1gbit; root)")
    ap.add_argument("--no-loopback", action="store_true", help="only the --link tables")
    ap.add_argument("--phases", action="store_true",
                    help="instead of the tables: the plain and the fault-tolerant round phase by phase, wall and CPU time")
    for hidden in ("--_rank", "--_store", "--_result", "--_host", "--_peer"):  # a worker process
        ap.add_argument(hidden, type=int if hidden == "--_rank" else str, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.heals = 2, 1
    if args._rank is not None:
        res = worker(args._rank, args._store, args._host, args._peer, args.repeats, args.warmup, args.heals, args.phases)
        if res is not None:
            with open(args._result, "w") as f:
                json.dump(res, f)
        return 0
    from localclip.comm import ft

    reason = ft.available()
    if reason is not None:
        raise SystemExit(f"bench_ft: {reason}")
    for rate in args.link or []:
        link_bits(rate)
    import torchft

    print(f"bench_ft  {datetime.date.today()}  torch {torch.__version__}  torchft {getattr(torchft, '__version__', '0.2.0')}  "
          f"{platform.machine()} cpus={os.cpu_count()}  load avg {os.getloadavg()[0]:.2f}")
    if not args.no_loopback:
        t0 = time.perf_counter()
        _print(_run_pair(args, None), "2 workers over loopback (gloo)", time.perf_counter() - t0, args.repeats, None)
    for rate in args.link or []:
        t0 = time.perf_counter()
        with ShapedLink(rate) as link:
            res = _run_pair(args, link)
        _print(res, f"2 workers over a {rate} veth link (gloo)", time.perf_counter() - t0, args.repeats, link)
    print(f"load avg at end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    if "--_rank" in sys.argv:  # a worker process: the parent records the table
        sys.exit(main())
    from _record import run

    sys.exit(run("bench_ft", main, sys.argv[1:]))
