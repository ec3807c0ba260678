"""Concurrent simulated workers: a real barrier, failures that release the others, the same bits
as real processes (simulate == spawn), and the communicator each runtime installs."""

import json
import threading
import time
from pathlib import Path

import pytest
import torch

import localclip
from localclip.cli import main
from localclip.comm import SimulatedWorld, current
from localclip.errors import CommunicationError
from localclip.models import LSTMLM
from helpers import SMOKE_DATA, needs_fmnist


def _sleep_then_barrier(arrived):
    def worker():
        comm = current()
        time.sleep(0.5)  # "compute": concurrent workers overlap here
        arrived.append(comm.rank)
        x = torch.tensor([float(comm.rank)])
        comm.all_reduce([x])
        # Nobody leaves the barrier before everyone has arrived.
        assert len(arrived) == 3
        return x.item()

    return worker


def test_workers_run_at_the_same_time_and_a_collective_is_a_barrier():
    start = time.perf_counter()
    assert SimulatedWorld(3, max_running=3).run(_sleep_then_barrier([])) == [3.0, 3.0, 3.0]
    assert time.perf_counter() - start < 1.2  # three 0.5 s sleeps, overlapped

    start = time.perf_counter()
    assert SimulatedWorld(3, concurrent=False).run(_sleep_then_barrier([])) == [3.0, 3.0, 3.0]
    assert time.perf_counter() - start >= 1.5  # turn-taking: one after another


def test_at_most_max_running_workers_compute_at_once():
    lock, running, peak = threading.Lock(), [0], [0]

    def worker():
        comm = current()
        for _ in range(3):
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])
            time.sleep(0.05)
            with lock:
                running[0] -= 1
            comm.barrier()  # waiting workers give their slot to others

    SimulatedWorld(6, max_running=2).run(worker)
    assert peak[0] == 2


def test_a_raising_worker_releases_the_others_and_is_named():
    def worker():
        comm = current()
        if comm.rank == 1:
            time.sleep(0.2)
            raise ValueError("boom in one worker")
        comm.barrier()  # ranks 0 and 2 wait here for rank 1, which never comes

    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"^rank 1: boom in one worker"):
        SimulatedWorld(3, timeout=60).run(worker)
    assert time.perf_counter() - start < 10  # released at once, not after the 60 s timeout


def test_a_worker_that_never_arrives_fails_the_others_within_the_timeout():
    def worker():
        comm = current()
        if comm.rank == 0:
            time.sleep(3.0)  # stuck computing
            return None
        comm.barrier()

    start = time.perf_counter()
    with pytest.raises(CommunicationError, match=r"did not complete within the 1s collective timeout: ranks \[0\] did not arrive"):
        SimulatedWorld(2, timeout=1.0).run(worker)
    assert time.perf_counter() - start < 3.5


def test_workers_that_compute_in_turn_do_not_time_out_while_each_arrives_within_it():
    # One compute slot, four workers: the first to reach the barrier waits for three 0.6 s turns
    # (1.8 s, past the 1 s timeout), but some worker arrives every 0.6 s, so none is stuck.
    def worker():
        time.sleep(0.6)  # computing, holding the only slot
        current().barrier()
        return current().rank

    assert SimulatedWorld(4, timeout=1.0, max_running=1).run(worker) == [0, 1, 2, 3]


@pytest.mark.parametrize("bad", [0, -2, True, 1.5])
def test_bad_world_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="Invalid world size"):
        SimulatedWorld(bad)


def test_bad_thread_settings_are_refused():
    with pytest.raises(ValueError, match="threads_per_worker"):
        SimulatedWorld(2, threads_per_worker=0)
    with pytest.raises(ValueError, match="max_running"):
        SimulatedWorld(2, max_running=0)


def test_each_worker_gets_the_intra_op_threads_a_process_would_get():
    before = torch.get_num_threads()
    got = SimulatedWorld(2, threads_per_worker=1).run(torch.get_num_threads)
    assert got == [1, 1]
    assert torch.get_num_threads() == before  # the caller's setting is restored


def test_current_is_one_object_for_a_workers_life():
    def worker():
        return current() is current(), id(current())

    got = SimulatedWorld(3).run(worker)
    assert all(same for same, _ in got) and len({i for _, i in got}) == 3
    assert current() is current() and current().world_size == 1  # no runtime: a world of one


def test_generator_dropout_does_not_depend_on_other_threads():
    """Each worker's masks come from its own generator, whatever the others draw meanwhile."""

    def worker():
        g = localclip.rng.worker_generator(7, current().rank)
        with localclip.rng.seeded(0):
            model = LSTMLM(50, emb_size=8, hidden_size=8, dropout=0.5)
        localclip.rng.set_generator(model, g)
        out = [model(torch.zeros(4, 2, dtype=torch.long)).logits.sum().item() for _ in range(20)]
        return out

    runs = [SimulatedWorld(4, max_running=4).run(worker) for _ in range(2)]
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs[0]}) == 4  # different workers, different masks


# -- simulate == spawn, bit for bit -----------------------------------------------------------


def _run(tmp_path, recipe, runtime, workers, extra):
    out = tmp_path / f"{runtime}-{workers}"
    args = ["train", recipe, "--workers", str(workers), "--runtime", runtime, "--out", str(out), "--no-progress", *extra]
    assert main(args) == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    return [(r["step"], r.get("train/loss"), r.get("val/ppl"), r.get("test/acc")) for r in metrics], summary["model/sha256"]


LM = ["--set", "model_options.dropout=0.2", "--set", "eval_tokens=1000", "--period", "4", "--max-steps", "10", "--set", "log_interval=2"]
IMAGE = ["--period", "3", "--max-steps", "6", "--set", "log_interval=2", "--set", "batch_size=8"]


def _compare(tmp_path, recipe, workers, extra):
    sim = _run(tmp_path, recipe, "simulate", workers, extra)
    spawned = _run(tmp_path, recipe, "spawn", workers, extra)
    assert sim[0] == spawned[0]  # every logged loss and metric, exactly
    assert sim[1] == spawned[1]  # the final model's state hash


@pytest.mark.full  # spawned processes
@pytest.mark.parametrize("workers", [2, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_simulate_equals_spawn_on_ptb_small_with_dropout(tmp_path, workers):
    _compare(tmp_path, "ptb-small", workers, [*SMOKE_DATA, *LM])


@pytest.mark.full  # spawned processes
@needs_fmnist
@pytest.mark.parametrize("workers", [2, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_simulate_equals_spawn_on_fmnist_resnet_with_batchnorm(tmp_path, workers):
    _compare(tmp_path, "fmnist-resnet", workers, IMAGE)
