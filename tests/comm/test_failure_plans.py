"""Failure plans in the simulator (localclip.comm.membership): who computes, who is averaged,
heals from a live peer, the records, and bad plans refused in one line."""

import copy
import json

import pytest
import torch
from torch import nn

from localclip import rng
from localclip.algorithms import CELGC
from localclip.cli import main
from localclip.comm import SimulatedWorld, current
from localclip.comm.membership import Absence, PlannedMembership, check_plan, parse_plan
from helpers import SMOKE_DATA


def _flat(model):
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _worker(plan, steps, period):
    comm = current()
    with rng.seeded(0):
        model = nn.Linear(4, 3)
    algorithm = CELGC(model, lr=0.1, gamma=1.0, period=period, momentum=0.9)
    membership = PlannedMembership(plan, comm, period)

    def state():
        return {"model": model.state_dict(), "algorithm": algorithm.state_dict()}

    def load(s):
        s = copy.deepcopy(s)
        model.load_state_dict(s["model"])
        algorithm.load_state_dict(s["algorithm"])

    membership.attach(state, load)
    algorithm.averager.use_membership(membership)
    g = torch.Generator().manual_seed(100 + comm.rank)
    log = {}
    for step in range(1, steps + 1):
        x = torch.randn(8, 4, generator=g)
        computes = membership.computes(step, algorithm.averager.schedule.last_round_step)
        before = _flat(model)
        if computes:
            algorithm.zero_grad()
            model(x).pow(2).sum().backward()
            algorithm.optimizer.step()
        pre = _flat(model)
        algorithm.averager.step()
        momentum = [algorithm.optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters() if "momentum_buffer" in algorithm.optimizer.state[p]]
        log[step] = dict(computes=computes, before=before, pre=pre, post=_flat(model), momentum=momentum)
    return log, algorithm.averager.take_quorums()


def test_a_departed_worker_is_out_of_every_round_and_heals_from_a_live_peer():
    # Worker 1 leaves after its 3rd step and heals at the first round at a step >= 9 (step 12).
    logs = SimulatedWorld(3).run(_worker, parse_plan("1@3:9"), 16, 4)
    quorums = logs[0][1]
    assert quorums == [(4, 2, 2), (8, 2, 2), (12, 3, 2), (16, 3, 3)]
    assert all(log[1] == quorums for log in logs)  # every worker derives the same quorums
    logs = [log[0] for log in logs]
    assert [s for s in range(1, 17) if not logs[1][s]["computes"]] == list(range(4, 13))
    averaged = {4: [0, 2], 8: [0, 2], 12: [0, 2], 16: [0, 1, 2]}
    for step, ranks in averaged.items():
        mean = sum(logs[r][step]["pre"] for r in ranks) / len(ranks)
        for r in range(3):
            # Everyone, the departed worker and the joiner included, holds the average of the live models.
            assert torch.equal(logs[r][step]["post"], logs[0][step]["post"])
            torch.testing.assert_close(logs[r][step]["post"], mean, rtol=0, atol=1e-6)
    # No round averages the joiner's zeros or its stale model: at step 12 the mean is of 0 and 2 alone
    # (a divisor of 3 would shrink it by a third).
    assert not torch.allclose(logs[0][12]["post"], sum(logs[r][12]["pre"] for r in (0, 2)) / 3, atol=1e-3)
    # The joiner took its peer's (rank 0's) optimizer state, and computes from step 13 on.
    for mine, peer in zip(logs[1][12]["momentum"], logs[0][12]["momentum"]):
        assert torch.equal(mine, peer)
    assert all(logs[1][s]["computes"] for s in range(13, 17))
    # While away, its model moves only by the rounds it receives.
    assert torch.equal(logs[1][5]["pre"], logs[1][4]["post"])


def test_a_plan_is_deterministic():
    runs = [SimulatedWorld(3).run(_worker, parse_plan("1@3:9,2@13:14"), 20, 4) for _ in range(2)]
    for (a, qa), (b, qb) in zip(*runs):
        assert qa == qb
        assert all(torch.equal(a[s]["post"], b[s]["post"]) for s in a)
    assert runs[0][0][1][-2:] == [(16, 3, 2), (20, 3, 3)]  # 2 left after step 13 and healed at 16


@pytest.mark.parametrize("spec, message", [
    ("3@200", "expected RANK@LEAVE:REJOIN"),
    ("1@400:200", "must come after the leave step"),
    ("x@1:2", "expected RANK@LEAVE:REJOIN"),
])
def test_parse_plan_refuses_bad_values_naming_them(spec, message):
    with pytest.raises(ValueError, match=message) as info:
        parse_plan(spec)
    assert spec in str(info.value) and "\n" not in str(info.value)


def test_check_plan_refuses_unknown_ranks_overlaps_and_empty_rounds():
    with pytest.raises(ValueError, match="rank 3 is not a worker"):
        check_plan(parse_plan("3@10:20"), 3)
    with pytest.raises(ValueError, match="already away"):
        check_plan(parse_plan("1@10:20,1@15:30"), 3)
    with pytest.raises(ValueError, match="every worker would be away"):
        check_plan(parse_plan("0@10:20,1@12:30"), 2)
    # A heal may come up to a period after the rejoin step: the next absence must not start before.
    with pytest.raises(ValueError, match="every worker would be away"):
        check_plan(parse_plan("0@10:20,1@22:30"), 2, period=8)
    check_plan(parse_plan("0@10:20,1@22:30"), 2, period=2)
    assert parse_plan(["1@2:3"]) == (Absence(1, 2, 3),)


# -- the CLI ----------------------------------------------------------------------------------

ARGS = ["--period", "4", "--max-steps", "16", "--set", "log_interval=4", "--set", "eval_tokens=1000", "--no-progress"]


def _train(tmp_path, name, extra):
    out = tmp_path / name
    assert main(["train", "ptb-small", "--workers", "3", "--out", str(out), *SMOKE_DATA, *ARGS, *extra]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return records, json.loads((out / "summary.json").read_text())


def test_train_with_a_failure_plan_records_each_rounds_quorum_and_repeats_to_the_bit(tmp_path):
    records, summary = _train(tmp_path, "a", ["--fail", "2@6:9"])
    quorums = [q for r in records for q in r.get("comm/quorums", [])]
    assert quorums == [[4, 3, 3], [8, 2, 2], [12, 3, 2], [16, 3, 3]]
    assert summary["comm/discarded_rounds"] == 0
    again, summary_again = _train(tmp_path, "b", ["--set", 'fail=["2@6:9"]'])  # the config field, as sweeps set it
    assert [r.get("train/loss") for r in again] == [r.get("train/loss") for r in records]
    assert summary_again["model/sha256"] == summary["model/sha256"]
    plain, plain_summary = _train(tmp_path, "c", [])
    assert plain_summary["model/sha256"] != summary["model/sha256"]  # the plan changed the run
    assert "comm/quorums" not in plain[0]


@pytest.mark.parametrize("extra, message", [
    (["--fail", "5@1:9"], "rank 5 is not a worker"),
    (["--fail", "1@9:3"], "must come after the leave step"),
    (["--fail", "1@2:9", "--fragments", "2"], "Invalid fragments"),
    (["--fail", "1@2:9", "--compression", "int8"], "Invalid compression"),
    (["--fail", "1@2:9", "--algorithm", "naive"], "Invalid algorithm"),
    (["--fail", "1@2:9", "--runtime", "spawn"], "failure plans run in the simulator"),
])
def test_train_refuses_a_bad_plan_in_one_line_and_leaves_no_folder(tmp_path, capsys, extra, message):
    out = tmp_path / "run"
    code = main(["train", "ptb-small", "--workers", "3", "--out", str(out), *SMOKE_DATA, *ARGS, *extra])
    err = capsys.readouterr().err
    assert code != 0
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
