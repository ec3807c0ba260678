"""Streaming rounds: fragments on staggered schedules, rounds in flight merged tau steps later,
their checkpoints, their refusals, and the evaluations inside an epoch that score the mean of the
workers' live models."""

import copy
import itertools
import math

import pytest
import torch

import localclip
from localclip.algorithms import CELGC, EPISODE, compose
from localclip.averaging import PeriodicAverager
from localclip.averaging.fragments import offsets
from localclip.averaging.schedule import Schedule
from localclip.comm import SimulatedWorld, current
from localclip.optim import ClippedSGD

from workers import fixed_batches, tiny_model

TENSORS = ["0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias", "2.running_mean", "2.running_var"]


def test_offsets_are_floored_and_each_fragment_syncs_once_per_period():
    assert offsets(4, 8) == [0, 2, 4, 6]
    assert offsets(4, 6) == [0, 1, 3, 4]  # 4 does not divide 6: floor(p·6/4)
    s = Schedule(6, fragments=4)
    due = {t: s.due(t) for t in range(1, 19)}
    for p, o in enumerate(offsets(4, 6)):
        assert [t for t, ps in due.items() if p in ps] == [t for t in range(1, 19) if t >= o and (t - o) % 6 == 0]
    assert all(len(ps) <= 1 for ps in due.values())
    one = Schedule(6)
    assert [one.is_sync_step(t) for t in range(1, 13)] == [t % 6 == 0 for t in range(1, 13)]


def _single(**kwargs):
    return PeriodicAverager(tiny_model(), group=localclip.comm.SingleProcess(), **kwargs)


TENSOR_NUMELS = [96, 16, 16, 16, 48, 3, 16, 16]  # TENSORS' elements, in the averaged order


@pytest.mark.parametrize("fragments", [1, 2, 3, 4, 8, 9])
def test_fragments_are_contiguous_element_ranges_of_about_equal_bytes(fragments):
    avg = _single(period=16, fragments=fragments)  # 9 fragments: more than the 8 tensors
    elements = avg.fragment_elements
    assert elements[0][0] == 0 and elements[-1][1] == avg.numel == sum(TENSOR_NUMELS)
    assert all(a < b == c for (a, b), (c, _) in zip(elements, elements[1:] + [(elements[-1][1], None)]))
    sizes = avg.fragment_bytes
    assert sizes == [4 * (b - a) for a, b in elements] and sum(sizes) == avg.numel * 4
    # A model this small cuts at single elements: no fragment is more than one element past 1/P.
    assert max(sizes) <= 4 * (-(-avg.numel // fragments) + 1)
    names = avg.fragment_names
    ends = list(itertools.accumulate(TENSOR_NUMELS))
    for (a, b), held in zip(elements, names):
        assert held == [n for n, end, numel in zip(TENSORS, ends, TENSOR_NUMELS) if end - numel < b and end > a]
    if fragments > 1:
        assert any(a not in (0, *ends) for a, _ in elements)  # a tensor is cut between two fragments


def test_fragments_are_within_one_pth_and_five_percent_of_a_full_round_for_ptb_small():
    """Bytes as the rounds send them (payload and weight): ptb-small's tied embedding is 75 % of
    the model, so fragments of whole tensors could not get below 0.754 of a full round at P = 4."""
    from localclip.models import build_model
    from localclip.recipes import get_recipe

    options = get_recipe("ptb-small").workload.model_options

    def worker(fragments):
        with localclip.rng.seeded(current().rank):  # one thread at a time: simulated workers run concurrently
            model = build_model("lstm", ntoken=10000, **options)
        avg = PeriodicAverager(model, 8, fragments=fragments)
        sent = []
        for _ in range(8):  # one period: every fragment's round once
            before = avg.bytes_communicated
            avg.step()
            sent.append(avg.bytes_communicated - before)
        return [b for b in sent if b], avg.fragment_bytes

    full, _ = SimulatedWorld(2).run(worker, 1)[0]
    assert len(full) == 1
    for fragments in (2, 4, 8):
        rounds, sizes = SimulatedWorld(2).run(worker, fragments)[0]
        assert len(rounds) == fragments and sum(rounds) == full[0] + 4 * (fragments - 1)  # one weight per round
        assert max(rounds) <= full[0] * 1.05 / fragments, (fragments, max(rounds) / full[0])
        assert sorted(rounds) == sorted(s + 4 for s in sizes)  # in the order of the offsets, not of the fragments


@pytest.mark.parametrize(
    "kwargs,match",
    [(dict(period=8, fragments=0), "fragments: 0"),
     (dict(period=2, fragments=3), "fragments=3 with period=2"), (dict(period=4, overlap=4), "overlap=4 with period=4"),
     (dict(period=4, overlap=-1), "overlap: -1"), (dict(period=4, overlap=1, overlap_alpha=1.5), "overlap_alpha: 1.5"),
     (dict(period=4, overlap_alpha=0.5), "overlap_alpha=0.5 with overlap=0"),
     (dict(period=4, overlap_merge="carry"), "overlap_merge='carry' with overlap=0"),
     (dict(period=4, overlap=1, overlap_alpha=0.5, overlap_merge="carry"), "overlap_merge='carry' with overlap_alpha=0.5"),
     (dict(period=4, overlap=1, overlap_merge="keep"), "overlap_merge: 'keep'"),
     (dict(period=4, fragments=2, warmup_steps=2), "warmup_steps=2 with fragments=2"),
     (dict(period=4, overlap=1, optimizer_state="reset", optimizer=torch.optim.SGD([torch.zeros(1)], lr=1)), "optimizer_state='reset'"),
     (dict(period=4, fragments=2, outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0)), "with fragments=2: a torch.optim")],
)
def test_invalid_streaming_options_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _single(**kwargs)


def test_more_fragments_than_elements_are_refused():
    with pytest.raises(ValueError, match="fragments=3: the model has only 2 averaged elements"):
        PeriodicAverager(torch.nn.Linear(1, 1), 4, group=localclip.comm.SingleProcess(), fragments=3)


def test_episode_refuses_streaming_rounds():
    for name, value in (("fragments", 2), ("overlap", 1)):
        with pytest.raises(ValueError, match=f"Invalid {name}={value} for EPISODE"):
            EPISODE(tiny_model(), lr=0.1, gamma=1.0, period=4, group=localclip.comm.SingleProcess(), **{name: value})


# -- what a round does, against a reference written out by hand (float64) ----------------------


def _flat(model):
    return torch.cat([t.detach().reshape(-1) for t in [*model.parameters(), model[2].running_mean, model[2].running_var]])


def _reference_worker(period, fragments, overlap, alpha, outer, steps):
    """The library's run, and beside it what the schedule says, computed step by step from the
    workers' values exchanged with plain all-reduces: returns both final models."""
    comm = current()
    model = tiny_model(seed=comm.rank).double()
    opt = ClippedSGD(list(model.parameters()), 0.3, 0.05)
    outer_sgd = None if outer is None else localclip.OuterSGD(*outer)
    alg = CELGC.from_optimizer(model, opt, period, fragments=fragments, overlap=overlap, overlap_alpha=alpha,
                               outer_optimizer=outer_sgd)
    bounds = alg.averager.fragment_elements
    n_params = sum(p.numel() for p in model.parameters())
    ends = set(itertools.accumulate(TENSOR_NUMELS))
    if fragments > 1:  # the reference sees element ranges: a parameter (and its momentum) is cut between two fragments
        assert any(lo not in ends and lo < n_params for lo, _ in bounds[1:])
    ref_model = tiny_model(seed=0).double()  # rank 0's model: the broadcast
    ref = _flat(ref_model).clone()
    anchor, momentum = ref.clone(), torch.zeros_like(ref)
    sent, started = {}, {}
    offs = offsets(fragments, period)
    ref_inner = ClippedSGD(list(ref_model.parameters()), 0.3, 0.05)
    def land(live, p, lo, hi):
        """What a round's result does to fragment p: outer step on its own anchor, then the merge."""
        mean = sent.pop(p)
        new = mean.clone()
        if outer is not None:
            lr, mu, nesterov = outer
            k = min(hi, n_params) - lo if lo < n_params else 0
            delta = anchor[lo : lo + k] - mean[:k]
            momentum[lo : lo + k] = mu * momentum[lo : lo + k] + delta
            d = delta + mu * momentum[lo : lo + k] if nesterov else momentum[lo : lo + k]
            new[:k] = anchor[lo : lo + k] - lr * d
        anchor[lo:hi] = new
        live[lo:hi] = alpha * live[lo:hi] + (1 - alpha) * new

    history = []
    for t, (x, y) in enumerate(fixed_batches(comm.rank, steps), start=1):
        x = x.double()
        for m, o in ((model, alg), (ref_model, ref_inner)):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            o.step()
        with torch.no_grad():
            live = _flat(ref_model)
            for p, (lo, hi) in enumerate(bounds):
                if overlap and p in sent and t == started[p] + overlap:
                    land(live, p, lo, hi)
                if t >= offs[p] and (t - offs[p]) % period == 0:
                    values = live[lo:hi].clone()
                    comm.all_reduce([values])
                    sent[p], started[p] = values / comm.world_size, t
                    if not overlap:
                        land(live, p, lo, hi)
            # write back into the reference model
            at = 0
            for tensor in [*ref_model.parameters(), ref_model[2].running_mean, ref_model[2].running_var]:
                tensor.copy_(live[at : at + tensor.numel()].view_as(tensor))
                at += tensor.numel()
        history.append((_flat(model).clone(), _flat(ref_model).clone()))
    return history


@pytest.mark.parametrize(
    "period,fragments,overlap,alpha,outer",
    [(4, 2, 0, 0.0, None), (6, 4, 0, 0.0, (0.7, 0.9, True)), (4, 1, 2, 0.0, None), (6, 3, 1, 0.0, (0.5, 0.5, False)),
     (4, 2, 3, 0.5, (0.7, 0.9, True))],
)
def test_each_fragment_takes_its_own_rounds_with_its_own_anchor_and_momentum(period, fragments, overlap, alpha, outer):
    results = SimulatedWorld(3).run(_reference_worker, period, fragments, overlap, alpha, outer, 13)
    for history in results:
        for t, (got, want) in enumerate(history, start=1):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=f"step {t}")


def _streaming_run(steps, *, save_at=None, resume=None, period=4, **options):
    """CELGC with streaming rounds; optionally a checkpoint after step ``save_at``, or a resume
    from one. Returns the model after every step and the checkpoint."""
    comm = current()
    model = tiny_model(seed=comm.rank)
    if "outer" in options:
        options["outer_optimizer"] = localclip.OuterSGD(*options.pop("outer"))
    alg = compose("celgc", model, ClippedSGD(list(model.parameters()), 0.3, 0.05), period, **options)
    first = 0
    if resume is not None:
        state = resume[comm.rank]
        with torch.no_grad():
            model.load_state_dict(state["model"])
        alg.load_state_dict(state["algorithm"])
        first = state["step"]
    saved, after = None, []
    for t, (x, y) in enumerate(fixed_batches(comm.rank, steps), start=1):
        if t <= first:
            continue
        alg.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        alg.step()
        after.append((t, _flat(model).clone(), alg.averager.in_sync))
        if t == save_at:
            saved = {"step": t, "model": copy.deepcopy(model.state_dict()), "algorithm": copy.deepcopy(alg.state_dict())}
    alg.average()
    return {"after": after, "final": _flat(model).clone(), "saved": saved, "rounds": alg.rounds, "bytes": alg.bytes_communicated,
            "feedback": alg.averager.state_dict()["error_feedback"]}


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def test_workers_hold_the_same_fragment_after_a_merge_and_the_same_model_after_average():
    results = SimulatedWorld(2).run(_streaming_run, 11, period=4, fragments=2, overlap=1, outer=(0.7, 0.9, True), compression="bf16")
    a, b = results
    assert torch.equal(_bits(a["final"]), _bits(b["final"]))
    # Fragment 1 (offset 2) lands after steps 3, 7, 11; fragment 0 after 5, 9: whatever fragment
    # just landed is bit-identical between the workers there.
    (_, n0), _ = PeriodicAverager(tiny_model(), 4, group=localclip.comm.SingleProcess(), fragments=2).fragment_elements
    assert n0 not in set(itertools.accumulate(TENSOR_NUMELS))  # a tensor is cut between the two
    for (t, x, _), (_, y, _) in zip(a["after"], b["after"]):
        if t in (3, 7, 11):
            assert torch.equal(_bits(x[n0:]), _bits(y[n0:])) and not torch.equal(x[:n0], y[:n0]), t
        if t in (5, 9):
            assert torch.equal(_bits(x[:n0]), _bits(y[:n0])) and not torch.equal(x[n0:], y[n0:]), t
    assert not any(in_sync for _, _, in_sync in a["after"])  # with fragments the workers never share every fragment mid-run


def test_a_merge_with_alpha_keeps_part_of_the_local_progress():
    replaced = SimulatedWorld(2).run(_streaming_run, 6, period=4, overlap=1)
    mixed = SimulatedWorld(2).run(_streaming_run, 6, period=4, overlap=1, overlap_alpha=0.5)
    at5 = [dict((t, x) for t, x, _ in r["after"])[5] for r in (replaced[0], replaced[1], mixed[0], mixed[1])]
    assert torch.equal(at5[0], at5[1]) and not torch.equal(at5[2], at5[3])
    assert [t for t, _, s in replaced[0]["after"] if s] == [5]  # landed at 5, alpha 0: in sync there


@pytest.mark.parametrize(
    "options,save_at",
    [(dict(fragments=2, overlap=1), 6), (dict(fragments=2, overlap=3, outer=(0.7, 0.9, True), compression="bf16"), 6),
     (dict(overlap=2, participants=1), 5), (dict(fragments=4), 6),
     (dict(fragments=2, overlap=1, overlap_merge="carry"), 6), (dict(overlap=2, participants=1, overlap_merge="carry"), 5),
     (dict(fragments=2, overlap=3, outer=(0.7, 0.9, True), compression="bf16", overlap_merge="carry"), 6)],
)
def test_a_checkpoint_with_a_round_in_flight_resumes_bit_for_bit(options, save_at):
    straight = SimulatedWorld(3).run(_streaming_run, 14, save_at=save_at, **copy.deepcopy(options))
    saved = [r["saved"] for r in straight]
    if options.get("overlap"):
        assert saved[0]["algorithm"]["averager"]["in_flight"], "the checkpoint was meant to hold a round in flight"
    resumed = SimulatedWorld(3).run(_streaming_run, 14, resume=saved, **copy.deepcopy(options))
    for s, r in zip(straight, resumed):
        assert torch.equal(_bits(s["final"]), _bits(r["final"]))
        tail = [(t, x) for t, x, _ in s["after"] if t > save_at]
        assert [t for t, _ in tail] == [t for t, _, _ in r["after"]]
        assert all(torch.equal(_bits(x), _bits(y)) for (_, x), (_, y, _) in zip(tail, r["after"]))
        assert (s["rounds"], s["bytes"]) == (r["rounds"], r["bytes"])


@pytest.mark.parametrize(
    "options,save_at",
    [(dict(overlap=1, compression="int4"), 4),  # saved before the round advanced: the checkpoint finishes its transport
     (dict(fragments=2, overlap=3, outer=(0.7, 0.9, True), compression="int8"), 6),  # one round advanced, one just started
     (dict(overlap=2, participants=1, overlap_alpha=0.5, compression="int4", error_feedback=False), 5),
     (dict(overlap=1, compression="int4", overlap_merge="carry"), 4),
     (dict(fragments=2, overlap=3, outer=(0.7, 0.9, True), compression="int8", overlap_merge="carry"), 6)],
)
def test_a_checkpoint_with_a_low_bit_round_in_flight_resumes_bit_for_bit_with_the_residuals(options, save_at):
    """The checkpoint waits for the low-bit round's transport and saves its decoded average
    changes and the residuals it updated; the resumed run lands it after the same step. The
    straight run that took the checkpoint equals one that did not."""
    plain = SimulatedWorld(3).run(_streaming_run, 14, **copy.deepcopy(options))
    straight = SimulatedWorld(3).run(_streaming_run, 14, save_at=save_at, **copy.deepcopy(options))
    saved = [r["saved"] for r in straight]
    assert saved[0]["algorithm"]["averager"]["in_flight"], "the checkpoint was meant to hold a round in flight"
    resumed = SimulatedWorld(3).run(_streaming_run, 14, resume=saved, **copy.deepcopy(options))
    for p, s, r in zip(plain, straight, resumed):
        assert all(torch.equal(_bits(x), _bits(y)) for (_, x, _), (_, y, _) in zip(p["after"], s["after"]))
        assert torch.equal(_bits(s["final"]), _bits(r["final"])) and torch.equal(_bits(p["final"]), _bits(s["final"]))
        tail = [(t, x) for t, x, _ in s["after"] if t > save_at]
        assert [t for t, _ in tail] == [t for t, _, _ in r["after"]]
        assert all(torch.equal(_bits(x), _bits(y)) for (_, x), (_, y, _) in zip(tail, r["after"]))
        assert (s["rounds"], s["bytes"]) == (r["rounds"], r["bytes"])
        assert (s["feedback"] is None) == (options.get("error_feedback") is False)
        assert s["feedback"] is None or any(f["residual"].abs().max() > 0 for f in s["feedback"])  # there was something to carry
        for f, g in zip(s["feedback"] or [], r["feedback"] or []):
            assert torch.equal(_bits(f["residual"]), _bits(g["residual"])) and torch.equal(_bits(f["shard_residual"]), _bits(g["shard_residual"]))


def test_a_resume_with_other_fragments_or_overlap_is_refused():
    state = _single(period=4, fragments=2, overlap=1).state_dict()
    split_elsewhere = {k: v for k, v in state.items() if k != "fragment_elements"}  # as fragments of whole tensors wrote it
    for kwargs, saved, match in ((dict(fragments=1, overlap=1), state, "fragments=2 differs from this averager's fragments=1"),
                                 (dict(fragments=2), state, "overlap=1 differs from this averager's overlap=0"),
                                 (dict(fragments=2, overlap=1), split_elsewhere,
                                  r"fragment element ranges None differ from this averager's \[\[0, 114\], \[114, 227\]\]")):
        with pytest.raises(ValueError, match=match):
            _single(period=4, **kwargs).load_state_dict(saved)


def _carry_by_hand(steps, period, fragments, overlap):
    """A carry averager stepped by hand: at each landing, what it made of the live fragment, and
    ``average(snapshot) + (live − snapshot)`` computed here from the values it sent (float32:
    each scaled by float32(1/K), summed by the same all-reduce)."""
    comm = current()
    model = tiny_model(seed=comm.rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    avg = PeriodicAverager(model, period, fragments=fragments, overlap=overlap, overlap_merge="carry")
    bounds = avg.fragment_elements
    inv = torch.full((1,), 1.0 / comm.world_size, dtype=torch.float32)
    sent, checked = {}, []
    for t, (x, y) in enumerate(fixed_batches(comm.rank, steps), start=1):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        live = torch.cat([v.clone() for v in avg.flat_buffers])
        landing = [p for p, (s, _) in sent.items() if s + overlap == t]
        want = {}
        for p in landing:
            (lo, hi), (_, snapshot) = bounds[p], sent.pop(p)
            mean = snapshot * inv
            comm.all_reduce([mean])
            want[p] = mean[lo:hi] + (live[lo:hi] - snapshot[lo:hi])
        avg.step()
        after = torch.cat([v.clone() for v in avg.flat_buffers])
        for p in landing:
            lo, hi = bounds[p]
            checked.append((t, p, after[lo:hi], want[p], live[lo:hi]))
        for flight in avg._in_flight:
            if flight.started == t:
                sent[flight.fragment] = (t, live)
    return checked


@pytest.mark.parametrize("fragments,overlap", [(1, 1), (2, 1), (2, 3)])
def test_a_carry_merge_is_the_average_of_the_snapshot_plus_the_local_progress_since(fragments, overlap):
    results = SimulatedWorld(3).run(_carry_by_hand, 13, 4, fragments, overlap)
    assert len(results[0]) >= 3 * fragments - 1
    for checked in results:
        for t, p, got, want, live in checked:
            assert torch.equal(_bits(got), _bits(want)), (t, p)
            assert not torch.equal(got, live), (t, p)
    for (t, p, a, _, _), (_, _, b, _, _) in zip(results[0], results[1]):
        assert not torch.equal(a, b), (t, p)  # each worker kept its own steps


def test_a_carry_merge_keeps_the_steps_a_replacing_merge_drops():
    replaced = SimulatedWorld(2).run(_streaming_run, 6, period=4, overlap=1)
    carried = SimulatedWorld(2).run(_streaming_run, 6, period=4, overlap=1, overlap_merge="carry")
    at = [dict((t, x) for t, x, _ in r["after"]) for r in (*replaced, *carried)]
    assert torch.equal(at[0][4], at[2][4]) and torch.equal(at[1][4], at[3][4])  # the same until the landing
    assert not torch.equal(at[2][5], at[3][5]) and not torch.equal(at[0][5], at[2][5])
    assert not any(s for _, _, s in carried[0]["after"])  # never in sync mid-run: each worker keeps its steps
    assert torch.equal(_bits(carried[0]["final"]), _bits(carried[1]["final"]))  # average() lands and syncs


def test_only_a_carry_checkpoint_saves_the_snapshot_of_a_round_in_flight():
    for merge in ("mix", "carry"):
        saved = SimulatedWorld(2).run(_streaming_run, 5, save_at=4, period=4, overlap=1, overlap_merge=merge)[0]["saved"]
        averager = saved["algorithm"]["averager"]
        (flight,) = averager["in_flight"]
        assert averager["overlap_merge"] == merge and ("snapshot" in flight) == (merge == "carry")
        if merge == "carry":
            model = saved["model"]  # the round started after the step the checkpoint was taken at
            assert torch.equal(torch.cat(flight["snapshot"]), torch.cat([model[name].reshape(-1) for name in TENSORS]))


def test_a_resume_with_another_overlap_merge_is_refused():
    carry = _single(period=4, overlap=1, overlap_merge="carry").state_dict()
    mix = _single(period=4, overlap=1).state_dict()
    old = {k: v for k, v in mix.items() if k != "overlap_merge"}  # written before the option existed
    with pytest.raises(ValueError, match="Checkpoint overlap_merge=carry differs from this averager's overlap_merge=mix"):
        _single(period=4, overlap=1).load_state_dict(carry)
    with pytest.raises(ValueError, match="Checkpoint overlap_merge=mix differs from this averager's overlap_merge=carry"):
        _single(period=4, overlap=1, overlap_merge="carry").load_state_dict(old)
    _single(period=4, overlap=1).load_state_dict(old)


def test_rounds_send_one_fragment_each_and_every_period_syncs_everything_once():
    run = SimulatedWorld(2).run(_streaming_run, 8, period=4, fragments=4)
    plain = SimulatedWorld(2).run(_streaming_run, 8, period=4)
    # 8 steps: plain takes 2 rounds (after 4, 8; the final average is skipped); four fragments
    # take 8, one per step, and the final average sends what differs (all but fragment 0).
    assert plain[0]["rounds"] == 2 and run[0]["rounds"] == 8 + 3
    weight = 4
    full = (plain[0]["bytes"] - 2 * weight) // 2
    sizes = PeriodicAverager(tiny_model(), 4, group=localclip.comm.SingleProcess(), fragments=4).fragment_bytes
    assert sum(sizes) == full
    assert run[0]["bytes"] == 2 * (full + 4 * weight) + (full - sizes[0]) + 3 * weight


def test_global_clipping_refreshes_its_reference_norm_after_each_started_round():
    def worker():
        comm = current()
        model = tiny_model(seed=comm.rank)
        alg = CELGC(model, lr=0.3, gamma=0.05, period=4, clip_mode="global_average", fragments=2, overlap=1)
        for x, y in fixed_batches(comm.rank, 8):
            alg.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            alg.step()
        alg.average()
        return _flat(model), alg.averager.rounds, alg._extra_reductions

    (a, rounds, extra), (b, _, _) = SimulatedWorld(2).run(worker)
    # Rounds start after steps 2, 4, 6, 8; the final average lands step 8's and averages
    # fragment 1 (changed since it landed after step 7). The norm is refreshed at step 1 and
    # after each started round but the last: steps 3, 5, 7.
    assert (rounds, extra) == (5, 4)
    assert torch.equal(_bits(a), _bits(b))


# -- evaluations inside an epoch: the mean of the workers' live models -------------------------


def _flight_state(avg):
    """What the algorithm holds between rounds: rounds in flight (the objects, whether their
    transport arrived), snapshots, anchors, outer momentum, residuals and counters, copied."""
    return {
        "flights": [(id(f), f.fragment, f.index, f.total, f.results is None) for f in avg._in_flight],
        "snapshots": [s.clone() for s in getattr(avg, "_snapshots", [])],
        "anchors": [None if b.anchor is None else b.anchor.clone() for b in avg._buckets],
        "outer": copy.deepcopy(avg.outer.state_dict()) if avg.outer is not None else None,
        "feedback": [copy.deepcopy(f.state_dict()) for f in avg._feedback or []],
        "counters": (avg.rounds, avg.bytes_communicated, avg.nonfinite_rounds, list(avg.schedule.synced_at)),
    }


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _evaluated_streaming_run(steps, evaluate_at, **options):
    """A streaming CELGC run that swaps in the mean of the live models after the steps in
    ``evaluate_at``; returns what each swap held, whether the algorithm's state was left as it
    was, and the final model."""
    from localclip.train.live_mean import LiveMean

    comm = current()
    model = tiny_model(seed=comm.rank)
    if "outer" in options:
        options["outer_optimizer"] = localclip.OuterSGD(*options.pop("outer"))
    alg = compose("celgc", model, ClippedSGD(list(model.parameters()), 0.3, 0.05), 4, **options)
    mean = LiveMean(model, comm)
    seen = []
    for t, (x, y) in enumerate(fixed_batches(comm.rank, steps), start=1):
        alg.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        alg.step()
        if t in evaluate_at:
            # A started round's transport writes its buffers until every worker has started it:
            # past this barrier, in the simulation, they hold what they will hold at the landing.
            comm.barrier()
            own, state = _flat(model).clone(), _flight_state(alg.averager)
            everyone = own.clone().unsqueeze(0).repeat(comm.world_size, 1)
            everyone[[i for i in range(comm.world_size) if i != comm.rank]] = 0
            comm.all_reduce([everyone])  # every worker's live model, to check the mean against
            with mean.swapped_in():
                swapped = _flat(model).clone()
            seen.append({"step": t, "in_flight": bool(alg.averager._in_flight), "swapped": swapped, "everyone": everyone,
                         "untouched": _same(state, _flight_state(alg.averager)), "restored": torch.equal(_bits(own), _bits(_flat(model)))})
    alg.average()
    return {"seen": seen, "final": _flat(model).clone(), "rounds": alg.rounds, "bytes": alg.bytes_communicated}


@pytest.mark.parametrize(
    "options",
    [dict(fragments=2, overlap=3, outer=(0.7, 0.9, True), compression="int8"), dict(fragments=4, compression="bf16"),
     dict(overlap=2, overlap_alpha=0.5)],
)
def test_the_mean_of_the_live_models_leaves_rounds_in_flight_anchors_and_residuals_alone(options):
    at = {2, 3, 5, 6, 7, 9}
    plain = SimulatedWorld(3).run(_evaluated_streaming_run, 12, set(), **copy.deepcopy(options))
    evaluated = SimulatedWorld(3).run(_evaluated_streaming_run, 12, at, **copy.deepcopy(options))
    if options.get("overlap"):
        assert any(s["in_flight"] for s in evaluated[0]["seen"]), "meant to evaluate with a round in flight"
    for p, e in zip(plain, evaluated):
        assert torch.equal(_bits(p["final"]), _bits(e["final"])) and (p["rounds"], p["bytes"]) == (e["rounds"], e["bytes"])
        assert [s["step"] for s in e["seen"]] == sorted(at)
        for s in e["seen"]:
            assert s["untouched"] and s["restored"], s["step"]
            torch.testing.assert_close(s["swapped"], s["everyone"].mean(0), rtol=1e-6, atol=1e-7)
            assert not all(torch.equal(s["everyone"][0], s["everyone"][i]) for i in (1, 2)), s["step"]  # the workers differ there
    for a, b in itertools.combinations([e["seen"] for e in evaluated], 2):
        assert all(torch.equal(_bits(x["swapped"]), _bits(y["swapped"])) for x, y in zip(a, b))  # every worker scores the same model


def test_a_non_finite_worker_is_left_out_of_the_mean_of_the_live_models():
    from localclip.train.live_mean import LiveMean

    def worker(bad):
        comm = current()
        model = tiny_model(seed=comm.rank)
        if comm.rank in bad:
            with torch.no_grad():
                model[0].weight[0, 0] = float("nan")
        own = _flat(model).clone()
        everyone = own.unsqueeze(0).repeat(comm.world_size, 1)
        everyone[[i for i in range(comm.world_size) if i != comm.rank]] = 0
        comm.all_reduce([everyone])
        with LiveMean(model, comm).swapped_in():
            swapped = _flat(model).clone()
        return swapped, everyone, torch.equal(_bits(own), _bits(_flat(model)))

    (swapped, everyone, restored), *_ = SimulatedWorld(3).run(worker, {1})
    assert restored and torch.isfinite(swapped).all()
    torch.testing.assert_close(swapped, everyone[[0, 2]].mean(0))
    (swapped, _, restored), *_ = SimulatedWorld(3).run(worker, {0, 1, 2})
    assert restored and torch.isnan(swapped).all()  # nothing left to average: the evaluation sees a diverged model


EVAL_ARGS = ["ptb-small", "--workers", "2", "--period", "3", "--fragments", "2", "--overlap", "2", "--set", "checkpoint_interval=5",
             "--set", "keep_checkpoints=10"]


def _train(out, *args):
    from localclip.cli import main
    from helpers import SMOKE

    assert main(["train", *EVAL_ARGS, *args, "--out", str(out), *SMOKE]) == 0


def _records(out):
    import json

    return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


def _summary(out):
    import json

    return {k: v for k, v in json.loads((out / "summary.json").read_text()).items() if not k.startswith("time/")}


def test_evaluations_inside_an_epoch_of_a_streaming_run_leave_its_training_untouched(tmp_path):
    """Fragments on offsets 0 and 1 of period 3, rounds landing 2 steps late, an outer step with
    momentum and int4 residuals; validations every 4 steps (not a multiple of the period): the
    same model bits, training records and checkpoints (but for the movement since the last
    evaluation and the timings) as the same run validated only at its end."""
    streaming = ["--max-steps", "14", "--outer-optimizer", "nesterov", "--compression", "int4"]
    _train(tmp_path / "plain", *streaming)
    _train(tmp_path / "evaluated", *streaming, "--set", "eval_interval=4")
    plain, evaluated = _records(tmp_path / "plain"), _records(tmp_path / "evaluated")
    assert [r for r in plain if "train/loss" in r] == [r for r in evaluated if "train/loss" in r]
    assert _summary(tmp_path / "plain") == _summary(tmp_path / "evaluated")  # model/sha256, rounds, bytes, the final scores
    mid = [r for r in evaluated if "val/loss" in r and not r.get("final")]
    assert [r["step"] for r in mid] == [4, 8, 12] and not [r for r in plain if "val/loss" in r and not r.get("final")]
    assert all(math.isfinite(r["val/ppl"]) and r["move/path"] > 0 for r in mid)
    trained = {r["step"]: r["comm/rounds"] for r in evaluated if "train/loss" in r}
    assert all(r["comm/rounds"] == trained[r["step"]] for r in mid if r["step"] in trained)  # no round of its own
    for step in (5, 10, 14):
        for rank in (0, 1):
            a, b = (torch.load(tmp_path / run / "checkpoints" / f"step-{step}" / f"rank-{rank}.pt", weights_only=True)
                    for run in ("plain", "evaluated"))
            evaluation_only = {"move_from", "path", "time_compute", "time_comm"}
            assert a.keys() == b.keys() and _same({k: v for k, v in a.items() if k not in evaluation_only},
                                                  {k: v for k, v in b.items() if k not in evaluation_only}), (step, rank)
            assert a["algorithm"]["averager"]["in_flight"] or step == 14  # a round was in flight at the mid-run ones


@pytest.mark.full  # spawned processes
def test_evaluations_inside_an_epoch_of_a_streaming_run_resume_and_spawn_as_the_straight_simulated_run(tmp_path):
    """A resume from the step-10 checkpoint (a round in flight) continues with the same
    evaluation records; gloo processes score the same bits as simulated workers (three: gloo
    then sums in rank order by its own phases, with the rounds in flight between them)."""
    streaming = ["--workers", "3", "--set", "eval_interval=4"]
    _train(tmp_path / "straight", "--max-steps", "16", *streaming)
    _train(tmp_path / "run", "--max-steps", "10", *streaming)
    _train(tmp_path / "run", "--max-steps", "16", "--resume", *streaming)
    straight = _records(tmp_path / "straight")
    evaluations = [r for r in straight if "val/loss" in r]
    assert [r["step"] for r in evaluations] == [4, 8, 12, 16, 16]  # the mean of the live models at the end, then the final
    assert evaluations[-1]["val/loss"] != evaluations[-2]["val/loss"]  # the final one scores the model after the averaging
    assert _records(tmp_path / "run") == straight and _summary(tmp_path / "run") == _summary(tmp_path / "straight")
    _train(tmp_path / "spawn", "--max-steps", "16", *streaming, "--runtime", "spawn", "--set", "threads=1")
    assert _records(tmp_path / "spawn") == straight and _summary(tmp_path / "spawn") == _summary(tmp_path / "straight")
