"""`localclip report NAME --check`: today's code reruns each committed run's first logged interval."""

import json

import pytest

from localclip.cli import main

from test_train import SHARED, SMOKE

pytestmark = pytest.mark.skipif(not (SHARED / "ptbdataset" / "train.txt").exists(), reason="PTB corpus not found")


def test_check_reruns_the_first_interval_and_catches_a_changed_number(tmp_path, capsys):
    sweep = tmp_path / "sweeps" / "mine"
    for name, algorithm in (("celgc", "celgc"), ("naive", "naive")):
        assert main(["train", "ptb-small", *SMOKE, "--algorithm", algorithm, "--workers", "2", "--period", "2", "--max-steps", "6",
                     "--set", "threads=1", "--out", str(sweep / name)]) == 0
    capsys.readouterr()
    assert main(["report", "mine", "--root", str(tmp_path / "sweeps"), "--check", "--data-root", str(SHARED)]) == 0
    out = capsys.readouterr().out
    assert out.count(": same (made by ") == 2 and "2 of 2 runs reproduced" in out

    # A committed number that today's code does not produce is reported, and the check fails.
    metrics = sweep / "naive" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    first = next(r for r in records if "train/loss" in r)
    first["train/loss"] *= 1 + 1e-5
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["report", "mine", "--root", str(tmp_path / "sweeps"), "--check", "--only", "naive", "--data-root", str(SHARED)]) == 1
    out = capsys.readouterr().out
    assert "DIFFERS" in out and "0 of 1 runs reproduced; differ: naive" in out
