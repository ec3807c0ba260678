"""A low-bit round keeps its buffers: after the first round of a bucket, a round allocates no
buffer of the model's size (whose fresh pages would cost a fault per 4 KiB every round: glibc
maps a large block anew and unmaps it when it is freed).

Shown by the process's minor page faults per round, in a process of its own where glibc maps
every block of 1 MiB or more anew and never keeps freed memory for later (its thresholds set by
the environment), so that any such allocation faults every round, whatever glibc's own
heuristics would have done. A control in the same process, the reduction run without its
buffers, must fault at least one model-sized buffer's pages per round: the check sees what it
is meant to."""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, resource, sys
import torch
from localclip.averaging import PeriodicAverager
from localclip.averaging.codecs import ErrorFeedback, lowbit_average
from localclip.comm import SimulatedWorld, current

n, compression, rounds = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
kept = {}

def averager_round(k):
    rank = current().rank
    if rank not in kept:
        module = torch.nn.Module()
        module.w = torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(rank)))
        kept[rank] = (module, PeriodicAverager(module, period=1, compression=compression))
    module, averager = kept[rank]
    with torch.no_grad():
        module.w.mul_(1.0 + 1e-3 * (k + 1))  # a change since the anchor, as after local steps
    averager.average(force=True)

def bare_round(k):
    rank = current().rank
    fb = kept.setdefault(("fb", rank), ErrorFeedback(n))
    delta = kept.setdefault(("delta", rank), torch.randn(n, generator=torch.Generator().manual_seed(rank)))
    lowbit_average(current(), delta, 8 if compression == "int8" else 4, fb)  # no scratch: new buffers every call

def faults(fn):
    world, out = SimulatedWorld(2), []
    for k in range(rounds):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        world.run(fn, k)
        out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return out

print(json.dumps({"averager": faults(averager_round), "bare": faults(bare_round)}))
"""

NUMEL = 1 << 21  # 8 MiB of float32: 2,048 pages


@pytest.mark.full
@pytest.mark.parametrize("compression", ["int8", "int4"])
def test_a_lowbit_round_allocates_no_model_sized_buffer_after_the_first(compression):
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20), MALLOC_TRIM_THRESHOLD_=str(1 << 40), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(NUMEL), compression, "4"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    pages = NUMEL * 4 // 4096
    # The control: the reduction without its buffers maps its payloads and its average anew, in
    # every round, on each of the 2 workers.
    assert min(result["bare"][1:]) >= 2 * pages, result
    # The averager's rounds after the first two (the first sizes the buffers; the second may
    # still grow the heap of pieces in flight): nothing of the model's size on either worker,
    # which would fault 2,048 pages (what remains is small objects and the workers' threads).
    assert max(result["averager"][2:]) < pages // 2, result
