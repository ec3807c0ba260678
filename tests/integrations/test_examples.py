"""The scripts in examples/ run as users run them: torchrun, 2 gloo processes on the CPU, a few
steps; every worker holds the same model after the final sync and the loss fell."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

pytestmark = pytest.mark.full  # each example under torchrun: two processes

EXAMPLES = REPO / "examples"
TORCHRUN = Path(sys.executable).with_name("torchrun")


def torchrun(script, tmp_path, *args):
    if not TORCHRUN.exists():
        pytest.skip("torchrun not installed next to this Python")
    report = tmp_path / "report"
    # --standalone: torchrun picks a free port itself (no fixed ports); the timeout bounds a hang.
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(EXAMPLES / script), "--report", str(report), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = [json.loads(Path(f"{report}.rank{r}").read_text()) for r in range(2)]
    for r in results:
        assert r["identical"] and r["last_loss"] < 0.9 * r["first_loss"], r
    # Bit-identical models after the final average: the same checksum on both ranks.
    if "checksum" in results[0]:
        assert results[0]["checksum"] == results[1]["checksum"]
    return results, proc


def test_torchrun_own_model(tmp_path):
    results, _ = torchrun("torchrun_own_model.py", tmp_path, "--steps", "24", "--period", "4")
    assert results[0]["rounds"] == 24 // 4  # the final average follows a round: nothing new to send, not counted


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed (pip install 'localclip[hf]')")
def test_hf_gpt2(tmp_path):
    results, _ = torchrun("hf_gpt2.py", tmp_path, "--steps", "24", "--period", "4", "--optimizer-state", "average")
    assert results[0]["rounds"] == 24 // 4  # the final average() right after the 6th round sends nothing new: no round


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="accelerate not installed (pip install 'localclip[accelerate]')")
def test_accelerate_integration(tmp_path):
    results, _ = torchrun("accelerate_celgc.py", tmp_path, "--epochs", "1", "--period", "4")
    assert results[0]["distributed_type"].endswith("MULTI_CPU")
    steps = results[0]["steps"]
    assert steps == 2048 // 32 // 2 and results[0]["rounds"] == steps // 4


LIGHTNING = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                               reason="PyTorch Lightning not installed (pip install 'localclip[lightning]')")


@LIGHTNING
def test_lightning_integration(tmp_path):
    results, _ = torchrun("lightning_celgc.py", tmp_path, "--steps", "24", "--period", "4", "--val-every", "8")
    for r in results:
        # No DDP wrapper; every validation and the final checkpoint saw the same model on both ranks.
        assert r["model_class"] == "Classifier" and r["validated_identical"] and r["checkpoint_identical"], r
    # Validations every 8 steps find the models just averaged: no round beyond the schedule's.
    assert results[0]["steps"] == 24 and results[0]["validations"] == 3 and results[0]["rounds"] == 24 // 4


@LIGHTNING
def test_lightning_averages_before_a_validation_or_checkpoint_inside_a_period(tmp_path):
    results, _ = torchrun("lightning_celgc.py", tmp_path, "--steps", "24", "--period", "4", "--val-every", "6",
                          "--ckpt-every", "6")
    for r in results:
        assert r["validated_identical"] and r["checkpoint_identical"], r
    # Validations and ModelCheckpoint at steps 6, 12, 18, 24: those at 6 and 18 fall inside a
    # period and average first (one round each); 4 checkpoints, and the one after fit.
    assert results[0]["validations"] == 4 and results[0]["checkpoints"] == 5 and results[0]["rounds"] == 24 // 4 + 2


@LIGHTNING
def test_lightning_launcher_command_of_the_docstring_starts_two_processes(tmp_path):
    doc = (EXAMPLES / "lightning_celgc.py").read_text()
    line = next(line.strip() for line in doc.splitlines() if line.strip().startswith("python examples/lightning_celgc.py"))
    argv = line.split("#")[0].split()
    report = tmp_path / "report"
    # Without torchrun's variables, Lightning starts the other process and picks a free port itself.
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [sys.executable, str(EXAMPLES / "lightning_celgc.py"), *argv[2:], "--report", str(report)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**env, "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = [json.loads(Path(f"{report}.rank{r}").read_text()) for r in range(2)]
    assert all(r["identical"] and r["last_loss"] < 0.9 * r["first_loss"] for r in results), results
    assert results[0]["checksum"] == results[1]["checksum"] and results[0]["rounds"] == results[0]["steps"] // 4


ACCELERATE = Path(sys.executable).with_name("accelerate")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None or not ACCELERATE.exists(),
                    reason="accelerate not installed (pip install 'localclip[accelerate]')")
def test_accelerate_launch_command_of_the_docstring_starts_two_processes(tmp_path):
    doc = (EXAMPLES / "accelerate_celgc.py").read_text()
    line = next(line.strip() for line in doc.splitlines() if line.strip().startswith("accelerate launch"))
    argv = line.split("#")[0].split()
    assert argv[:2] == ["accelerate", "launch"] and argv[-1] == "examples/accelerate_celgc.py"
    report = tmp_path / "report"
    # The docstring's command as written, plus a free port (not Accelerate's fixed default) and a report.
    cmd = [str(ACCELERATE), *argv[1:-1], "--main_process_port", str(free_port()), str(EXAMPLES / "accelerate_celgc.py"),
           "--epochs", "1", "--report", str(report)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = [json.loads(Path(f"{report}.rank{r}").read_text()) for r in range(2)]
    assert all(r["identical"] and r["last_loss"] < 0.9 * r["first_loss"] for r in results), results
    assert results[0]["distributed_type"].endswith("MULTI_CPU") or results[0]["distributed_type"].endswith("MULTI_GPU")


def test_an_example_without_torchrun_says_how_to_start_it():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    scripts = ["torchrun_own_model.py", "hf_gpt2.py", "accelerate_celgc.py"]
    # Side by side: each spends its time importing torch.
    procs = [subprocess.Popen([sys.executable, str(EXAMPLES / s)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for s in scripts]
    for script, proc in zip(scripts, procs):
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (script, err)
        assert "not started by torchrun" in err and "torchrun --standalone --nproc-per-node 2" in err, script
        assert "Traceback" not in err, script
