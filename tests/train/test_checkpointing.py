"""A worker's checkpoint, written and restored by its owner (localclip.train.checkpointing), gives
back the worker's state bit for bit, and a restored worker's next step equals the original's."""

import copy

import torch

from localclip import devices
from localclip.comm import SimulatedWorld, current
from localclip.recipes import get_recipe
from localclip.train import RunFolder, Trainer
from localclip.train.trainer import state_hash
from localclip.algorithms import build
from helpers import CUSTOM, SHARED

STEPS = 4  # past the first round (period 3), within the first logging interval


def assert_same(a, b, where="state"):
    """Equal nested checkpoint states: same keys, and tensors equal in dtype, shape and every bit."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), where  # NaN stands for NaN


def step(trainer, batches):
    batch, scale = next(batches)
    trainer.position += 1
    loss = trainer.train_step(batch, scale, sample_mean_gradient=True)
    trainer.step += 1
    trainer.metrics.count_loss(loss)


def test_a_checkpoint_restores_the_worker_bit_for_bit_and_its_next_step_is_the_same(tmp_path):
    config = build.resolved(get_recipe("ptb-small").replace(
        workers=2, period=3, data_root=str(SHARED), allow_custom_corpus=CUSTOM, threads=1,
        model_options={**get_recipe("ptb-small").workload.model_options, "dropout": 0.3},  # the worker's random stream matters
    ))
    run = RunFolder(tmp_path / "run")
    run.checkpoints.mkdir(parents=True)

    def worker():
        rank = current().rank
        original = Trainer(config, run, progress=False)
        original.workload.start_epoch(0)
        batches = original.workload.batches()
        for _ in range(STEPS):
            step(original, batches)
        original.save_checkpoint()
        saved = copy.deepcopy(devices.to_cpu(original.state_dict()))

        restored = Trainer(config, None, progress=False)
        restored.resume(run.load_worker_checkpoint(f"step-{STEPS}", rank))
        restored.workload.start_epoch(restored.epoch)
        assert restored.checkpointer.restore_pending(restored) and not restored.checkpointer.pending
        assert restored.step == STEPS and restored.position == STEPS
        assert_same(saved, devices.to_cpu(restored.state_dict()))

        step(original, batches)
        step(restored, restored.workload.batches())
        return state_hash(original.model), state_hash(restored.model), original.metrics.state_dict(), restored.metrics.state_dict()

    for hash_a, hash_b, metrics_a, metrics_b in SimulatedWorld(2).run(worker):
        assert hash_a == hash_b
        for key in ("interval", "step_stats", "path", "move_from"):
            assert_same(metrics_a[key], metrics_b[key], key)
