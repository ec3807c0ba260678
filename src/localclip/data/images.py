"""Image classification data: loading, normalization, augmentation and who samples what (§5, §6).

This module owns

* the readers: Fashion-MNIST from IDX files (the Debian package ``dataset-fashion-mnist``) with
  an IDX parser of our own, and CIFAR-10 through torchvision when it is installed;
* :class:`ImageDataset`: uint8 images turned into normalized float batches (per-channel mean and
  std of the training set), with CIFAR's random crop and flip done as tensor ops from an
  explicit ``torch.Generator``;
* the samplers: each worker permuting the whole training set with its own seed (§5), and the
  heterogeneous splits of §6 (label skew with similarity s, Dirichlet(α) over labels);
* :class:`ImageBatchStream`: one worker's minibatches, epoch after epoch, resumable exactly.
"""

from __future__ import annotations

import gzip
import math
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from localclip.rng import derive_seed
from localclip.errors import DataError

__all__ = [
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_ROOT",
    "CIFAR10_CLASSES",
    "ImageBatchStream",
    "ImageDataset",
    "ImageSplits",
    "channel_stats",
    "dirichlet_partition",
    "iid_worker_indices",
    "label_skew_partition",
    "load_cifar10",
    "load_fashion_mnist",
    "read_idx",
]

FASHION_MNIST_ROOT = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip
CIFAR10_CLASSES = (
    "airplane", "automobile", "bird", "cat", "deer",
    "dog", "frog", "horse", "ship", "truck",
)  # fmt: skip


@dataclass(eq=False)  # tensors have no truth value: == is identity
class ImageSplits:
    """A labelled image set: uint8 images (``[n, H, W]`` or ``[n, C, H, W]``) and int64 labels."""

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    classes: tuple[str, ...]

    def __repr__(self) -> str:
        return (
            f"ImageSplits(name={self.name!r}, train={tuple(self.train_x.shape)}, "
            f"test={tuple(self.test_x.shape)}, classes={len(self.classes)})"
        )


# ---------------------------------------------------------------------------------------------
# IDX files (Fashion-MNIST)
# ---------------------------------------------------------------------------------------------

# IDX type codes (third byte of the magic number) -> big-endian NumPy dtype.
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_TORCH_DTYPES = {"u1": torch.uint8, "i1": torch.int8, "i2": torch.int16, "i4": torch.int32, "f4": torch.float32, "f8": torch.float64}


def read_idx(path: str | os.PathLike[str]) -> torch.Tensor:
    """Parse an IDX file (gzip-compressed or not) into a tensor of its dtype and shape.

    Format: two zero bytes, a type code, the number of dimensions ``d``, ``d`` big-endian uint32
    sizes, then the data, big-endian, row-major. The file must hold exactly that many bytes.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"Missing IDX file {path}.") from None
    except OSError as e:
        raise DataError(f"Cannot read {path}: {e.strerror or e}.") from None
    # Sniff the gzip magic rather than trust the extension: Debian ships .gz, others do not.
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"{path} is a corrupt or truncated gzip file ({e}); reinstall or re-download it.") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES or raw[3] == 0:
        raise DataError(f"{path} is not an IDX file (bad magic number {raw[:4].hex() or 'empty'}).")
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path} is truncated: its header announces {ndim} dimensions but the file ends first.")
    shape = tuple(int.from_bytes(raw[4 + 4 * k : 8 + 4 * k], "big") for k in range(ndim))
    expected = header + math.prod(shape) * dtype.itemsize
    if len(raw) != expected:
        what = "truncated" if len(raw) < expected else "longer than its header says"
        raise DataError(
            f"{path} is {what}: shape {shape} of {dtype.name} needs {expected} bytes, the file has {len(raw)}."
        )
    array = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    native = array.astype(dtype.newbyteorder("="), copy=True)  # owned, writable, native order
    return torch.from_numpy(native).to(_TORCH_DTYPES[dtype.str[1:]])


def _find_idx(root: Path, stem: str) -> Path:
    for candidate in (root / stem, root / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    raise DataError(
        f"Missing Fashion-MNIST file {root / stem}(.gz). Install the Debian package with "
        f"`apt-get install dataset-fashion-mnist` (files under {FASHION_MNIST_ROOT}), or pass the "
        "folder holding the IDX files as root."
    )


def check_fashion_mnist(root: str | os.PathLike[str] | None = None) -> None:
    """Raise :class:`DataError` naming the first Fashion-MNIST file missing under ``root``."""
    root = Path(root).expanduser() if root is not None else FASHION_MNIST_ROOT
    for prefix in ("train", "t10k"):
        _find_idx(root, f"{prefix}-images-idx3-ubyte")
        _find_idx(root, f"{prefix}-labels-idx1-ubyte")


def load_fashion_mnist(root: str | os.PathLike[str] | None = None) -> ImageSplits:
    """Fashion-MNIST: 60,000 train and 10,000 test images, uint8 ``[n, 28, 28]``, labels 0..9."""
    root = Path(root).expanduser() if root is not None else FASHION_MNIST_ROOT
    out = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        x_path = _find_idx(root, f"{prefix}-images-idx3-ubyte")
        y_path = _find_idx(root, f"{prefix}-labels-idx1-ubyte")
        x, y = read_idx(x_path), read_idx(y_path)
        if x.dtype != torch.uint8 or x.dim() != 3:
            raise DataError(f"{x_path} should hold uint8 images [n, H, W], found {x.dtype} {tuple(x.shape)}.")
        if y.dtype != torch.uint8 or y.dim() != 1 or y.numel() != x.size(0):
            raise DataError(f"{y_path} should hold {x.size(0)} uint8 labels, found {y.dtype} {tuple(y.shape)}.")
        if y.numel() and int(y.max()) >= len(FASHION_MNIST_CLASSES):
            raise DataError(f"{y_path} has label {int(y.max())}; Fashion-MNIST labels are 0..9.")
        out[split] = (x, y.long())
    return ImageSplits("fashion_mnist", *out["train"], *out["test"], classes=FASHION_MNIST_CLASSES)


def load_cifar10(root: str | os.PathLike[str], download: bool = False) -> ImageSplits:
    """CIFAR-10 through torchvision: uint8 ``[n, 3, 32, 32]`` images (50,000/10,000), labels 0..9."""
    try:
        import torchvision  # noqa: F401 - optional dependency, imported only here
        from torchvision.datasets import CIFAR10
    except ImportError:
        raise DataError("CIFAR-10 needs torchvision: `pip install torchvision` (or use Fashion-MNIST).") from None
    root = Path(root).expanduser()
    splits = []
    for train in (True, False):
        try:
            ds = CIFAR10(str(root), train=train, download=download)
        except RuntimeError as e:
            hint = "" if download else " Pass download=True to fetch it."
            raise DataError(f"CIFAR-10 not found or corrupted under {root} ({e}).{hint}") from None
        x = torch.as_tensor(np.asarray(ds.data))
        if x.dtype != torch.uint8 or x.dim() != 4 or x.shape[1:] != (32, 32, 3):
            raise DataError(f"CIFAR-10 under {root} has images {x.dtype} {tuple(x.shape)}; expected uint8 [n, 32, 32, 3].")
        # torchvision keeps HWC (as the pickles store it); models want CHW.
        splits += [x.permute(0, 3, 1, 2).contiguous(), torch.as_tensor(list(ds.targets), dtype=torch.long)]
    return ImageSplits("cifar10", *splits, classes=CIFAR10_CLASSES)


# ---------------------------------------------------------------------------------------------
# Normalization and augmentation
# ---------------------------------------------------------------------------------------------


def _nchw(images: torch.Tensor) -> torch.Tensor:
    if images.dim() == 3:
        return images.unsqueeze(1)
    if images.dim() == 4:
        return images
    raise ValueError(f"Invalid images: expected [n, H, W] or [n, C, H, W], got shape {tuple(images.shape)}")


def channel_stats(images: torch.Tensor, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and std (population) of uint8 images scaled to [0, 1], as float32 ``[C]``.

    Sums of values and of squares are exact integers (accumulated over chunks, so the whole set
    never exists in a wider dtype); only the final division is floating point.
    """
    x = _nchw(images)
    if x.dtype != torch.uint8:
        raise ValueError(f"Invalid images: expected uint8, got {x.dtype}")
    if x.size(0) == 0:
        raise ValueError("Invalid images: cannot compute statistics of an empty set")
    total = torch.zeros(x.size(1), dtype=torch.int64)
    squares = torch.zeros(x.size(1), dtype=torch.int64)
    for start in range(0, x.size(0), chunk):
        part = x[start : start + chunk].to(torch.int32)  # 255² fits easily
        total += part.sum(dim=(0, 2, 3), dtype=torch.int64)
        squares += (part * part).sum(dim=(0, 2, 3), dtype=torch.int64)
    count = x.size(0) * x.size(2) * x.size(3)
    mean = total.double() / count
    var = (squares.double() / count - mean.square()).clamp_min(0.0)
    return (mean / 255.0).float(), (var.sqrt() / 255.0).float()


def _random_crop_flip(x: torch.Tensor, padding: int, generator: torch.Generator) -> torch.Tensor:
    """Random crop of the zero-padded images, then a horizontal flip with probability 1/2.

    Zero padding of the [0, 1] images is the black border of torchvision's
    ``RandomCrop(32, padding=4)`` applied before ``Normalize``.
    """
    n, c, h, w = x.shape
    padded = torch.nn.functional.pad(x, (padding, padding, padding, padding))
    dy = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
    dx = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
    flip = torch.rand(n, generator=generator) < 0.5
    rows = dy[:, None] + torch.arange(h)  # [n, h]
    cols = dx[:, None] + torch.arange(w)  # [n, w]
    # A flipped image reads its crop's columns right to left.
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    batch = torch.arange(n)[:, None, None, None]
    chan = torch.arange(c)[None, :, None, None]
    return padded[batch, chan, rows[:, None, :, None], cols[:, None, None, :]]


class ImageDataset:
    """Images kept as uint8 ``[n, C, H, W]`` and turned into normalized float32 batches on demand.

    Normalizing per batch instead of once keeps CIFAR-10's training set at 150 MB instead of
    600 MB of floats, which matters with N simulated workers in one process sharing it.

    Args:
        images: uint8 ``[n, H, W]`` (one channel) or ``[n, C, H, W]``.
        labels: int64 ``[n]``.
        mean, std: per-channel statistics of the images scaled to [0, 1]; computed from
            ``images`` when omitted (pass the training set's to a test set).
        augment: random crop with ``crop_padding`` and horizontal flip (CIFAR's augmentation).
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        *,
        mean: torch.Tensor | Sequence[float] | None = None,
        std: torch.Tensor | Sequence[float] | None = None,
        augment: bool = False,
        crop_padding: int = 4,
    ) -> None:
        images = _nchw(images)
        if images.dtype != torch.uint8:
            raise ValueError(f"Invalid images: expected uint8, got {images.dtype}")
        if labels.dim() != 1 or labels.numel() != images.size(0):
            raise ValueError(f"Invalid labels: expected shape ({images.size(0)},), got {tuple(labels.shape)}")
        if mean is None or std is None:
            mean, std = channel_stats(images)
        mean = torch.as_tensor(mean, dtype=torch.float32).reshape(-1)
        std = torch.as_tensor(std, dtype=torch.float32).reshape(-1)
        if mean.numel() != images.size(1) or std.numel() != images.size(1):
            raise ValueError(f"Invalid mean/std: need {images.size(1)} channel value(s), got {mean.numel()} and {std.numel()}")
        if bool((std <= 0).any()):
            raise ValueError(f"Invalid std: {std.tolist()} (every channel needs std > 0)")
        if crop_padding < 0:
            raise ValueError(f"Invalid crop_padding: {crop_padding}")
        self.images = images
        self.labels = labels.long()
        self.mean = mean
        self.std = std
        self.augment = augment
        self.crop_padding = crop_padding

    @classmethod
    def from_splits(cls, splits: ImageSplits, *, augment: bool | None = None) -> tuple[ImageDataset, ImageDataset]:
        """Train and test datasets normalized with the training set's statistics.

        ``augment`` (train only) defaults to on for CIFAR-10 and off otherwise.
        """
        if augment is None:
            augment = splits.name == "cifar10"
        train = cls(splits.train_x, splits.train_y, augment=augment)
        test = cls(splits.test_x, splits.test_y, mean=train.mean, std=train.std)
        return train, test

    def __len__(self) -> int:
        return self.labels.numel()

    def batch(self, indices: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Images ``indices`` as normalized float32 ``[k, C, H, W]`` and their int64 labels.

        With ``augment`` the crop offsets and flips are drawn from ``generator``, which is then
        required: drawing from the global RNG would make a resumed run see other images.
        """
        x = self.images[indices].float().div_(255.0)
        if self.augment:
            if generator is None:
                raise ValueError("ImageDataset.batch: augment=True needs an explicit torch.Generator")
            x = _random_crop_flip(x, self.crop_padding, generator)
        x = (x - self.mean[:, None, None]) / self.std[:, None, None]
        return x, self.labels[indices]


# ---------------------------------------------------------------------------------------------
# Who samples what
# ---------------------------------------------------------------------------------------------


def _generator(*parts: int | str) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(*parts))


def iid_worker_indices(n: int, rank: int, seed: int, epoch: int) -> torch.Tensor:
    """Worker ``rank``'s order of the whole training set in ``epoch`` (§5): a permutation of ``n``.

    Each (seed, rank, epoch) gives its own permutation, so workers see the same data in
    different orders, and every epoch reshuffles.
    """
    if n < 1:
        raise ValueError(f"Invalid n: {n} (expected >= 1)")
    if rank < 0:
        raise ValueError(f"Invalid rank: {rank} (expected >= 0)")
    return torch.randperm(n, generator=_generator("iid", int(seed), int(rank), int(epoch)))


def _check_partition_args(labels: torch.Tensor, world_size: int) -> None:
    if labels.dim() != 1:
        raise ValueError(f"Invalid labels: expected a 1-D tensor, got shape {tuple(labels.shape)}")
    if world_size < 1:
        raise ValueError(f"Invalid world_size: {world_size} (expected >= 1)")
    if labels.numel() < world_size:
        raise DataError(f"{labels.numel()} examples cannot be split among {world_size} workers.")


def label_skew_partition(labels: torch.Tensor, world_size: int, similarity: float, seed: int) -> list[torch.Tensor]:
    """Heterogeneous split with similarity ``s`` (§6): a fraction ``s`` of the data is shuffled
    and dealt evenly to the workers, the rest is sorted by label and cut into contiguous chunks.

    ``similarity = 1`` is an iid split, ``0`` gives each worker a few labels only. It is a
    fraction in [0, 1]: the paper's "s%" is ``s / 100``. Every index appears in exactly one
    worker's part; parts differ in size by at most 2. Each part is returned sorted.
    """
    _check_partition_args(labels, world_size)
    if not 0.0 <= similarity <= 1.0:
        raise ValueError(f"Invalid similarity: {similarity} (a fraction in [0, 1]; for s% pass s / 100)")
    n = labels.numel()
    perm = torch.randperm(n, generator=_generator("label_skew", int(seed)))
    n_iid = int(round(similarity * n))
    iid, rest = perm[:n_iid], perm[n_iid:]
    # Stable sort of a random order: within a label the pool stays shuffled.
    rest = rest[torch.sort(labels[rest], stable=True).indices]
    parts = [torch.cat([a, b]) for a, b in zip(iid.tensor_split(world_size), rest.tensor_split(world_size))]
    return [p.sort().values for p in parts]


def dirichlet_partition(
    labels: torch.Tensor, world_size: int, alpha: float, seed: int, *, min_size: int = 1, max_tries: int = 100
) -> list[torch.Tensor]:
    """Heterogeneous split with label proportions drawn from Dirichlet(``alpha``) (§6).

    For each class, its (shuffled) examples are dealt to the workers in proportions drawn from
    ``Dirichlet(alpha·1_N)``; small ``alpha`` gives each worker few classes, large ``alpha``
    approaches iid. Draws are repeated (at most ``max_tries`` times) until every worker has
    ``min_size`` examples. Every index appears in exactly one part; each part is sorted. Parts
    differ in size: give every worker's :class:`ImageBatchStream` the same ``steps_per_epoch``.
    """
    _check_partition_args(labels, world_size)
    if not alpha > 0:
        raise ValueError(f"Invalid alpha: {alpha} (expected > 0)")
    rng = np.random.default_rng(derive_seed("dirichlet", int(seed)))
    g = _generator("dirichlet_shuffle", int(seed))
    classes = torch.unique(labels).tolist()
    by_class = [torch.nonzero(labels == c).squeeze(1) for c in classes]
    by_class = [idx[torch.randperm(idx.numel(), generator=g)] for idx in by_class]
    for _ in range(max_tries):
        parts: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
        for idx in by_class:
            p = rng.dirichlet(np.full(world_size, float(alpha)))
            cuts = (np.cumsum(p)[:-1] * idx.numel()).astype(np.int64).tolist()
            for k, chunk in enumerate(torch.tensor_split(idx, cuts)):
                parts[k].append(chunk)
        merged = [torch.cat(p).sort().values for p in parts]
        if min(p.numel() for p in merged) >= min_size:
            return merged
    raise DataError(
        f"Dirichlet(alpha={alpha}) left a worker with fewer than {min_size} examples in {max_tries} "
        f"draws ({labels.numel()} examples, {world_size} workers); use a larger alpha or fewer workers."
    )


class ImageBatchStream:
    """One worker's ``(x, y)`` minibatches, one epoch per pass, resumable exactly.

    Each epoch visits ``indices`` (default: the whole training set, §5) in the order
    :func:`iid_worker_indices` gives for ``(seed, rank, epoch)``. It yields ``steps_per_epoch``
    batches of ``batch_size``: by default ``len(indices) // batch_size`` (the last partial batch
    dropped, so every batch has the same size); a larger value continues with fresh permutations
    of the same indices. Workers with parts of different sizes (a Dirichlet split) must pass the
    same ``steps_per_epoch``, or their step counts drift.

    Augmentation draws come from a generator seeded by ``(seed, rank, epoch, batch)``, so a batch
    is the same whether or not the run was interrupted before it. Iterating yields the rest of
    the current epoch and then moves to the next; :meth:`state_dict` is ``(epoch, position)``.
    """

    def __init__(
        self,
        dataset: ImageDataset,
        *,
        batch_size: int,
        rank: int,
        seed: int,
        indices: torch.Tensor | None = None,
        steps_per_epoch: int | None = None,
        epoch: int = 0,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"Invalid batch_size: {batch_size} (expected >= 1)")
        if rank < 0:
            raise ValueError(f"Invalid rank: {rank} (expected >= 0)")
        if epoch < 0:
            raise ValueError(f"Invalid epoch: {epoch} (expected >= 0)")
        if indices is None:
            indices = torch.arange(len(dataset))
        indices = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        if indices.numel() == 0:
            raise DataError(f"Worker {rank} has no training examples; check the partition.")
        if steps_per_epoch is None:
            steps_per_epoch = indices.numel() // batch_size
            if steps_per_epoch < 1:
                raise DataError(
                    f"Worker {rank} has {indices.numel()} examples, fewer than one batch of {batch_size}; "
                    "use a smaller batch size or pass steps_per_epoch."
                )
        elif steps_per_epoch < 1:
            raise ValueError(f"Invalid steps_per_epoch: {steps_per_epoch} (expected >= 1)")
        self.dataset = dataset
        self.indices = indices
        self.batch_size = batch_size
        self.rank = int(rank)
        self.seed = int(seed)
        self.steps_per_epoch = int(steps_per_epoch)
        self.epoch = int(epoch)
        self.position = 0

    def __len__(self) -> int:
        return self.steps_per_epoch

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch."""
        self.epoch = epoch
        self.position = 0

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The dataset indices of ``epoch``, in the order they are batched."""
        n = self.indices.numel()
        needed = self.steps_per_epoch * self.batch_size
        orders = [iid_worker_indices(n, self.rank, self.seed, epoch)]
        cycle = 1
        while len(orders) * n < needed:
            orders.append(torch.randperm(n, generator=_generator("iid_cycle", self.seed, self.rank, epoch, cycle)))
            cycle += 1
        return self.indices[torch.cat(orders)[:needed]]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        epoch = self.epoch
        order = self.epoch_order(epoch)
        b = self.batch_size
        while self.position < self.steps_per_epoch:
            pos = self.position
            g = _generator("augment", self.seed, self.rank, epoch, pos) if self.dataset.augment else None
            x, y = self.dataset.batch(order[pos * b : (pos + 1) * b], generator=g)
            # Advance before yielding: a checkpoint taken while this batch is in use resumes after it.
            self.position += 1
            yield x, y
        self.epoch = epoch + 1
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "rank": self.rank,
            "seed": self.seed,
            "num_indices": self.indices.numel(),
            "steps_per_epoch": self.steps_per_epoch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, mine in (("rank", self.rank), ("seed", self.seed), ("num_indices", self.indices.numel()),
                          ("steps_per_epoch", self.steps_per_epoch)):  # fmt: skip
            if state[key] != mine:
                raise ValueError(f"Image batch stream state has {key}={state[key]!r}, this stream has {mine!r}; resume with the same settings.")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
