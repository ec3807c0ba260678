"""The tests find the corpora one way, the CLI's (``localclip.data.resolve_data_root``): a PTB in
the user cache counts, and a test that needs only PTB neither skips nor fails when WikiText-2 is
absent. Each case runs in a copy of tests/ with no ``shared/`` folder beside it, no
``LOCALCLIP_DATA`` and a home of its own, as on a newcomer's machine."""

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import localclip
from localclip.data.corpora import CORPORA

from helpers import REAL_PTB, REPO, needs_real_ptb, write_tiny_ptb

SPLITS = ("train.txt", "valid.txt", "test.txt")


def newcomer(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A copy of the checkout's tests/ (and pyproject.toml) with nothing beside it, and the
    environment of a user whose only corpora are in ``HOME/.cache/localclip/data``."""
    checkout = tmp_path / "beside" / "checkout"
    shutil.copytree(REPO / "tests", checkout / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", checkout)
    env = {k: v for k, v in os.environ.items() if k not in ("LOCALCLIP_DATA", "XDG_CACHE_HOME", "PYTHONPATH")}
    env["HOME"] = str(tmp_path / "home")
    env["PYTHONPATH"] = str(Path(localclip.__file__).resolve().parents[1])  # this localclip, wherever it is installed
    return checkout, env


def cache_root(env: dict[str, str]) -> Path:
    return Path(env["HOME"]) / ".cache" / "localclip" / "data"


def test_ptb_in_the_user_cache_is_the_tests_real_ptb(tmp_path):
    checkout, env = newcomer(tmp_path)
    write_tiny_ptb(cache_root(env) / CORPORA["ptb"].folder)
    probe = "import json, helpers; print(json.dumps([str(helpers.REAL_PTB), str(helpers.REAL_DATA), str(helpers.SHARED), helpers.CUSTOM]))"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=checkout / "tests", env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    real_ptb, real_data, shared, custom = json.loads(proc.stdout.splitlines()[-1])
    assert real_ptb == shared == str(cache_root(env))
    assert real_data == "None" and custom is False  # no WikiText-2 in the cache


def test_without_any_corpus_the_tests_train_on_their_own(tmp_path):
    checkout, env = newcomer(tmp_path)
    # The small corpus lives as long as the process that wrote it: look at it from there.
    probe = ("import json, helpers; files = [(helpers.SHARED / 'ptbdataset' / s).is_file() for s in ('train.txt', 'valid.txt', 'test.txt')]; "
             "print(json.dumps([str(helpers.REAL_PTB), str(helpers.SHARED), helpers.SMOKE_DATA, files]))")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=checkout / "tests", env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    real_ptb, shared, smoke, files = json.loads(proc.stdout.splitlines()[-1])
    assert real_ptb == "None" and not shared.startswith(env["HOME"])
    assert smoke == ["--data-root", shared, "--allow-custom-corpus"]
    assert files == [True, True, True]


@needs_real_ptb
def test_tests_that_need_only_ptb_run_with_ptb_in_the_user_cache(tmp_path):
    """The download tests mirror the real PTB files; the summary test trains on PTB. With PTB
    only in the cache, each runs: none fails on a missing WikiText-2, none skips for PTB."""
    checkout, env = newcomer(tmp_path)
    folder = cache_root(env) / CORPORA["ptb"].folder
    folder.mkdir(parents=True)
    for split in SPLITS:
        os.symlink(REAL_PTB / CORPORA["ptb"].folder / split, folder / split)
    report = tmp_path / "report.xml"
    selected = ["tests/data/test_data_download.py", "tests/algorithms/test_build.py::test_the_summary_records_what_ran"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "", "-p", "no:cacheprovider", f"--junitxml={report}", *selected],
                          cwd=checkout, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:]
    cases = ET.parse(report).getroot().iter("testcase")
    skipped = {case.get("name"): case.find("skipped").get("message") for case in cases if case.find("skipped") is not None}
    assert skipped and all("WikiText-2" in reason for reason in skipped.values()), skipped
    assert all("wikitext" in name or "archive" in name for name in skipped), skipped
