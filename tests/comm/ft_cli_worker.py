"""One worker of ``localclip train --runtime ft`` as its own process (TORCHFT_LIGHTHOUSE and
LOCALCLIP_REPLICA set by the caller), with two hooks at a round's start that make a kill and a
rejoin happen at the round boundaries a failure plan names, whatever the timing
(tests/comm/test_ft_plans.py):

* ``--exit-at A``: the worker kills itself with SIGKILL at the start of the round after its A-th
  step, before it asks for a quorum (a failure plan's ``R@A:B`` leaves right after step A,
  before a round at step A);
* ``--hold-at B --gate FILE``: at the start of the round after step B, the worker creates
  ``FILE.held`` and waits until FILE exists before it asks for a quorum (the test opens the gate
  once the restarted worker waits at the lighthouse, so that it heals at exactly this round).

* ``--start-gate FILE``: before its join round the worker creates ``FILE.RANK`` and waits until
  FILE exists (the test opens it once every worker is up, so that the first quorum holds them
  all: a loaded machine may take a minute to start one).

Usage: ``ft_cli_worker.py [--exit-at A] [--hold-at B --gate FILE] [--start-gate FILE] -- train ... --runtime ft``.
"""

import argparse
import os
import signal
import sys
import time
from pathlib import Path


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--")
    ap = argparse.ArgumentParser()
    ap.add_argument("--exit-at", type=int, default=None)
    ap.add_argument("--hold-at", type=int, default=None)
    ap.add_argument("--gate", default="")
    ap.add_argument("--start-gate", default="")
    args = ap.parse_args(argv[:split])

    from localclip.cli import main as cli
    from localclip.comm.ft import FaultTolerantMembership

    begin_round = FaultTolerantMembership.begin_round

    def hooked(self, step, last_round):
        if step == args.exit_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == args.hold_at and not os.path.exists(args.gate):
            Path(f"{args.gate}.held").touch()
            while not os.path.exists(args.gate):
                time.sleep(0.05)
        return begin_round(self, step, last_round)

    join = FaultTolerantMembership.join

    def gated_join(self, averager):
        if args.start_gate:
            Path(f"{args.start_gate}.{self.rank}").touch()
            while not os.path.exists(args.start_gate):
                time.sleep(0.05)
        return join(self, averager)

    FaultTolerantMembership.begin_round = hooked
    FaultTolerantMembership.join = gated_join
    return cli(argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main())
