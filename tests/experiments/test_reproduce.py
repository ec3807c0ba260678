"""`localclip report NAME --check`: today's code reruns each committed run's first logged interval."""

import json

import pytest

from localclip.cli import main

from helpers import SHARED, SMOKE


def test_check_reruns_up_to_the_first_round_and_catches_a_changed_number(tmp_path, capsys):
    sweep = tmp_path / "sweeps" / "mine"
    for name, algorithm in (("celgc", "celgc"), ("naive", "naive")):
        period = [] if algorithm == "naive" else ["--period", "4"]  # naive's period is 1: giving another is refused
        assert main(["train", "ptb-small", *SMOKE, "--algorithm", algorithm, "--workers", "2", *period, "--max-steps", "9",
                     "--set", "threads=1", "--out", str(sweep / name)]) == 0
    capsys.readouterr()
    assert main(["report", "mine", "--root", str(tmp_path / "sweeps"), "--check", "--data-root", str(SHARED)]) == 0
    out = capsys.readouterr().out
    assert out.count(": same (made by ") == 2 and "2 of 2 runs reproduced" in out
    # Logged every 3 steps: naive averages from step 1, so its first record is checked; CELGC's
    # first round is at step 4, so the record of steps 4-6 is, and what a round computes with it.
    assert "celgc                        steps 1-6:" in out and "naive                        steps 1-3:" in out
    metrics = sweep / "celgc" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    after_round = next(r for r in records if r.get("step") == 6 and "train/loss" in r)
    after_round["train/loss"] *= 1 + 1e-5
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["report", "mine", "--root", str(tmp_path / "sweeps"), "--check", "--only", "celgc", "--data-root", str(SHARED)]) == 1
    assert "0 of 1 runs reproduced; differ: celgc" in capsys.readouterr().out

    # A committed number that today's code does not produce is reported, and the check fails.
    metrics = sweep / "naive" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    first = next(r for r in records if "train/loss" in r)
    first["train/loss"] *= 1 + 1e-5
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["report", "mine", "--root", str(tmp_path / "sweeps"), "--check", "--only", "naive", "--data-root", str(SHARED)]) == 1
    out = capsys.readouterr().out
    assert "DIFFERS" in out and "0 of 1 runs reproduced; differ: naive" in out


def test_report_of_a_tuning_sweep_names_each_sides_best_and_writes_the_mechanism(tmp_path):
    from localclip_lab import report

    sweep = tmp_path / "tune-gamma"
    for name, algorithm, gamma in (("naive-g5", "naive", 5), ("naive-g10", "naive", 10), ("celgc-I32-g5", "celgc", 5)):
        period = [] if algorithm == "naive" else ["--period", "2"]  # naive's period is 1: giving another is refused
        assert main(["train", "ptb-small", *SMOKE, "--algorithm", algorithm, "--workers", "2", *period, "--max-steps", "6",
                     "--gamma", str(gamma), "--set", "threads=1", "--out", str(sweep / name)]) == 0
    result = report("tune-gamma", tmp_path)
    rows = {row["run"]: row for row in result["rows"]}
    naive = [rows["naive-g5"], rows["naive-g10"]]
    best = min(naive, key=lambda row: row["val/ppl"])
    assert [row["best for its side"] for row in naive] == ["yes" if row is best else "" for row in naive]
    assert rows["celgc-I32-g5"]["best for its side"] == "yes" and rows["naive-g10"]["clip norm γ/η"] == 10 / 20
    assert result["targets"]["best_gamma"] == {"naive": best["γ"], "celgc": 5}
    lines = (sweep / "mechanism.csv").read_text().splitlines()
    assert lines[0].startswith("run,epoch,grad/local_norm,grad/mean_norm,clip/fraction")
    assert len(lines) == 1 + 3  # one epoch of each run
    assert (sweep / "mechanism.png").stat().st_size > 10_000
    assert "![mechanism](mechanism.png)" in (sweep / "summary.md").read_text()
