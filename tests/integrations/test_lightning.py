"""localclip.integrations.lightning refuses, in one line naming the value, what would change the
algorithm or what it cannot average, and passes the algorithm's options through. (The
two-process runs are tests/integrations/test_examples.py's.)"""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                reason="PyTorch Lightning not installed (pip install 'localclip[lightning]')")

# Each case fits a tiny module in a world of one process (Lightning's own group, gloo) and
# prints the error it raised; one subprocess for all, so that no process group is left in pytest's.
REFUSALS = textwrap.dedent('''
    import json, sys
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import lightning as L
    from lightning.pytorch.plugins import MixedPrecision
    from localclip.integrations.lightning import LocalclipStrategy
    from localclip.optim import ClippedSGD
    from localclip.averaging.outer import OuterSGD

    class Tiny(L.LightningModule):
        def __init__(self, optimizers=1, subset=False, bn=False):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)
            self.bn = nn.BatchNorm1d(4) if bn else None
            self.n, self.subset = optimizers, subset
            self.automatic_optimization = optimizers == 1

        def training_step(self, batch, batch_idx):
            h = self.a(batch[0])
            loss = self.b(self.bn(h) if self.bn is not None else h).pow(2).mean()
            if self.automatic_optimization:
                return loss
            self.manual_backward(loss)
            for opt in self.optimizers():
                opt.step()
                opt.zero_grad()

        def configure_optimizers(self):
            if self.n == 2:
                return ClippedSGD(self.a.parameters(), lr=0.1, gamma=1.0), ClippedSGD(self.b.parameters(), lr=0.1, gamma=1.0)
            return ClippedSGD(self.a.parameters() if self.subset else self.parameters(), lr=0.1, gamma=1.0)

    def fit(module=None, strategy=None, **trainer_options):
        loader = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=8)
        options = dict(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, enable_model_summary=False)
        trainer = L.Trainer(strategy=strategy or LocalclipStrategy(period=2), **{**options, **trainer_options})
        try:
            trainer.fit(module or Tiny(), loader)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        a = trainer.strategy.algorithm
        return f"trained: {type(a).__name__} {a.period} {type(a.averager.outer).__name__} {a.averager.compression} {a.averager.fragments} {a.averager.overlap}"

    out = {
        "gradient_clip_val": fit(gradient_clip_val=1.0),
        "sync_batchnorm": fit(Tiny(bn=True), sync_batchnorm=True),
        # Lightning turns precision="16-mixed" into bf16 on CPUs: the plugin, as on a GPU.
        "fp16": fit(plugins=[MixedPrecision("16-mixed", "cpu")]),
        "two_optimizers": fit(Tiny(optimizers=2)),
        "subset": fit(Tiny(subset=True)),
        "plain": fit(),
        "options": fit(strategy=LocalclipStrategy(4, "episode", outer_optimizer=OuterSGD(0.7, 0.9, nesterov=True), compression="int8")),
        "streaming": fit(strategy=LocalclipStrategy(period=4, compression="int4", fragments=2, overlap=1)),
    }
    print("RESULT " + json.dumps(out))
    from localclip.comm import distributed
    distributed.exit_process(0)
''')


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    script = tmp_path_factory.mktemp("lightning") / "refusals.py"
    script.write_text(REFUSALS)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env={**env, "OMP_NUM_THREADS": "1"}, cwd=script.parent)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(line[len("RESULT "):])


def one_line(message: str) -> str:
    assert "\n" not in message, message
    return message


def test_lightnings_gradient_clipping_is_refused(refusals):
    msg = one_line(refusals["gradient_clip_val"])
    assert msg.startswith("ConfigError: Invalid Trainer(gradient_clip_val=1.0)") and "gamma" in msg, msg


def test_sync_batchnorm_is_refused(refusals):
    assert one_line(refusals["sync_batchnorm"]).startswith("ConfigError: Invalid Trainer(sync_batchnorm=True)"), refusals


def test_fp16_loss_scaling_is_refused(refusals):
    msg = one_line(refusals["fp16"])
    assert msg.startswith("ConfigError: Invalid precision='16-mixed'") and "bf16-mixed" in msg, msg


def test_several_optimizers_are_refused(refusals):
    msg = one_line(refusals["two_optimizers"])
    assert msg.startswith("ConfigError: Invalid configure_optimizers") and "returned 2 optimizers" in msg, msg


def test_an_optimizer_over_part_of_the_model_is_refused(refusals):
    msg = one_line(refusals["subset"])
    assert "Invalid optimizer" in msg and "trainable parameters" in msg, msg


def test_the_algorithm_and_round_options_reach_the_algorithm(refusals):
    assert refusals["plain"] == "trained: CELGC 2 NoneType none 1 0", refusals
    assert refusals["options"] == "trained: EPISODE 4 OuterSGD int8 1 0", refusals
    assert refusals["streaming"] == "trained: CELGC 4 NoneType int4 2 1", refusals


def test_constructor_refuses_bad_values():
    from localclip.errors import ConfigError
    from localclip.integrations.lightning import LocalclipStrategy

    with pytest.raises(ConfigError, match=r"Invalid period: 0 "):
        LocalclipStrategy(period=0)
    with pytest.raises(ConfigError, match=r"Invalid algorithm: 'local-sgd' \(expected one of celgc, naive, episode\)"):
        LocalclipStrategy(algorithm="local-sgd")
