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

from localclip.data import corpora, download, images, sharding
from localclip.data.corpora import *  # noqa: F403 - each submodule's __all__ is its public face
from localclip.data.download import *  # noqa: F403
from localclip.data.images import *  # noqa: F403
from localclip.data.sharding import *  # noqa: F403

__all__ = [*corpora.__all__, *download.__all__, *sharding.__all__, *images.__all__]
