"""Workloads: what a worker trains on and how a model is scored, per task.

A workload builds the model, yields this worker's training batches for an epoch (through
:mod:`localclip.data`, which decides who sees what), computes the training loss of one batch, and
evaluates the averaged model. Evaluation is split across workers (independent sequences or
images per worker) and summed with one all-reduce, so every worker gets the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from localclip import data, devices, rng
from localclip.comm import Communicator
from localclip.errors import ConfigError, DataError
from localclip.models import GPT, ar_tar_penalty, build_model, check_model_options, detach_hidden
from localclip.models.gpt import check_windows
from localclip.train.config import TrainConfig

__all__ = ["make_workload", "check_data", "check_model", "LMWorkload", "ImageWorkload"]

_LM_MODELS = {"lstm": "lstm", "awd_lstm": "awd_lstm", "gpt": "gpt"}
_IMAGE_CHANNELS = {"fashion-mnist": 1, "cifar10": 3}


def check_model(config: TrainConfig) -> None:
    """Refuse a model name or ``model_options`` that the workload could not build, before a run
    folder is written (the vocabulary size is not known yet: any positive one checks the rest)."""
    if config.workload.task == "lm":
        name = _LM_MODELS.get(config.workload.model)
        if name is None:
            raise ConfigError(f"Invalid model for the lm task: {config.workload.model!r} (expected lstm or awd_lstm)")
        check_model_options(name, config.workload.model_options, ntoken=10)
        return
    if not config.workload.model.startswith("resnet"):
        raise ConfigError(f"Invalid model for the image task: {config.workload.model!r} (expected resnetD, e.g. resnet20)")
    supplied = dict(num_classes=10, in_channels=_IMAGE_CHANNELS.get(config.workload.dataset, 3))
    check_model_options(config.workload.model, config.workload.model_options, **supplied)


def check_data(config: TrainConfig) -> None:
    """Refuse an image run whose data or optional dependency is missing, before a run folder is
    written (the corpora of language-model runs are checked by ``run_training``)."""
    if config.workload.task != "image":
        return
    if config.workload.dataset == "fashion-mnist":
        data.images.check_fashion_mnist(config.workload.data_root)
    elif config.workload.dataset == "cifar10":
        import importlib.util

        if importlib.util.find_spec("torchvision") is None:
            raise DataError("CIFAR-10 needs torchvision: `pip install torchvision` (or use Fashion-MNIST).")


def make_workload(config: TrainConfig, comm: Communicator, device: torch.device | str = "cpu"):
    """The workload of ``config``, its model on ``device`` (the batches move there in the trainer)."""
    if config.workload.task == "lm":
        return LMWorkload(config, comm, device)
    return ImageWorkload(config, comm, device)


class LMWorkload:
    """Word-level language modelling (PTB, WikiText-2) with truncated BPTT (docs/algorithm.md §4)."""

    metric = "ppl"

    def __init__(self, config: TrainConfig, comm: Communicator, device: torch.device | str = "cpu"):
        self.config, self.comm, self.device = config, comm, torch.device(device)
        # The group that shares an evaluation (a fault-tolerant worker evaluates alone).
        self.eval_comm = comm
        if config.workload.dataset not in data.CORPORA:
            raise ConfigError(f"Invalid dataset for the lm task: {config.workload.dataset!r} (expected one of {', '.join(data.CORPORA)})")
        # Workers do not warn about a custom corpus: the launcher says it once (run_training).
        self.corpus = data.load_corpus(config.workload.dataset, config.workload.data_root, allow_custom=config.workload.allow_custom_corpus, warn=False)
        self.ntokens = len(self.corpus.vocab)
        name = _LM_MODELS.get(config.workload.model)
        if name is None:
            raise ConfigError(f"Invalid model for the lm task: {config.workload.model!r} (expected lstm, awd_lstm or gpt)")
        # The same x0 on every worker: initial weights come from the run's seed alone.
        with rng.seeded(config.run.seed):
            self.model = build_model(name, ntoken=self.ntokens, **config.workload.model_options)
        self.model.to(self.device)
        if isinstance(self.model, GPT):
            check_windows(self.model.block_size, variable=config.workload.variable_bptt, bptt=config.workload.bptt, eval_bptt=config.evaluation.eval_bptt)
        self.schedule = data.BPTTSchedule(config.workload.bptt, seed=config.run.seed, variable=config.workload.variable_bptt)
        self.hidden = None
        self.stream = None
        # Whose shard this worker trains on, of how many: its own, unless it is a slot that plays
        # one of N workers (localclip.train.roster), which sets both.
        self.worker, self.workers = comm.rank, comm.world_size
        self.epoch = 0

    # -- training ------------------------------------------------------------------------------

    def _shard(self) -> torch.Tensor:
        return data.worker_shard(
            self.corpus.train, rank=self.worker, world_size=self.workers,
            batch_size=self.config.workload.batch_size, epoch=self.epoch, heterogeneous=self.config.workload.heterogeneous,
        )

    def start_epoch(self, epoch: int) -> int:
        """Prepare ``epoch``'s batches; returns how many there are (the same on every worker)."""
        self.epoch = epoch
        self.stream = data.LMBatchStream(self._shard(), self.schedule)
        self._zero_state()
        return len(self.stream)

    def play(self, worker: int, fresh: bool = True) -> None:
        """Train on ``worker``'s shard from the stream's position on (all shards have the same
        shape, so the stream's position and BPTT draws carry over); ``fresh``: from a zero
        recurrent state (see :mod:`localclip.train.roster`)."""
        self.worker = worker
        if self.stream is not None:
            self.stream.shard = self._shard()
        if fresh:
            self._zero_state()

    def batches(self):
        """The rest of the epoch's batches: ``(batch, lr_scale)``."""
        for x, y, seq_len in self.stream:
            yield (x, y), self.schedule.lr_scale(seq_len) if self.config.workload.variable_bptt else 1.0

    def loss(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(objective to differentiate, reported cross-entropy) for one batch."""
        x, y = batch
        self.hidden = detach_hidden(self.hidden)
        out = self.model(x, self.hidden)
        self.hidden = out.hidden
        ce = F.cross_entropy(out.logits.reshape(-1, self.ntokens), y.reshape(-1))
        if self.config.workload.ar_alpha or self.config.workload.tar_beta:
            return ce + ar_tar_penalty(out, self.config.workload.ar_alpha, self.config.workload.tar_beta), ce
        return ce, ce

    @staticmethod
    def split_name(split: str) -> str:
        return split

    def state_dict(self) -> dict:
        return {"stream": self.stream.state_dict(), "hidden": detach_hidden(self.hidden)}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["stream"])
        self.hidden = devices.move(state["hidden"], self.device)

    def _zero_state(self) -> None:
        """The recurrent state of a fresh start: an epoch's, a sampled slot's, a rejoin's."""
        self.hidden = self.model.init_hidden(self.config.workload.batch_size)

    def rejoin(self, state: dict | None = None) -> None:
        """A worker that heals (docs/algorithm.md, "When workers leave and rejoin") goes on with
        its own shard from a zero recurrent state, at the place in the epoch that ``state`` (a
        live peer's :meth:`state_dict`: every shard has the same shape and BPTT draws) gives, or
        at its own place if None. A peer's recurrent state summarises another shard's text, and
        the worker's own is as old as its departure, or lost with its process."""
        if state is not None:
            self.stream.load_state_dict(state["stream"])
        self._zero_state()

    # -- evaluation ----------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, split: str, progress: Callable[[float], object] | None = None) -> dict:
        """Perplexity of the current model on ``valid`` or ``test``, with the reference's batch
        sizes; each worker evaluates a subset of the batch's independent columns.
        ``progress(fraction)`` is told how far this worker's part is, after each window."""
        source = self.corpus.split(split)
        if self.config.evaluation.eval_tokens:
            source = source[: self.config.evaluation.eval_tokens]
        batch = self.config.evaluation.eval_batch_size if split == "valid" else self.config.evaluation.test_batch_size
        columns = data.batchify(source, batch)[:, self.eval_comm.rank :: self.eval_comm.world_size]
        bptt = self.config.evaluation.eval_bptt or self.config.workload.bptt
        total = torch.zeros(2, dtype=torch.float64)
        if columns.size(1) > 0:
            was_training = self.model.training
            self.model.eval()
            hidden = self.model.init_hidden(columns.size(1))
            for i in range(0, columns.size(0) - 1, bptt):
                x, y = data.get_batch(columns, i, bptt)
                if self.device.type != "cpu":
                    x, y = x.to(self.device), y.to(self.device)
                out = self.model(x, hidden)
                hidden = out.hidden
                total[0] += F.cross_entropy(out.logits.reshape(-1, self.ntokens), y.reshape(-1), reduction="sum").double().to(total.device)
                total[1] += y.numel()
                if progress is not None:
                    progress(min(1.0, (i + bptt) / max(1, columns.size(0) - 1)))
            self.model.train(was_training)
        self.eval_comm.all_reduce([total])
        loss = (total[0] / total[1]).item()
        # A diverged model (local SGD without clipping at the paper's η) has a loss whose exp
        # overflows: its perplexity is infinite, written "inf" in the JSON files (localclip.jsonio).
        return {"loss": loss, "ppl": math.exp(loss) if loss < 709 else math.inf}


class ImageWorkload:
    """Image classification (Fashion-MNIST, CIFAR-10) with ResNets (docs/algorithm.md §5)."""

    metric = "acc"

    def __init__(self, config: TrainConfig, comm: Communicator, device: torch.device | str = "cpu"):
        self.config, self.comm, self.device = config, comm, torch.device(device)
        # The group that shares an evaluation (a fault-tolerant worker evaluates alone).
        self.eval_comm = comm
        if config.workload.dataset == "fashion-mnist":
            splits = data.load_fashion_mnist(config.workload.data_root)
        elif config.workload.dataset == "cifar10":
            splits = data.load_cifar10(config.workload.data_root or data.resolve_data_root(None) / "cifar10", download=True)
        else:
            raise ConfigError(f"Invalid dataset for the image task: {config.workload.dataset!r} (expected fashion-mnist or cifar10)")
        self.train_set, self.test_set = data.ImageDataset.from_splits(splits)
        if not config.workload.model.startswith("resnet"):
            raise ConfigError(f"Invalid model for the image task: {config.workload.model!r} (expected resnetD, e.g. resnet20)")
        channels = self.train_set.images.shape[1]
        with rng.seeded(config.run.seed):
            self.model = build_model(config.workload.model, num_classes=10, in_channels=channels, **config.workload.model_options)
        self.model.to(self.device)
        indices = None
        if config.workload.heterogeneous:
            parts = data.label_skew_partition(self.train_set.labels, comm.world_size, config.workload.similarity, config.run.seed)
            indices = parts[comm.rank]
        self.stream = data.ImageBatchStream(
            self.train_set, batch_size=config.workload.batch_size, rank=comm.rank, seed=config.run.seed, indices=indices,
            steps_per_epoch=len(self.train_set) // (config.workload.batch_size * comm.world_size) if indices is None else None,
        )

    def start_epoch(self, epoch: int) -> int:
        self.stream.set_epoch(epoch)
        return len(self.stream)

    def batches(self):
        for x, y in self.stream:
            yield (x, y), 1.0

    def loss(self, batch):
        x, y = batch
        ce = F.cross_entropy(self.model(x), y)
        return ce, ce

    @staticmethod
    def split_name(split: str) -> str:
        return "test"  # as in the paper, the held-out set of image runs is the test set

    def state_dict(self) -> dict:
        return {"stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["stream"])

    def rejoin(self, state: dict | None = None) -> None:
        """A worker that heals goes on from ``state`` (a live peer's :meth:`state_dict`), or from
        its own place if None; an image model carries no state between batches."""
        if state is not None:
            self.load_state_dict(state)

    @torch.no_grad()
    def evaluate(self, split: str, progress: Callable[[float], object] | None = None) -> dict:
        """Accuracy and loss on the test set (both splits mean the test set here);
        ``progress(fraction)`` as for :meth:`LMWorkload.evaluate`."""
        n = len(self.test_set)
        idx = torch.arange(self.eval_comm.rank, n, self.eval_comm.world_size)
        total = torch.zeros(3, dtype=torch.float64)
        was_training = self.model.training
        self.model.eval()
        chunks = idx.split(500)
        for done, chunk in enumerate(chunks, 1):
            if progress is not None:
                progress((done - 1) / len(chunks))
            x, y = self.test_set.batch(chunk)
            if self.device.type != "cpu":
                x, y = x.to(self.device), y.to(self.device)
            logits = self.model(x)
            total[0] += F.cross_entropy(logits, y, reduction="sum").double().to(total.device)
            total[1] += (logits.argmax(1) == y).sum().to(total.device)
            total[2] += y.numel()
        self.model.train(was_training)
        self.eval_comm.all_reduce([total])
        return {"loss": (total[0] / total[2]).item(), "acc": (total[1] / total[2]).item()}
