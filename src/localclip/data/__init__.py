"""Data: the one place that decides who sees what.

* :mod:`~localclip.data.corpora`: the word-level corpora (PTB, WikiText-2), their checksums,
  the data root, tokenization and vocabulary.
* :mod:`~localclip.data.download`: fetching a corpus, verified before it gets its final name.
* :mod:`~localclip.data.sharding`: the language-model shards of each worker per epoch, the
  variable BPTT schedule all workers draw alike, and partial-participation sampling.
* :mod:`~localclip.data.images`: Fashion-MNIST and CIFAR-10, normalization and augmentation,
  per-worker sampling and the heterogeneous label splits.

Nothing here imports ``torch.distributed``: every worker computes its own view from
``(seed, rank, world_size, epoch)``, and identical arguments give identical answers.
"""

from localclip.data.corpora import (
    CORPORA,
    EOS,
    Corpus,
    CorpusSpec,
    CustomCorpusWarning,
    Vocabulary,
    corpus_path,
    verify_corpus,
    file_sha256,
    load_corpus,
    load_corpus_from_dir,
    read_tokens,
    resolve_data_root,
    split_lines,
    tokenize_lines,
)
from localclip.data.download import SOURCES, CorpusSource, download_corpus
from localclip.data.images import (
    CIFAR10_CLASSES,
    FASHION_MNIST_CLASSES,
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
from localclip.data.sharding import (
    BPTTSchedule,
    LMBatchStream,
    batchify,
    get_batch,
    sample_participants,
    shard_index,
    worker_shard,
)

__all__ = [
    # corpora
    "CORPORA",
    "EOS",
    "Corpus",
    "CorpusSpec",
    "CustomCorpusWarning",
    "Vocabulary",
    "corpus_path",
    "verify_corpus",
    "file_sha256",
    "load_corpus",
    "load_corpus_from_dir",
    "read_tokens",
    "resolve_data_root",
    "split_lines",
    "tokenize_lines",
    # download
    "SOURCES",
    "CorpusSource",
    "download_corpus",
    # sharding
    "BPTTSchedule",
    "LMBatchStream",
    "batchify",
    "get_batch",
    "sample_participants",
    "shard_index",
    "worker_shard",
    # images
    "CIFAR10_CLASSES",
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_ROOT",
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
