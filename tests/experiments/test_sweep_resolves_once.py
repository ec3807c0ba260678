"""A sweep resolves each run's config once (:func:`localclip.algorithms.build.resolved`): the
plan asks the algorithm's spec for its workers and period instead of resolving, and the checks,
``sweep.json``, the printed lines and the run itself all read the one resolved config."""

import json

import pytest

import localclip_lab as sweeps
from localclip.algorithms import build
from localclip.cli import main
from localclip_lab import runner

from helpers import SHARED, SMALL


@pytest.fixture
def resolutions(monkeypatch) -> list[str]:
    """The config (as JSON) of every call of the builder's resolve, which every resolution makes."""
    seen: list[str] = []
    real = build.resolve

    def counting(config):
        seen.append(config.to_json())
        return real(config)

    monkeypatch.setattr(build, "resolve", counting)
    return seen


def test_planning_a_sweep_resolves_nothing(resolutions):
    runs = sweeps.plan("isweep")
    assert len(runs) == 9 and resolutions == []


def test_a_sweep_job_resolves_each_config_once_and_runs_the_resolved_one(tmp_path, resolutions, monkeypatch):
    handed = []

    def fake_run(config, out, **kwargs):
        handed.append(config)
        return {"steps": 1}

    monkeypatch.setattr(runner, "run_resolved", fake_run)
    outcomes = sweeps.run_sweep("isweep", tmp_path, data_root=str(SHARED), only=["naive"], max_steps=1, overrides=SMALL, echo=lambda _: None)
    assert outcomes == {"naive": "started"}
    planned = len(sweeps.plan("isweep"))
    assert len(resolutions) == planned == len(set(resolutions))  # every run's config, each once
    assert len(handed) == 1 and handed[0] == build.resolved(handed[0])  # the run is handed its config resolved
    status = json.loads((tmp_path / "isweep" / "sweep.json").read_text())
    assert {r["name"]: r["period"] for r in status["runs"]}["naive"] == 1


@pytest.mark.full  # a real one-step run over the test corpus
def test_one_localclip_sweep_run_resolves_each_planned_config_once(tmp_path, resolutions):
    argv = ["sweep", "isweep", "--root", str(tmp_path), "--only", "celgc-I4", "--max-steps", "1", "--data-root", str(SHARED),
            *[arg for item in SMALL for arg in ("--set", item)]]
    assert main(argv) == 0
    assert (tmp_path / "isweep" / "celgc-I4" / "summary.json").is_file()
    assert len(resolutions) == len(sweeps.plan("isweep")) == len(set(resolutions))
