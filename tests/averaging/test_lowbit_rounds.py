"""Low-bit averaging rounds (compression=int8|int4) through the averager: simulation equals gloo
bit for bit, the bytes against float32's, resume with the error-feedback residuals, partial
participation, a non-finite worker left out, and the outer step on the decoded average change."""

import pytest
import torch

import localclip

from localclip.averaging import PeriodicAverager
from localclip.comm import SimulatedWorld, current
from localclip.averaging.participation import sample_participants
from localclip.comm.launch import spawn
from localclip.averaging.codecs import encoded_nbytes
from localclip.averaging.outer import OuterSGD

from workers import lowbit_training

JOIN = 120


def _same_bits(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_bits(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        if a.is_floating_point():
            return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return torch.equal(a, b)
    return a == b


CASES = [
    dict(compression="int8"),
    dict(compression="int4", outer=(0.7, 0.9, True)),
    dict(compression="int4", error_feedback=False, participants=2),
    dict(compression="int8", nan_at=(1, 3)),
    dict(compression="int4", fragments=2, outer=(0.7, 0.9, True)),
]


@pytest.mark.full  # gloo processes
def test_simulated_workers_equal_gloo_processes_bit_for_bit():
    """Three workers (so that the all-to-all's rank-order sums matter): every case, every rank,
    states, counters and residuals; all ranks hold the same model after the final round."""
    sim = SimulatedWorld(3).run(lowbit_training, CASES)
    real = spawn(lowbit_training, 3, CASES, join_timeout=JOIN, timeout=60)
    for rank in range(3):
        for case, s, r in zip(CASES, sim[rank], real[rank]):
            assert _same_bits(s, r), (rank, case)
            assert _same_bits(r["state"], real[0][CASES.index(case)]["state"]), (rank, case)
            if "fragments" not in case:
                assert r["rounds"] == 4, case
    nan_case = real[1][3]
    assert [real[r][3]["nonfinite_rounds"] for r in range(3)] == [0, 1, 0]
    assert all(torch.isfinite(v).all() for v in nan_case["state"].values() if v.is_floating_point())
    assert real[0][2]["feedback"] is None and real[0][0]["feedback"] is not None


def _linear(seed):
    with localclip.rng.seeded(seed):  # one thread at a time: simulated workers run concurrently
        return torch.nn.Linear(300, 250)  # 75 250 float32 parameters


@pytest.mark.parametrize("world", [2, 3, 4])
def test_bytes_are_the_encoded_payload_and_at_most_027x_and_014x_of_float32(world):
    """One round of the same change: int8 and int4 count the all-to-all's send buffer (every
    chunk, codes + scales + padding, with its 4-byte weight); float32 counts its all-reduce."""

    def worker(compression):
        model = _linear(current().rank)
        avg = PeriodicAverager(model, period=1, group=current(), compression=compression)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(current().rank)))
        avg.step()
        return avg.bytes_communicated

    n = 300 * 250 + 250
    got = {c: SimulatedWorld(world).run(worker, c) for c in ("none", "int8", "int4")}
    assert got["none"] == [n * 4 + 4] * world
    for compression, bits, limit in (("int8", 8, 0.27), ("int4", 4, 0.14)):
        chunk = encoded_nbytes(-(-n // world), bits)
        assert got[compression] == [world * (chunk + 4)] * world
        ratio = got[compression][0] / got["none"][0]
        assert ratio <= limit, f"{world} workers, {compression}: {got[compression][0]} bytes per round, {ratio:.4f}x float32's {got['none'][0]}"


@pytest.mark.parametrize("case", [dict(compression="int4", outer=(0.7, 0.9, True)), dict(compression="int8", participants=1),
                                  dict(compression="int4", fragments=2)])
def test_a_resume_mid_period_is_bit_exact_with_the_residuals(case):
    straight = SimulatedWorld(2).run(lowbit_training, [case], steps=9, period=2)
    resumed = SimulatedWorld(2).run(lowbit_training, [{**case, "split": 5}], steps=9, period=2)
    for s, r in zip(straight, resumed):
        assert _same_bits(s, r)
        assert any(f["residual"].abs().max() > 0 for f in s[0]["feedback"])  # there was something to carry


def test_a_checkpoint_with_other_feedback_or_compression_is_refused_and_changes_nothing():
    def worker():
        model = _linear(0)
        with_fb = PeriodicAverager(model, period=2, group=current(), compression="int4")
        state = with_fb.state_dict()
        errors = []
        for other in (dict(compression="int4", error_feedback=False), dict(compression="int8"), dict(compression="bf16")):
            target = PeriodicAverager(_linear(1), period=2, group=current(), **other)
            before = target.state_dict()
            try:
                target.load_state_dict(state)
            except ValueError as exc:
                errors.append(str(exc))
            assert _same_bits(target.state_dict(), before)
        return errors

    errors = SimulatedWorld(2).run(worker)[0]
    assert errors == [
        "Checkpoint error feedback on differs from this run's off",
        "Checkpoint compression 'int4' differs from this averager's 'int8'",
        "Checkpoint compression 'int4' differs from this averager's 'bf16'",
    ]


@pytest.mark.parametrize("compression,bits", [("int8", 8), ("int4", 4)])
def test_partial_participation_takes_the_sampled_workers_change(compression, bits):
    """K = 1 of 3: every worker ends the round on the anchor plus the sampled worker's change,
    within a step of the codec per block (sent and re-encoded: two roundings); the workers left
    out keep their (zero) residual, the sampled one holds what its codes left out."""
    world, seed = 3, 7
    chosen = sample_participants(world, 1, 0, seed)[0]

    def worker():
        model = _linear(0)
        avg = PeriodicAverager(model, period=1, group=current(), compression=compression, participants=1, participation_seed=seed)
        start = [p.detach().clone() for p in model.parameters()]
        changes = [torch.randn(p.shape, generator=torch.Generator().manual_seed(10 + current().rank)) for p in model.parameters()]
        with torch.no_grad():
            for p, c in zip(model.parameters(), changes):
                p.add_(c)
        avg.step()
        residual = avg.state_dict()["error_feedback"][0]["residual"]
        return [p.detach().clone() for p in model.parameters()], start, changes, residual

    out = SimulatedWorld(world).run(worker)
    step = 2 * max(c.abs().max() for c in out[chosen][2]) / {8: 127, 4: 7}[bits]
    for rank, (params, start, changes, residual) in enumerate(out):
        assert _same_bits(params, out[0][0])
        for p, s, c in zip(params, start, out[chosen][2]):
            assert (p - (s + c)).abs().max() <= step
        assert (residual.abs().max() > 0) == (rank == chosen)


def test_the_outer_step_takes_the_decoded_average_change():
    """DiLoCo over int8 rounds: outer SGD at lr 1 without momentum is exactly the plain low-bit
    round, and Nesterov's first momentum buffer is exactly anchor − (anchor + decoded average
    change), the pseudo-gradient of the plain round's result."""

    def worker(outer):
        model = _linear(0)
        avg = PeriodicAverager(model, period=1, group=current(), compression="int8", outer_optimizer=outer)
        anchor = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(current().rank)))
        avg.step()
        return anchor, [p.detach().clone() for p in model.parameters()], outer

    plain = SimulatedWorld(2).run(worker, None)
    lr1 = SimulatedWorld(2).run(lambda: worker(OuterSGD(1.0)))
    nesterov = SimulatedWorld(2).run(lambda: worker(OuterSGD(0.7, 0.9, nesterov=True)))
    assert _same_bits(plain[0][1], lr1[0][1]) and _same_bits(plain[1][1], lr1[1][1])
    for rank in range(2):
        anchor, averaged, _ = plain[rank]
        pseudo = torch.cat([(a - x).reshape(-1) for a, x in zip(anchor, averaged)])
        assert _same_bits(nesterov[rank][2].buffers[0], pseudo)
        assert not _same_bits(nesterov[rank][1], averaged)


def test_fragments_keep_a_residual_per_fragment():
    """fragments=2: each fragment's round encodes its own slice (its own residuals, together the
    whole model); over a period the two rounds send the whole model once (plus each round's
    scales and weights)."""

    def worker():
        model = _linear(current().rank)
        whole = PeriodicAverager(model, period=2, group=current(), compression="int8")
        parts = PeriodicAverager(_linear(current().rank), period=2, group=current(), compression="int8", fragments=2)
        for avg in (whole, parts):
            avg.step(), avg.step()
        sizes = [f["residual"].numel() for f in parts.state_dict()["error_feedback"]]
        return sizes, (whole.rounds, whole.bytes_communicated), (parts.rounds, parts.bytes_communicated)

    sizes, whole, parts = SimulatedWorld(2).run(worker)[0]
    assert len(sizes) == 2 and sum(sizes) == 300 * 250 + 250
    assert whole[0] == 1 and parts[0] == 2  # fragment 1's round after step 1, fragment 0's after step 2
    assert whole[1] <= parts[1] <= whole[1] * 1.01


# -- rounds in flight (overlap=tau) -------------------------------------------------------------

OVERLAP_CASES = [
    dict(compression="int4", overlap=1),
    dict(compression="int8", overlap=2, outer=(0.7, 0.9, True)),
    dict(compression="int4", overlap=3, fragments=2, overlap_alpha=0.5),
    dict(compression="int4", overlap=2, fragments=2, error_feedback=False, participants=2),
    dict(compression="int8", overlap=1, fragments=2, error_feedback=False, overlap_alpha=0.25),
    dict(compression="int8", overlap=1, fragments=4, nan_at=(1, 3)),
]


@pytest.mark.full  # gloo processes
def test_rounds_in_flight_simulated_equal_gloo_processes_bit_for_bit():
    """Three workers, period 4, rounds landing 1 to 3 steps after they start (the last started
    one landed early by the final average): every case, every rank, states, counters and
    residuals; all ranks hold the same model after the final round."""
    sim = SimulatedWorld(3).run(lowbit_training, OVERLAP_CASES, steps=10, period=4)
    real = spawn(lowbit_training, 3, OVERLAP_CASES, steps=10, period=4, join_timeout=JOIN, timeout=60)
    for rank in range(3):
        for case, s, r in zip(OVERLAP_CASES, sim[rank], real[rank]):
            assert _same_bits(s, r), (rank, case)
            assert _same_bits(r["state"], real[0][OVERLAP_CASES.index(case)]["state"]), (rank, case)
    # Rank 1's NaN (fragment 0, after step 4) keeps it out of fragment 0's round started then;
    # it takes step 5 on the NaN before that round lands, which spoils its BatchNorm statistics
    # (fragment 3), so it is also left out of fragment 3's round after step 7; both land finite.
    assert [real[r][5]["nonfinite_rounds"] for r in range(3)] == [0, 2, 0]
    assert all(torch.isfinite(v).all() for v in real[1][5]["state"].values() if v.is_floating_point())
    assert real[0][0]["feedback"] is not None and real[0][3]["feedback"] is None


def _set_values(model, rank, t):
    """Worker ``rank``'s parameters after step ``t``, whatever they were (so that a run with a
    round in flight and a blocking run send the same snapshots)."""
    gen = torch.Generator().manual_seed(1000 * rank + t)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))


@pytest.mark.parametrize("compression", ["int8", "int4"])
@pytest.mark.parametrize("overlap", [1, 2, 3])
def test_a_round_in_flight_lands_the_bits_of_a_blocking_round_of_its_snapshot(compression, overlap):
    """Period 4, rounds after steps 4 and 8: the run with overlap=tau, its values set again at
    every step, holds after step 4 + tau (and 8 + tau) the bits that the blocking run holds after
    step 4 (and 8), with the same residuals and bytes; the round advances to its all-gather
    ceil(tau/2) steps after its start (tau = 1: at the landing)."""

    def worker():
        rank = current().rank
        blocking_model, flying_model = _linear(rank), _linear(rank)
        blocking = PeriodicAverager(blocking_model, period=4, group=current(), compression=compression)
        flying = PeriodicAverager(flying_model, period=4, group=current(), compression=compression, overlap=overlap)
        landed, phases = {}, []
        for t in range(1, 12):
            for model, avg in ((blocking_model, blocking), (flying_model, flying)):
                _set_values(model, rank, t)
                avg.step()
            if t in (4, 8):
                landed[t] = ([p.detach().clone() for p in blocking_model.parameters()], blocking.state_dict()["error_feedback"],
                             blocking.bytes_communicated)
            if t in (4 + overlap, 8 + overlap):
                assert not flying._in_flight
                want, feedback, sent = landed[t - overlap]
                assert _same_bits([p.detach() for p in flying_model.parameters()], want), t
                assert _same_bits(flying.state_dict()["error_feedback"], feedback), t
                assert flying.bytes_communicated == sent, t
            if 4 <= t < 4 + overlap:
                phases.append(flying._in_flight[0].exchanges[0].advanced)
        return phases

    for phases in SimulatedWorld(3).run(worker):
        midway = (overlap + 1) // 2
        assert phases == [k >= midway for k in range(overlap)]


def test_without_error_feedback_no_residual_is_kept_and_the_run_differs():
    runs = {fb: SimulatedWorld(2).run(lowbit_training, [dict(compression="int4", error_feedback=fb)])[0][0] for fb in (True, False)}
    assert runs[False]["feedback"] is None and runs[True]["feedback"] is not None
    assert runs[True]["bytes"] == runs[False]["bytes"] and runs[True]["rounds"] == runs[False]["rounds"]
    assert not _same_bits(runs[True]["state"], runs[False]["state"])


@pytest.mark.full  # a killed process
def test_a_killed_int4_run_resumes_bit_identically_through_the_cli(tmp_path):
    """ptb-small, two workers, int4 rounds with error feedback every 3 steps, checkpoints every
    4 (mid-period): killed after a checkpoint and resumed, it ends where the straight run ends."""
    import json

    from helpers import SMOKE, kill_after_first_checkpoint, records, train

    args = ["--workers", "2", "--period", "3", "--max-steps", "24", "--compression", "int4", "--set", "checkpoint_interval=4",
            "--set", "lr_decay_epochs=[0]"]
    assert train(tmp_path, *args, name="straight")[0] == 0
    out = tmp_path / "killed"
    latest = kill_after_first_checkpoint(["ptb-small", *args, *SMOKE], out)
    assert json.loads(latest.read_text())["step"] % 3  # the checkpoint holds a period in progress
    assert train(tmp_path, *args, "--resume", name="killed")[0] == 0
    straight = json.loads((tmp_path / "straight" / "summary.json").read_text())
    resumed = json.loads((out / "summary.json").read_text())
    for key in ("val/ppl", "test/ppl", "val/loss", "comm/rounds", "comm/bytes", "steps"):
        assert resumed[key] == straight[key], key
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rs]  # noqa: E731
    assert strip(records(out)) == strip(records(tmp_path / "straight"))
