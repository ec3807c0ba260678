"""Image data: the IDX reader, Fashion-MNIST, CIFAR-10 glue, normalization, augmentation, samplers."""

from __future__ import annotations

import gzip
import io
import struct
import sys
import types

import numpy as np
import pytest
import torch

from localclip.data.images import (
    FASHION_MNIST_ROOT,
    ImageBatchStream,
    ImageDataset,
    ImageSplits,
    channel_stats,
    dirichlet_partition,
    iid_worker_indices,
    label_skew_partition,
    load_cifar10,
    load_fashion_mnist,
    read_idx,
)
from localclip.errors import DataError
from helpers import needs_fmnist


def _idx_bytes(array: np.ndarray, code: int) -> bytes:
    header = bytes([0, 0, code, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def _roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ---------------------------------------------------------------------------------------------
# IDX and Fashion-MNIST
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("compress", [False, True])
def test_read_idx_roundtrip(tmp_path, compress):
    images = np.random.default_rng(0).integers(0, 256, size=(5, 3, 4), dtype=np.uint8)
    ints = np.array([[1, -2, 70000], [3, 2**31 - 1, -(2**31)]], dtype=np.int32)
    for name, array, code in (("u8", images, 0x08), ("i32", ints, 0x0C)):
        raw = _idx_bytes(array, code)
        path = tmp_path / (name + (".gz" if compress else ""))
        path.write_bytes(gzip.compress(raw) if compress else raw)
        out = read_idx(path)
        assert tuple(out.shape) == array.shape
        assert np.array_equal(out.numpy(), array)
    assert read_idx(tmp_path / ("u8" + (".gz" if compress else ""))).dtype == torch.uint8


def test_read_idx_rejects_bad_files(tmp_path):
    good = _idx_bytes(np.zeros((4, 2, 2), dtype=np.uint8), 0x08)
    cases = {
        "magic": b"\x12\x34" + good[2:],
        "dtype": good[:2] + b"\x07" + good[3:],
        "truncated": good[:-1],
        "trailing": good + b"\x00",
        "header": good[:6],
        "empty": b"",
    }
    for name, data in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(DataError) as err:
            read_idx(path)
        assert str(path) in str(err.value), name
    bad_gz = tmp_path / "bad.gz"
    bad_gz.write_bytes(gzip.compress(good)[:-8])  # cut before the gzip trailer
    with pytest.raises(DataError, match="bad.gz"):
        read_idx(bad_gz)


@needs_fmnist
def test_fashion_mnist_shapes_and_labels():
    s = load_fashion_mnist()
    assert s.train_x.shape == (60_000, 28, 28) and s.train_x.dtype == torch.uint8
    assert s.test_x.shape == (10_000, 28, 28) and s.test_x.dtype == torch.uint8
    assert s.train_y.dtype == s.test_y.dtype == torch.int64
    assert s.train_y.bincount().tolist() == [6_000] * 10
    assert s.test_y.bincount().tolist() == [1_000] * 10
    assert len(s.classes) == 10
    # Published statistics of the training set (0.2860, 0.3530) pin the byte order and layout.
    mean, std = channel_stats(s.train_x)
    assert mean.item() == pytest.approx(0.2860, abs=1e-4) and std.item() == pytest.approx(0.3530, abs=1e-4)


def test_fashion_mnist_missing_files_name_path_and_package(tmp_path):
    with pytest.raises(DataError) as err:
        load_fashion_mnist(tmp_path)
    assert str(tmp_path / "train-images-idx3-ubyte") in str(err.value)
    assert "apt-get install dataset-fashion-mnist" in str(err.value)


def test_fashion_mnist_bad_file_is_named(tmp_path):
    images = np.zeros((3, 28, 28), dtype=np.uint8)
    labels = np.array([0, 1, 2], dtype=np.uint8)
    for prefix in ("train", "t10k"):
        (tmp_path / f"{prefix}-images-idx3-ubyte").write_bytes(_idx_bytes(images, 0x08))
        (tmp_path / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(gzip.compress(_idx_bytes(labels, 0x08)))
    s = load_fashion_mnist(tmp_path)  # plain and gzip files mixed
    assert s.train_x.shape == (3, 28, 28) and s.test_y.tolist() == [0, 1, 2]

    bad = tmp_path / "t10k-images-idx3-ubyte"
    bad.write_bytes(b"\x00\x00\x08\x03" + b"\x00" * 5)
    with pytest.raises(DataError, match=str(bad)):
        load_fashion_mnist(tmp_path)
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(_idx_bytes(images, 0x08))
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(_idx_bytes(labels[:2], 0x08)))
    with pytest.raises(DataError, match="should hold 3 uint8 labels"):
        load_fashion_mnist(tmp_path)


# ---------------------------------------------------------------------------------------------
# CIFAR-10 (torchvision is optional)
# ---------------------------------------------------------------------------------------------


def test_cifar10_without_torchvision_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torchvision", None)
    with pytest.raises(DataError, match="pip install torchvision"):
        load_cifar10(tmp_path)


def _fake_torchvision(monkeypatch, n_train=6, n_test=4, missing=False):
    class CIFAR10:
        def __init__(self, root, train=True, download=False):
            if missing:
                raise RuntimeError("Dataset not found or corrupted. You can use download=True to download it")
            n = n_train if train else n_test
            self.data = np.arange(n * 32 * 32 * 3, dtype=np.int64).reshape(n, 32, 32, 3).astype(np.uint8)
            self.targets = [i % 10 for i in range(n)]

    tv = types.ModuleType("torchvision")
    datasets = types.ModuleType("torchvision.datasets")
    datasets.CIFAR10 = CIFAR10
    tv.datasets = datasets
    monkeypatch.setitem(sys.modules, "torchvision", tv)
    monkeypatch.setitem(sys.modules, "torchvision.datasets", datasets)


def test_cifar10_is_converted_to_nchw(monkeypatch, tmp_path):
    _fake_torchvision(monkeypatch)
    s = load_cifar10(tmp_path)
    assert s.train_x.shape == (6, 3, 32, 32) and s.test_x.shape == (4, 3, 32, 32)
    assert s.train_x.dtype == torch.uint8 and s.train_y.dtype == torch.int64
    hwc = np.arange(6 * 32 * 32 * 3, dtype=np.int64).reshape(6, 32, 32, 3).astype(np.uint8)
    assert np.array_equal(s.train_x.permute(0, 2, 3, 1).numpy(), hwc)
    assert s.train_y.tolist() == [0, 1, 2, 3, 4, 5]


def test_cifar10_missing_data_mentions_download(monkeypatch, tmp_path):
    _fake_torchvision(monkeypatch, missing=True)
    with pytest.raises(DataError) as err:
        load_cifar10(tmp_path)
    assert str(tmp_path) in str(err.value) and "download=True" in str(err.value)


# ---------------------------------------------------------------------------------------------
# Normalization and augmentation
# ---------------------------------------------------------------------------------------------


def test_channel_stats_are_exact():
    x = torch.randint(0, 256, (50, 3, 6, 5), dtype=torch.uint8)
    mean, std = channel_stats(x, chunk=7)
    ref = x.double() / 255
    assert torch.allclose(mean.double(), ref.mean(dim=(0, 2, 3)), atol=1e-7)
    assert torch.allclose(std.double(), ref.std(dim=(0, 2, 3), unbiased=False), atol=1e-7)


def test_dataset_normalizes_with_train_statistics():
    gen = torch.Generator().manual_seed(0)
    train_x = torch.randint(0, 256, (64, 3, 8, 8), dtype=torch.uint8, generator=gen)
    test_x = torch.randint(0, 128, (16, 3, 8, 8), dtype=torch.uint8, generator=gen)
    splits = ImageSplits("toy", train_x, torch.arange(64) % 10, test_x, torch.arange(16) % 10, tuple("0123456789"))
    train, test = ImageDataset.from_splits(splits)
    x, y = train.batch(torch.arange(64))
    assert x.dtype == torch.float32 and x.shape == (64, 3, 8, 8)
    assert torch.allclose(x.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-5)
    assert torch.allclose(x.std(dim=(0, 2, 3), unbiased=False), torch.ones(3), atol=1e-5)
    assert torch.equal(test.mean, train.mean) and torch.equal(test.std, train.std)
    xt, _ = test.batch(torch.arange(16))
    expected = (test_x.float() / 255 - train.mean[:, None, None]) / train.std[:, None, None]
    assert torch.allclose(xt, expected)
    assert torch.equal(y, torch.arange(64) % 10)


def test_grayscale_images_get_a_channel():
    ds = ImageDataset(torch.randint(0, 256, (10, 28, 28), dtype=torch.uint8), torch.zeros(10, dtype=torch.long))
    x, _ = ds.batch(torch.tensor([0, 3]))
    assert x.shape == (2, 1, 28, 28)


def test_augmentation_is_a_padded_crop_or_its_mirror():
    images = torch.randint(1, 256, (12, 3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    raw = ImageDataset(images, torch.zeros(12, dtype=torch.long), mean=[0, 0, 0], std=[1, 1, 1])
    aug = ImageDataset(images, torch.zeros(12, dtype=torch.long), mean=[0, 0, 0], std=[1, 1, 1], augment=True)
    idx = torch.arange(12)
    x, _ = aug.batch(idx, torch.Generator().manual_seed(3))
    x2, _ = aug.batch(idx, torch.Generator().manual_seed(3))
    assert torch.equal(x, x2)  # the generator decides everything
    padded = torch.nn.functional.pad(raw.batch(idx)[0], (4, 4, 4, 4))
    crops = padded.unfold(2, 8, 1).unfold(3, 8, 1)  # [n, c, 9, 9, 8, 8]: every 8x8 window
    kinds = set()
    for i in range(12):
        windows = crops[i].permute(1, 2, 0, 3, 4).reshape(81, 3, 8, 8)
        plain = (windows == x[i]).flatten(1).all(1).nonzero()
        mirrored = (windows.flip(-1) == x[i]).flatten(1).all(1).nonzero()
        assert plain.numel() + mirrored.numel() >= 1, i
        kinds.add("plain" if plain.numel() else "mirror")
    assert kinds == {"plain", "mirror"}  # both happen among 12 images (fails with prob 2^-11)
    with pytest.raises(ValueError, match="Generator"):
        aug.batch(idx)


# ---------------------------------------------------------------------------------------------
# Samplers and partitions
# ---------------------------------------------------------------------------------------------


def test_iid_worker_indices():
    p = iid_worker_indices(1000, rank=2, seed=5, epoch=1)
    assert torch.equal(p.sort().values, torch.arange(1000))
    assert torch.equal(p, iid_worker_indices(1000, rank=2, seed=5, epoch=1))
    others = [iid_worker_indices(1000, 3, 5, 1), iid_worker_indices(1000, 2, 5, 2), iid_worker_indices(1000, 2, 6, 1)]
    assert all(not torch.equal(p, q) for q in others)
    # (seed, rank) = (1, 0) and (0, 1) must not collide as seed + rank would.
    assert not torch.equal(iid_worker_indices(100, 0, 1, 0), iid_worker_indices(100, 1, 0, 0))


def _assert_partition(parts, n):
    everything = torch.cat(parts)
    assert everything.numel() == n
    assert torch.equal(everything.sort().values, torch.arange(n))


def test_label_skew_partition():
    labels = torch.arange(1000) % 10
    for s in (0.0, 0.3, 1.0):
        parts = label_skew_partition(labels, 10, s, seed=0)
        _assert_partition(parts, 1000)
        sizes = [p.numel() for p in parts]
        assert max(sizes) - min(sizes) <= 2
        assert all(torch.equal(a, b) for a, b in zip(parts, label_skew_partition(labels, 10, s, seed=0)))
    zero = label_skew_partition(labels, 10, 0.0, seed=0)
    assert [labels[p].unique().numel() for p in zero] == [1] * 10  # sorted pool: one label each
    iid = label_skew_partition(labels, 10, 1.0, seed=0)
    assert min(labels[p].unique().numel() for p in iid) >= 8
    half = label_skew_partition(labels, 10, 0.5, seed=0)
    # Half of each part is iid: its dominant label holds at most ~55%, not 100%.
    assert max(labels[p].bincount().max().item() / p.numel() for p in half) < 0.7
    with pytest.raises(ValueError, match="s / 100"):
        label_skew_partition(labels, 10, 50, seed=0)


def test_dirichlet_partition():
    labels = torch.arange(2000) % 10
    skewed = dirichlet_partition(labels, 8, alpha=0.1, seed=1)
    flat = dirichlet_partition(labels, 8, alpha=100.0, seed=1)
    for parts in (skewed, flat):
        _assert_partition(parts, 2000)
        assert min(p.numel() for p in parts) >= 1
    assert all(torch.equal(a, b) for a, b in zip(skewed, dirichlet_partition(labels, 8, 0.1, seed=1)))

    def dominant_share(parts):
        return np.mean([labels[p].bincount().max().item() / p.numel() for p in parts])

    assert dominant_share(skewed) > 0.5 > 0.2 > dominant_share(flat)
    with pytest.raises(ValueError, match="alpha"):
        dirichlet_partition(labels, 8, alpha=0.0, seed=1)
    with pytest.raises(DataError, match="alpha=0.01"):
        dirichlet_partition(torch.zeros(20, dtype=torch.long), 8, alpha=0.01, seed=1, min_size=3, max_tries=3)


# ---------------------------------------------------------------------------------------------
# ImageBatchStream
# ---------------------------------------------------------------------------------------------


def _toy_dataset(n=100, augment=False):
    images = torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    # Label = index, so a batch's labels say exactly which examples it holds.
    return ImageDataset(images, torch.arange(n), augment=augment, crop_padding=2)


def test_image_stream_epoch_covers_indices_once():
    ds = _toy_dataset()
    stream = ImageBatchStream(ds, batch_size=16, rank=1, seed=3)
    assert len(stream) == 6  # 100 // 16, last partial batch dropped
    ys = [y for _, y in stream]
    assert all(y.numel() == 16 for y in ys)
    seen = torch.cat(ys)
    assert seen.unique().numel() == 96  # no repeats within an epoch
    assert stream.state_dict()["epoch"] == 1  # moved on to the next epoch
    second = torch.cat([y for _, y in stream])
    assert not torch.equal(seen, second)  # reshuffled
    other = torch.cat([y for _, y in ImageBatchStream(ds, batch_size=16, rank=2, seed=3)])
    assert not torch.equal(seen, other)  # each worker its own order (§5)


def test_image_stream_on_a_partition_with_fixed_steps():
    ds = _toy_dataset()
    part = torch.arange(0, 100, 7)  # 15 examples
    stream = ImageBatchStream(ds, batch_size=4, rank=0, seed=0, indices=part, steps_per_epoch=10)
    ys = torch.cat([y for _, y in stream])
    assert ys.numel() == 40 and set(ys.tolist()) == set(part.tolist())
    assert ys[:15].unique().numel() == 15  # the first pass is a permutation, then it cycles


def test_image_stream_resume_is_exact_with_augmentation():
    ds = _toy_dataset(augment=True)
    reference = ImageBatchStream(ds, batch_size=8, rank=1, seed=9)
    ref_batches = [b for _ in range(2) for b in reference]  # two epochs

    interrupted = ImageBatchStream(ds, batch_size=8, rank=1, seed=9)
    it = iter(interrupted)
    for _ in range(5):
        next(it)
    state = _roundtrip(interrupted.state_dict())
    resumed = ImageBatchStream(ds, batch_size=8, rank=1, seed=9)
    resumed.load_state_dict(state)
    got = list(resumed) + list(resumed)
    assert len(got) == len(ref_batches) - 5
    for (x1, y1), (x2, y2) in zip(got, ref_batches[5:]):
        assert torch.equal(y1, y2) and torch.equal(x1, x2)
    with pytest.raises(ValueError, match="rank"):
        ImageBatchStream(ds, batch_size=8, rank=2, seed=9).load_state_dict(state)


def test_image_stream_validates():
    ds = _toy_dataset(10)
    with pytest.raises(DataError, match="fewer than one batch"):
        ImageBatchStream(ds, batch_size=16, rank=0, seed=0)
    with pytest.raises(DataError, match="no training examples"):
        ImageBatchStream(ds, batch_size=2, rank=0, seed=0, indices=torch.tensor([], dtype=torch.long))
    with pytest.raises(ValueError, match="batch_size"):
        ImageBatchStream(ds, batch_size=0, rank=0, seed=0)
