"""On a GPU: the model, batches, optimizer state and flat averaging buffers live on the worker's
device, checkpoints are written device-free, and simulated workers share one GPU. Every test
here is marked ``gpu`` and skips cleanly without CUDA (``benchmarks/gpu_check.sh`` runs them)."""

import json
import math

import pytest
import torch

import localclip
from localclip.algorithms import build_algorithm
from localclip.cli import main
from localclip.comm import SimulatedWorld, current
from localclip.train import TrainConfig
from localclip.algorithms import build

from helpers import SMOKE_DATA
from workers import fixed_batches, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _celgc_on(device, steps=6):
    config = build.resolved(TrainConfig().replace(algorithm="celgc", workers=2, period=3, lr=0.5, gamma=0.05))

    def worker():
        model = tiny_model(seed=current().rank).to(device)
        alg = build_algorithm(config, model, current())
        for x, y in fixed_batches(current().rank, steps):
            alg.zero_grad()
            torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
            alg.step()
        alg.average()
        on = {t.device.type for t in alg.averager.flat_buffers} | {p.device.type for p in model.parameters()}
        return [t.detach().cpu() for t in model.state_dict().values()], alg.rounds, on

    return SimulatedWorld(2).run(worker)


def test_simulated_workers_share_one_gpu_and_match_the_cpu():
    gpu, cpu = _celgc_on("cuda"), _celgc_on("cpu")
    for (g_state, g_rounds, g_on), (c_state, c_rounds, _) in zip(gpu, cpu):
        assert g_on == {"cuda"} and g_rounds == c_rounds
        for a, b in zip(g_state, c_state):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for a, b in zip(gpu[0][0], gpu[1][0]):
        assert torch.equal(a, b)  # the workers hold the same average


@pytest.mark.parametrize("inner", ["clipped_sgd", "adamw"])
def test_a_run_on_cuda_trains_and_its_checkpoints_load_on_the_cpu(tmp_path, inner):
    out = tmp_path / "run"
    extra = ["--inner-optimizer", "adamw", "--lr", "1e-3"] if inner == "adamw" else []
    code = main(["train", "ptb-small", "--device", "cuda", "--workers", "2", "--period", "2", "--max-steps", "6", *extra,
                 "--out", str(out), *SMOKE_DATA, "--no-progress", "--set", "eval_tokens=2000"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert math.isfinite(summary["val/ppl"]) and summary["comm/rounds"] == 3
    for path in (out / "checkpoints").rglob("*.pt"):
        state = torch.load(path, map_location=None, weights_only=True)

        def devices(obj):
            if isinstance(obj, torch.Tensor):
                yield obj.device.type
            elif isinstance(obj, dict):
                for v in obj.values():
                    yield from devices(v)
            elif isinstance(obj, (list, tuple)):
                for v in obj:
                    yield from devices(v)

        assert set(devices(state)) <= {"cpu"}, path


def test_a_cuda_run_resumes_on_the_cpu(tmp_path):
    out = tmp_path / "run"
    common = ["--workers", "2", "--period", "2", "--out", str(out), *SMOKE_DATA, "--no-progress",
              "--set", "eval_tokens=2000"]
    assert main(["train", "ptb-small", "--device", "cuda", "--max-steps", "4", *common]) == 0
    assert main(["train", "ptb-small", "--device", "cpu", "--max-steps", "8", "--resume", *common]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 8


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_spawned_workers_use_nccl_one_gpu_each(tmp_path):
    out = tmp_path / "run"
    code = main(["train", "ptb-small", "--device", "cuda", "--runtime", "spawn", "--workers", "2", "--period", "2", "--max-steps", "4",
                 "--out", str(out), *SMOKE_DATA, "--no-progress", "--set", "eval_tokens=2000"])
    assert code == 0


def test_the_outer_step_and_bf16_rounds_run_on_the_gpu():
    config = build.resolved(TrainConfig().replace(algorithm="celgc", workers=2, period=2, lr=0.5, gamma=0.05, outer_optimizer="nesterov",
                         compression="bf16"))

    def worker():
        model = tiny_model(seed=current().rank).cuda()
        alg = build_algorithm(config, model, current())
        for x, y in fixed_batches(current().rank, 4):
            alg.zero_grad()
            torch.nn.functional.cross_entropy(model(x.cuda()), y.cuda()).backward()
            alg.step()
        return alg.rounds, {b.device.type for b in alg.averager.flat_buffers}

    assert SimulatedWorld(2).run(worker)[0] == (2, {"cuda"})


def test_localclip_imports_cleanly():
    assert localclip.__version__
