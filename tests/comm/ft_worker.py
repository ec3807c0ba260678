"""One worker of a fault-tolerant run over torchft, as its own process (tests/test_ft.py starts,
kills and restarts these by pid).

A small model trained with CELGC; worker r's batch at step s is drawn from a generator seeded by
(r, s) alone, so a restarted worker draws what it would have drawn. Every step appends a line
to ``OUT/rankR.jsonl``: ``{"started": true}`` before its first round, ``{"step": s, "t": seconds}``
(``time.monotonic()`` when the step's record is written), and after a round its step (``round``:
a heal moves a worker to its peer's), its quorum, the models it averaged, torchft's count of
committed rounds, and the model before and after the round.
"""

import argparse
import copy
import json
import os
import signal
import sys
import time

import torch
from torch import nn

from localclip import rng
from localclip.algorithms import CELGC
from localclip.comm.ft import FaultTolerantMembership
from localclip.errors import CommunicationError


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--period", type=int, default=4)
    ap.add_argument("--sleep", type=float, default=0.05)
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hold-at", type=int, default=0, help="before this step, wait until the file --gate exists")
    ap.add_argument("--gate", default="")
    ap.add_argument("--start-gate", default="", help="before the first round, wait until this file exists")
    ap.add_argument("--limit", default="", help="a file holding a step: wait before any later step until it holds a later one")
    ap.add_argument("--die-in-round", type=int, default=0, help="SIGKILL this process inside the round after this step, its transport started")
    args = ap.parse_args()
    torch.set_num_threads(1)
    try:
        membership = FaultTolerantMembership(args.rank, args.world, args.lighthouse, timeout=args.timeout, quorum_timeout=600.0)
    except CommunicationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    with rng.seeded(0):
        model = nn.Linear(16, 8)
    algorithm = CELGC(model, lr=0.05, gamma=1.0, period=args.period, momentum=0.9, group=membership.communicator)

    def state():
        return {"model": model.state_dict(), "algorithm": algorithm.state_dict()}

    def load(s):
        s = copy.deepcopy(s)
        with torch.no_grad():
            model.load_state_dict(s["model"])
        algorithm.load_state_dict(s["algorithm"])

    membership.attach(state, load)
    averager = algorithm.averager
    averager.use_membership(membership)
    log = open(f"{args.out}/rank{args.rank}.jsonl", "a", buffering=1)
    log.write(json.dumps({"started": True, "pid": os.getpid()}) + "\n")
    while args.start_gate and not os.path.exists(args.start_gate):
        time.sleep(0.05)
    healed = membership.join(averager)
    log.write(json.dumps({"joined": averager.step_count, "healed": healed, "rounds": averager.take_quorums()}) + "\n")
    flat = lambda: [round(float(v), 12) for p in model.parameters() for v in p.detach().reshape(-1).tolist()]  # noqa: E731
    while averager.step_count < args.steps:
        step = averager.step_count + 1  # a heal mid-run moves it on to the peer's
        while step == args.hold_at and not os.path.exists(args.gate):
            time.sleep(0.05)
        while args.limit and step > _read_limit(args.limit):
            time.sleep(0.05)
        g = torch.Generator().manual_seed(rng.derive_seed("ft-test", args.rank, step))
        x = torch.randn(32, 16, generator=g)
        y = torch.randn(32, 8, generator=g)
        algorithm.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        algorithm.optimizer.step()
        time.sleep(args.sleep)
        pre = flat()
        if step == args.die_in_round:
            comm = membership.communicator

            def dying(tensors, op, then):
                from torch.distributed import ReduceOp

                membership.manager.allreduce(tensors[0], reduce_op=ReduceOp.SUM)  # the transport has started
                os.kill(os.getpid(), signal.SIGKILL)

            comm._all_reduce = dying
        averager.step()
        record = {"step": step, "t": time.monotonic()}
        for q_step, quorum, averaged in averager.take_quorums():
            record.update(round=q_step, quorum=quorum, averaged=averaged, committed=membership.committed_rounds, pre=pre, post=flat())
        log.write(json.dumps(record) + "\n")
    log.write(json.dumps({"done": args.steps, "rounds": averager.rounds, "discarded": averager.discarded_rounds}) + "\n")
    log.close()
    membership.shutdown()
    return 0


def _read_limit(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


if __name__ == "__main__":
    sys.exit(main())
