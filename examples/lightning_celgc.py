"""CELGC inside PyTorch Lightning (see localclip.integrations.lightning).

    pip install 'localclip[lightning]'
    torchrun --standalone --nproc-per-node 2 examples/lightning_celgc.py     # or:
    python examples/lightning_celgc.py --devices 2

The second command is Lightning's own launcher: started without torchrun, the Trainer starts
the other ``--devices`` processes itself (gloo on the CPU; NCCL with ``--accelerator gpu``).

The LightningModule is a usual one whose ``configure_optimizers`` returns a ClippedSGD;
``Trainer(strategy=LocalclipStrategy(period=...))`` in place of ``strategy="ddp"`` trains it with
CELGC: each process takes clipped steps on its own batches (Lightning's distributed sampler) and
the models are averaged every ``--period`` steps, and before every validation and checkpoint. At
the end the script checks that every process holds the same model, that every validation and
every checkpoint saw the same model on every process, and that the loss fell (exit status 1
otherwise); ``--report PATH`` writes this process's numbers to ``PATH.rankR`` (and the
checkpoints to ``PATH.ckpt`` and ``PATH.ckpts/``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def data(n: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=gen)
    teacher = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, (x @ teacher).argmax(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--period", type=int, default=4, help="average the models every this many steps")
    parser.add_argument("--val-every", type=int, default=8, help="validate every this many steps")
    parser.add_argument("--ckpt-every", type=int, default=0, help="ModelCheckpoint every this many steps (0: none)")
    parser.add_argument("--devices", type=int, default=2, help="processes Lightning starts without torchrun")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--report")
    args = parser.parse_args()
    try:
        import lightning as L
    except ImportError:
        print(f"{sys.argv[0]}: needs PyTorch Lightning: pip install 'localclip[lightning]'", file=sys.stderr)
        return 2
    from localclip.integrations.lightning import LocalclipStrategy
    from localclip.optim import ClippedSGD

    class Classifier(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
            self.losses, self.validated, self.saved = [], [], []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def on_validation_epoch_start(self):
            self.validated.append(float(flat(self).double().sum()))  # the model this validation scores

        def on_save_checkpoint(self, checkpoint):
            self.saved.append(float(sum(v.double().sum() for v in checkpoint["state_dict"].values())))  # what it holds

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

        def configure_optimizers(self):
            # The clipping is the optimizer's: a step is at most gamma long.
            return ClippedSGD(self.parameters(), lr=0.5, gamma=0.5)

    # Under torchrun the processes exist already: one device each, as many as torchrun started here.
    torchrun = "RANK" in os.environ and "LOCAL_WORLD_SIZE" in os.environ
    devices = int(os.environ["LOCAL_WORLD_SIZE"]) if torchrun else args.devices
    num_nodes = int(os.environ["WORLD_SIZE"]) // devices if torchrun else 1
    torch.manual_seed(int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0))))  # different inits: CELGC starts from rank 0's
    module = Classifier()
    out = f"{args.report}.ckpt" if args.report else os.path.join(tempfile.gettempdir(), "lightning_celgc.ckpt")
    checkpoints = [L.pytorch.callbacks.ModelCheckpoint(dirpath=f"{out}s", every_n_train_steps=args.ckpt_every, save_top_k=-1)
                   ] if args.ckpt_every else []
    trainer = L.Trainer(
        strategy=LocalclipStrategy(period=args.period), accelerator=args.accelerator, devices=devices, num_nodes=num_nodes,
        max_steps=args.steps, val_check_interval=args.val_every, check_val_every_n_epoch=None, num_sanity_val_steps=0,
        callbacks=checkpoints, enable_checkpointing=bool(checkpoints), logger=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    train = DataLoader(data(4096, 1), batch_size=32, shuffle=True)
    val = DataLoader(data(256, 2), batch_size=64)
    trainer.fit(module, train, val)

    strategy = trainer.strategy
    trainer.save_checkpoint(out)  # on every rank; rank 0 writes, then all wait
    saved = torch.load(out, map_location="cpu", weights_only=True)["state_dict"]
    own = module.state_dict()
    checkpoint_identical = all(torch.equal(saved[k].cpu(), v.cpu()) for k, v in own.items())

    mine = flat(module)
    everyone = strategy.all_gather(mine)
    identical = bool((everyone == everyone[0]).all())
    validations = strategy.all_gather(torch.tensor(module.validated, dtype=torch.float64))
    validated_identical = bool((validations == validations[0]).all())
    # Every checkpoint, ModelCheckpoint's and the last, held the same weights on every rank.
    taken = strategy.all_gather(torch.tensor(module.saved, dtype=torch.float64))
    checkpoint_identical = checkpoint_identical and bool((taken == taken[0]).all())
    losses = module.losses
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    rank = strategy.global_rank
    result = {"rank": rank, "identical": identical, "first_loss": first, "last_loss": last, "steps": trainer.global_step,
              "rounds": strategy.algorithm.rounds, "checksum": float(mine.double().sum()), "validations": len(module.validated), "checkpoints": len(module.saved),
              "validated_identical": validated_identical, "checkpoint_identical": checkpoint_identical,
              "model_class": type(strategy.model).__name__}
    if args.report:
        with open(f"{args.report}.rank{rank}", "w") as f:
            json.dump(result, f)
    if rank == 0:
        print(f"Lightning, {strategy.world_size} processes, {trainer.global_step} steps, {result['rounds']} rounds: loss "
              f"{first:.3f} -> {last:.3f}, models identical: {identical}, validations and checkpoint on the average: "
              f"{validated_identical and checkpoint_identical}")
    ok = identical and validated_identical and checkpoint_identical and last < first
    return 0 if ok else 1


if __name__ == "__main__":
    from localclip.comm import distributed

    # In place of sys.exit: a gloo worker can abort in the interpreter's shutdown (see there).
    distributed.exit_process(main())
