"""CELGC inside PyTorch Lightning: :class:`LocalclipStrategy`, used in place of ``strategy="ddp"``.

Lightning's DDP strategy wraps the LightningModule in DistributedDataParallel, which averages the
gradients at every step: the communication CELGC exists to avoid. :class:`LocalclipStrategy`
keeps the rest of DDP (the launchers, the process group, device placement, the distributed
samplers that give each worker its own batches, ``sync_dist`` logging) and instead wraps the
optimizer returned by ``configure_optimizers`` in a localclip algorithm, which takes the
optimizer's own (clipped) steps and averages the models every ``period`` steps over Lightning's
process group::

    import lightning as L
    from localclip.integrations.lightning import LocalclipStrategy
    from localclip.optim import ClippedSGD

    class MyModule(L.LightningModule):
        def configure_optimizers(self):
            return ClippedSGD(self.parameters(), lr=0.5, gamma=0.5)   # or ClippedAdamW, AdamW, ...

    trainer = L.Trainer(strategy=LocalclipStrategy(period=8), accelerator="cpu", devices=2, max_steps=1000)
    trainer.fit(MyModule(), train_loader, val_loader)

What this module owns: when the models are averaged beyond the algorithm's own rounds. Before
every validation, before a checkpoint's weights are taken (``ModelCheckpoint``,
``trainer.save_checkpoint``) and at the end of ``fit``, every rank averages, so that every rank
evaluates and saves the same averaged model (a round only if a step was taken since the last
one: validating or checkpointing every multiple of ``period`` steps adds none). The average
before a validation is taken after the callbacks' and the module's own ``on_validation_start``
hooks, so those hooks see each rank's local model; ``validation_step`` sees the average. A
checkpoint holds rank 0's optimizer and averager state; resuming from it gives every rank that
state.

What it refuses, in one line each, because it would change the algorithm or cannot be averaged:
``Trainer(gradient_clip_val=...)`` (it would clip the gradient before the optimizer's own
clipped step: clip with the optimizer, e.g. ClippedSGD's ``gamma``), ``sync_batchnorm=True`` (a
collective at every forward), fp16 loss scaling (``precision="16-mixed"``: a step skipped on one
rank only would shift its rounds; use ``"bf16-mixed"``), and more than one optimizer (the
algorithm averages one model under one optimizer, which must hold all its trainable parameters).
"""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

from localclip.algorithms import ALGORITHMS, DistributedAlgorithm, compose
from localclip.comm import current
from localclip.errors import ConfigError

try:
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("localclip.integrations.lightning needs PyTorch Lightning: pip install 'localclip[lightning]'") from exc

__all__ = ["LocalclipStrategy"]

# The algorithms that can wrap the user's own optimizer: the others fix a hyperparameter of the
# local update (local-sgd: no clipping) or the world (single: one worker), which belong to the user here.
_WRAPPABLE = tuple(name for name, spec in ALGORITHMS.items() if set(spec.fixed) <= {"period"})


class LocalclipStrategy(DDPStrategy):
    """Lightning's DDP strategy without DistributedDataParallel: the optimizer from
    ``configure_optimizers`` runs inside the localclip ``algorithm`` (``"celgc"``, ``"naive"`` or
    ``"episode"``), which averages the models every ``period`` optimizer steps. Local SGD is
    ``"celgc"`` around an optimizer that does not clip (``torch.optim.SGD``).

    ``round_options`` go to :class:`~localclip.averaging.PeriodicAverager` through
    :func:`~localclip.algorithms.compose` (``outer_optimizer=OuterSGD(0.7, 0.9, nesterov=True)``,
    ``compression="int8"``, ``fragments``, ``overlap``, ``optimizer_state``, ``participants``, …);
    they are copied for each ``fit``, which builds a fresh algorithm (a Trainer can fit again). The other keywords
    are DDPStrategy's (``process_group_backend``, ``timeout``, ``start_method``, …); DDP's own
    options (comm hooks, ``find_unused_parameters``) do not apply, as nothing is wrapped.

    After ``fit``, :attr:`algorithm` is the algorithm that ran (``rounds``,
    ``bytes_communicated``); :meth:`average` averages the models now (on every rank).
    """

    strategy_name = "localclip"

    def __init__(self, period: int = 8, algorithm: str = "celgc", *, accelerator=None, parallel_devices=None,
                 cluster_environment=None, checkpoint_io=None, precision_plugin=None, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, start_method: str = "popen", **round_options: Any):
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ConfigError(f"Invalid period: {period!r} (must be an integer >= 1)")
        if algorithm not in _WRAPPABLE:
            raise ConfigError(f"Invalid algorithm: {algorithm!r} (expected one of {', '.join(_WRAPPABLE)})")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend, timeout=timeout, start_method=start_method)
        self.period = period
        self.algorithm_name = algorithm
        self.round_options = round_options
        self._algorithm: DistributedAlgorithm | None = None

    @property
    def algorithm(self) -> DistributedAlgorithm | None:
        """The algorithm of the latest ``fit`` (None before one)."""
        return self._algorithm

    def average(self) -> None:
        """Average the models now if a step was taken since the last round; a collective: every
        rank must call it. Outside ``fit`` (no algorithm yet) it does nothing."""
        if self._algorithm is not None and self._fitting():
            self._algorithm.average()

    def _fitting(self) -> bool:
        # After fit (trainer.validate, test), the model was averaged at its end: nothing to do.
        trainer = getattr(self.lightning_module, "_trainer", None)
        return trainer is not None and trainer.state.fn == TrainerFn.FITTING

    # -- what is refused -----------------------------------------------------------------------

    def setup_environment(self) -> None:
        # Before the process group starts: a refused configuration then fails on every rank at once.
        self._refuse(self.lightning_module.trainer)
        super().setup_environment()

    def _refuse(self, trainer) -> None:
        clip = trainer.gradient_clip_val
        if clip:
            raise ConfigError(f"Invalid Trainer(gradient_clip_val={clip!r}) with LocalclipStrategy: it clips before the "
                              "optimizer's own clipped step; clip with the optimizer (e.g. ClippedSGD's gamma) and leave it out")
        if self._layer_sync is not None:
            raise ConfigError("Invalid Trainer(sync_batchnorm=True) with LocalclipStrategy: it all-reduces batch statistics "
                              "at every forward; the averaged BatchNorm buffers are kept in step at each round instead")
        if getattr(self.precision_plugin, "scaler", None) is not None:
            precision = getattr(self.precision_plugin, "precision", type(self.precision_plugin).__name__)
            raise ConfigError(f"Invalid precision={precision!r} with LocalclipStrategy: fp16 loss scaling skips steps on one "
                              "rank only, which would shift its rounds; use precision='bf16-mixed' or '32-true'")

    # -- no DDP wrapper; the algorithm around the optimizer ------------------------------------

    def configure_ddp(self) -> None:
        # The LightningModule stays unwrapped: the algorithm's rounds replace DDP's gradient all-reduce.
        pass

    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)
        optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        if len(optimizers) != 1:
            raise ConfigError(f"Invalid configure_optimizers with LocalclipStrategy: it returned {len(optimizers)} optimizers; "
                              "the algorithm averages one model under one optimizer holding all its trainable parameters")
        if isinstance(optimizers[0], DistributedAlgorithm):
            raise ConfigError(f"Invalid optimizer {type(optimizers[0]).__name__} from configure_optimizers: return the inner "
                              "optimizer (e.g. ClippedSGD); LocalclipStrategy builds the algorithm around it")
        # The module is on its device and in its precision by now: the averager re-homes its
        # parameters into flat buffers, which must not be moved afterwards. Every rank starts
        # from rank 0's model (the algorithm broadcasts it).
        self._algorithm = compose(self.algorithm_name, self.lightning_module, optimizers[0], self.period, group=current(),
                                  **copy.deepcopy(self.round_options))
        # The lr schedulers keep the inner optimizer: the algorithm shares its param_groups.
        self.optimizers = [self._algorithm]

    # -- every rank evaluates and saves the same averaged model --------------------------------

    def on_validation_start(self) -> None:
        self.average()
        super().on_validation_start()

    def on_train_end(self) -> None:
        self.average()
        super().on_train_end()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        # Lightning takes a checkpoint on every rank (rank 0 writes it), so every rank gets here.
        self.average()
        return super().lightning_module_state_dict()
