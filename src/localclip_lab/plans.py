"""Sweep definitions: the named groups of runs behind the research questions, as data.

A sweep is a plain function ``(epochs) -> [(run_name, TrainConfig), ...]`` registered with
:func:`sweep`; it derives every run from a recipe with ``TrainConfig.replace`` and owns nothing
else (running is :mod:`localclip_lab.runner`'s, tables and figures are
:mod:`localclip_lab.reports.sweep`'s). Its default ``epochs`` is what the research question
needs; its first docstring line is what ``localclip sweep --list`` and the report print.

Every run pins one intra-op thread per worker (``threads=1``): the number of threads an op
splits its work into can change the order of floating-point sums, so pinning it is what makes a
sweep's numbers the same whatever ``--jobs`` and whatever machine runs it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

from localclip.errors import LocalclipError
from localclip.recipes import get_recipe
from localclip.algorithms.build import communication_period, spec
from localclip.train.config import TrainConfig

__all__ = ["REPORT_KINDS", "SWEEPS", "Plan", "SweepError", "SweepFailed", "SPEEDUP_TARGETS", "WORKER_STEPS_PER_EPOCH", "describe", "plan", "report_kind", "select", "sweep"]

Plan = list[tuple[str, TrainConfig]]

SWEEPS: dict[str, Callable[..., Plan]] = {}

# Worker-steps in one epoch (one pass of the whole system over the training set) of each recipe
# the sweeps use: PTB's 929,589 training tokens in b=5 columns of bptt 20, WikiText-2's 2,088,628
# in b=10 columns of bptt 20, and Fashion-MNIST's 60,000 images in batches of 16. Only the
# logging and evaluation intervals are derived from them, so an estimate off by a few steps
# changes nothing but where a record falls.
WORKER_STEPS_PER_EPOCH = {"ptb-small": 9296, "ptb-converge": 9296, "fmnist-resnet": 3750, "wt2-converge": 10443, "ptb-gpt-small": 1816}
LOGS_PER_EPOCH = 64


class SweepError(LocalclipError):
    """An unknown sweep or run name, a bad ``--jobs``, or a sweep folder that cannot be reported."""


class SweepFailed(SweepError):
    """Some runs of a sweep failed; the others ran. ``failures`` maps run name to its error."""

    def __init__(self, name: str, failures: dict[str, str]):
        self.failures = dict(failures)
        detail = "; ".join(f"{run}: {error}" for run, error in failures.items())
        super().__init__(f"sweep {name}: {len(failures)} run(s) failed: {detail}")


#: The report kind of each sweep that needs more than the plain table (see
#: :func:`localclip_lab.reports.sweep.report`): ``"converge"`` judges runs at the end of their
#: schedule against a naive baseline.
REPORT_KINDS: dict[str, str] = {}


def sweep(name: str, report: str | None = None):
    def register(fn):
        SWEEPS[name] = fn
        if report is not None:
            REPORT_KINDS[name] = report
        return fn

    return register


def report_kind(name: str) -> str:
    """How ``localclip report`` tabulates sweep ``name``: its registered kind, else its name."""
    return REPORT_KINDS.get(name, name)


def plan(name: str, epochs: float | None = None, only: Sequence[str] | None = None) -> Plan:
    """The sweep's runs in the order they start; ``epochs`` overrides the sweep's default and
    ``only`` keeps the runs it names."""
    if name not in SWEEPS:
        raise SweepError(f"Unknown sweep {name!r}; available: {', '.join(SWEEPS)} (see `localclip sweep NAME --list`)")
    if epochs is not None and not (epochs > 0 and math.isfinite(epochs)):
        raise SweepError(f"Invalid epochs for sweep {name}: {epochs!r} (expected a finite number > 0)")
    runs = SWEEPS[name]() if epochs is None else SWEEPS[name](epochs)
    names = [run for run, _ in runs]
    assert len(set(names)) == len(names), f"sweep {name} repeats a run name: {names}"
    selected = select(name, runs, only)
    return [(run, cfg) for run, cfg in runs if run in selected]


def select(name: str, runs: Plan, only: Sequence[str] | None) -> list[str]:
    """The names of ``runs`` that ``only`` keeps (all when it is empty), refusing unknown ones."""
    names = [run for run, _ in runs]
    if not only:
        return names
    unknown = [run for run in only if run not in names]
    if unknown:
        raise SweepError(f"Unknown run(s) of sweep {name}: {', '.join(unknown)}; its runs: {', '.join(names)}")
    return [run for run in names if run in set(only)]


def describe() -> list[str]:
    return [f"{name:13s} {(fn.__doc__ or '').strip().splitlines()[0]}" for name, fn in SWEEPS.items()]


def _sized(cfg: TrainConfig, recipe: str, evals_per_epoch: int) -> TrainConfig:
    """Logging and evaluation intervals per epoch, whatever N: about ``evals_per_epoch``
    validations per epoch, at steps that end a communication period, so that every validation
    scores the averaged model (between rounds each worker would score its own columns with its
    own model). The intervals do not depend on ``epochs``, so a run resumed with other epochs
    keeps its config. A full PTB validation costs about as much as 250 worker-steps. The workers
    and the period are the ones the algorithm runs (``single``: one worker; ``naive``: period 1),
    asked of its spec: the config is resolved once, by the sweep that runs it.
    """
    workers = spec(cfg.algorithm.name).workers(cfg.algorithm.workers)
    per_worker = max(1, WORKER_STEPS_PER_EPOCH[recipe] // workers)
    period = communication_period(cfg) or 1
    every = max(period, round(per_worker / evals_per_epoch / period) * period)
    return cfg.replace(eval_interval=every, log_interval=max(1, per_worker // LOGS_PER_EPOCH), threads=1)


def _ptb(epochs: float, evals_per_epoch: int = 8, **changes) -> TrainConfig:
    return _sized(get_recipe("ptb-small").replace(epochs=epochs, **changes), "ptb-small", evals_per_epoch)


def _fmnist(epochs: float, evals_per_epoch: int = 4, **changes) -> TrainConfig:
    return _sized(get_recipe("fmnist-resnet").replace(epochs=epochs, **changes), "fmnist-resnet", evals_per_epoch)


@sweep("isweep")
def isweep(epochs: float = 0.5) -> Plan:
    """RQ1/RQ3 — ptb-small, N=8: CELGC with I = 2..64 against naive parallel clipping, local SGD and one worker.

    Same seed, η = 20 and γ = 5 everywhere; local SGD is CELGC without clipping (γ = ∞), I=8.

    Naive parallel clipping is CELGC's I=1 counterpart (gradients averaged every step); ``single``
    trains one worker on the whole corpus (an epoch is then 8x as many steps per worker). 9 runs
    of ``epochs`` epochs each (5,312 worker-steps per epoch), 8 validations per epoch so that the
    report can find when each run first reaches naive parallel's final perplexity.
    """
    runs = [(f"celgc-I{i}", _ptb(epochs, algorithm="celgc", workers=8, period=i)) for i in (2, 4, 8, 16, 32, 64)]
    runs.append(("naive", _ptb(epochs, algorithm="naive", workers=8, period=1)))
    runs.append(("local-sgd-I8", _ptb(epochs, algorithm="local-sgd", workers=8, period=8)))
    runs.append(("single", _ptb(epochs, algorithm="single", workers=1)))
    return runs


@sweep("speedup")
def speedup(epochs: float = 1.0) -> Plan:
    """RQ2 — ptb-small, CELGC I=8 with the per-worker batch b=5 fixed and N = 1, 2, 4, 8.

    N=1 is the ``single`` algorithm (one worker; CELGC with a world of one is the same).

    Every run passes over the corpus ``epochs`` times, so N workers take 1/N as many steps each;
    the report compares the steps per worker each needs to reach the same training loss and
    validation perplexity. 4 runs of ``epochs`` epochs each, 8 validations per epoch.
    """
    runs = [("single-N1", _ptb(epochs, algorithm="single", workers=1))]
    runs += [(f"celgc-N{n}-I8", _ptb(epochs, algorithm="celgc", workers=n, period=8)) for n in (2, 4, 8)]
    return runs


@sweep("scenarios")
def scenarios(epochs: float = 0.5) -> Plan:
    """RQ4 — ptb-small, N=8: CELGC against naive parallel clipping with heterogeneous data, K=4 of 8, momentum 0.9.

    * ``naive``: the homogeneous naive parallel baseline; it is also partial participation's
      baseline (the paper compares with full-participation naive parallel, and naive parallel
      clipping has no partial variant: it would ignore ``participants``).
    * Heterogeneous data on PTB means that worker r keeps shard r instead of taking shard
      (r + e) mod N in epoch e; epoch 0 is the same either way, so the two heterogeneous runs get
      ``epochs + 1`` epochs: one epoch as in every run, then ``epochs`` where the data differs
      (the report's epochs column says so).
    * Momentum 0.9 makes the effective step about 1/(1-0.9) = 10x longer, so both momentum runs
      scale ptb-small's η = 20 and γ = 5 by 0.1 (η = 2, γ = 0.5: the same clip norm γ/η = 0.25);
      ``celgc-I4-mom0`` keeps η = 20, γ = 5 without momentum.

    The final perplexities are what matter here, so 4 validations per epoch instead of 8.
    """
    base = get_recipe("ptb-small")
    lr, gamma = base.local.lr * 0.1, base.local.gamma * 0.1
    ptb = functools.partial(_ptb, evals_per_epoch=4, workers=8)
    return [
        ("naive", ptb(epochs, algorithm="naive", period=1)),
        ("celgc-I8-hetero", ptb(epochs + 1, algorithm="celgc", period=8, heterogeneous=True)),
        ("naive-hetero", ptb(epochs + 1, algorithm="naive", period=1, heterogeneous=True)),
        ("celgc-I8-K4", ptb(epochs, algorithm="celgc", period=8, participants=4)),
        ("celgc-I4-mom0.9-lr0.1x", ptb(epochs, algorithm="celgc", period=4, momentum=0.9, lr=lr, gamma=gamma)),
        ("naive-mom0.9-lr0.1x", ptb(epochs, algorithm="naive", period=1, momentum=0.9, lr=lr, gamma=gamma)),
        ("celgc-I4-mom0", ptb(epochs, algorithm="celgc", period=4)),
    ]


@sweep("image")
def image(epochs: float = 5.0) -> Plan:
    """RQ5 — Fashion-MNIST ResNet-8 (BatchNorm), N=8: CELGC I=8 against naive parallel clipping and local SGD.

    The ``fmnist-resnet`` recipe: b=16, η=0.1, γ=1, weight decay 5e-4, BatchNorm buffers averaged
    with the parameters; local SGD is CELGC with γ = ∞, I=8.

    3 runs of ``epochs`` epochs each (3,750 worker-steps per epoch), 4 validations per epoch.
    """
    return [
        ("celgc-I8", _fmnist(epochs, algorithm="celgc", workers=8, period=8)),
        ("naive", _fmnist(epochs, algorithm="naive", workers=8, period=1)),
        ("local-sgd-I8", _fmnist(epochs, algorithm="local-sgd", workers=8, period=8)),
    ]


# -- beyond the paper --------------------------------------------------------------------------------


@sweep("episode-image")
def episode_image(epochs: float = 3.0) -> Plan:
    """EPISODE against CELGC and naive parallel clipping under label skew — Fashion-MNIST ResNet-8, N=8, I=8.

    The ``fmnist-resnet`` recipe with the heterogeneous split at similarity 0: the training set
    sorted by label and cut into 8 contiguous parts, so each worker sees one or two of the 10
    classes. With GroupNorm (``norm=group``): under this skew BatchNorm fails on its own, which
    ``naive-skew-bn`` (the recipe's BatchNorm, naive parallel clipping) shows; ``celgc-I8-iid``
    is CELGC on the iid split, the gap heterogeneity opens. 5 runs of ``epochs`` epochs
    (default 3), 4 validations per epoch.
    """
    skew = dict(heterogeneous=True, similarity=0.0)
    group = dict(model_options={"norm": "group"})
    return [
        ("naive-skew", _fmnist(epochs, algorithm="naive", workers=8, period=1, **skew, **group)),
        ("celgc-I8-skew", _fmnist(epochs, algorithm="celgc", workers=8, period=8, **skew, **group)),
        ("episode-I8-skew", _fmnist(epochs, algorithm="episode", workers=8, period=8, **skew, **group)),
        ("celgc-I8-iid", _fmnist(epochs, algorithm="celgc", workers=8, period=8, **group)),
        ("naive-skew-bn", _fmnist(epochs, algorithm="naive", workers=8, period=1, **skew)),
    ]


@sweep("compression")
def compression(epochs: float = 1.0) -> Plan:
    """Compressed rounds — ptb-small, N=8, CELGC I=8: float32 against bf16 and fp16 changes, same seed.

    3 runs of ``epochs`` epochs (default 1), 8 validations per epoch; ``comm/bytes`` is counted
    from the tensors each round sends.
    """
    return [(f"celgc-I8-{c}", _ptb(epochs, algorithm="celgc", workers=8, period=8, compression=c)) for c in ("none", "bf16", "fp16")]


# -- at convergence ----------------------------------------------------------------------------------

# The largest η at which local SGD without clipping (I=8, N=8, the ptb-converge recipe) does not
# diverge, from the `converge-lsgd` probe at 0.5 epoch (results/tuning/earlier-code/converge-lsgd): val/ppl at
# step 576 1,486 at η = 10 (898.7 at its end, swinging by 40 % within 5 steps), 552 at η = 5, 636
# at η = 2.5. All three ended finite, but η = 10 was not stable: 5 is the largest that learned steadily.
LOCAL_SGD_STABLE_LR = 5.0


def _converge(epochs: float, evals_per_epoch: int = 4, decay_start: float | None = None, recipe: str = "ptb-converge",
              **changes) -> TrainConfig:
    """``recipe`` (ptb-converge or wt2-converge) at ``epochs`` epochs, its lr/γ step decay
    rescaled to that length (see :func:`localclip.recipes.converge_schedule`)."""
    from localclip.recipes import converge_schedule

    base = get_recipe(recipe)
    if decay_start is None:
        decay_start = base.schedule.lr_decay_epochs[0] / base.schedule.epochs if base.schedule.lr_decay_epochs else 1.0
    decay_epochs, decay = converge_schedule(epochs, decay_start)
    cfg = base.replace(epochs=epochs, lr_decay_epochs=decay_epochs, lr_decay=decay, **changes)
    return _sized(cfg, recipe, evals_per_epoch)


@sweep("converge", report="converge")
def converge(epochs: float = 12.0) -> Plan:
    """Claims at convergence — ptb-converge, N=8: naive, CELGC I=8/32/256, local SGD, scenarios, a second seed.

    Every run is the ``ptb-converge`` recipe (dropout and lr/γ step decay as tuned on naive
    parallel clipping by ``converge-tune``); nothing is tuned for CELGC. The main runs last
    ``epochs`` epochs (default 12):

    * ``naive`` (single-machine clipped SGD with the global batch 8·5), ``celgc-I8``,
      ``celgc-I32``, ``celgc-I256``. An epoch is 1,162 local steps per worker, so I=1024 would
      give about one round per epoch (the end-of-epoch average): it is left out.
    * ``local-sgd-I8-lr20`` (no clipping, the same η = 20) and ``local-sgd-I8-lr{LOCAL_SGD_STABLE_LR}``
      (the largest η of the ``converge-lsgd`` probe that does not diverge).
    * ``naive-s2``, ``celgc-I32-s2``: the headline pair again with another seed.

    The scenarios last half as long (6 epochs at the default), with the same decay compressed
    to that length, and their own naive baselines at that length: heterogeneous shards
    (``naive-hetero``, ``celgc-I32-hetero``), partial participation K=4 of 8 (``celgc-I16-K4``
    against ``naive-short``), momentum 0.9 with one η = 2, γ = 0.5 for both (``naive-mom0.9``,
    ``celgc-I4-mom0.9``; the clip norm γ/η stays 0.25). When that is the main length, ``naive``
    is their baseline and ``naive-short`` is left out.

    Beyond the paper, on the same recipe: CELGC I=32 and I=256 with DiLoCo's outer Nesterov step
    (``-nesterov``), CELGC I=8 with bf16 rounds (``celgc-I8-bf16``) and EPISODE I=32 on the
    heterogeneous shards (``episode-I32-hetero``), and EPISODE and CELGC I=32 heterogeneous at
    ``LOCAL_SGD_STABLE_LR`` with the same γ/η (``-lr5``). 4 validations per epoch.
    """
    base = get_recipe("ptb-converge")
    seed2 = base.run.seed + 1
    short = max(6.0, epochs / 2) if epochs >= 6 else epochs / 2
    stable = LOCAL_SGD_STABLE_LR
    mom = dict(momentum=0.9, lr=base.local.lr * 0.1, gamma=base.local.gamma * 0.1)
    at_stable = dict(lr=stable, gamma=base.local.gamma * stable / base.local.lr)
    # The order is the order of the questions: the headline pair first, so a sweep cut short by
    # the end of a session has answered the most.
    runs = [
        ("naive", _converge(epochs, algorithm="naive", period=1)),
        ("celgc-I32", _converge(epochs, algorithm="celgc", period=32)),
        ("celgc-I8", _converge(epochs, algorithm="celgc", period=8)),
        ("celgc-I256", _converge(epochs, algorithm="celgc", period=256)),
        (f"local-sgd-I8-lr{stable:g}", _converge(epochs, algorithm="local-sgd", period=8, lr=stable)),
        ("local-sgd-I8-lr20", _converge(epochs, algorithm="local-sgd", period=8)),
    ]
    if short != epochs:  # else the scenarios' baseline is ``naive`` itself
        runs.append(("naive-short", _converge(short, algorithm="naive", period=1)))
    runs += [
        ("naive-hetero", _converge(short, algorithm="naive", period=1, heterogeneous=True)),
        ("celgc-I32-hetero", _converge(short, algorithm="celgc", period=32, heterogeneous=True)),
        ("celgc-I16-K4", _converge(short, algorithm="celgc", period=16, participants=4)),
        ("naive-mom0.9", _converge(short, algorithm="naive", period=1, **mom)),
        ("celgc-I4-mom0.9", _converge(short, algorithm="celgc", period=4, **mom)),
        ("naive-s2", _converge(epochs, algorithm="naive", period=1, seed=seed2)),
        ("celgc-I32-s2", _converge(epochs, algorithm="celgc", period=32, seed=seed2)),
        # Beyond the paper, judged against the runs above: DiLoCo's outer Nesterov
        # step (outer_lr 0.7, momentum 0.9), bf16 rounds, and EPISODE on heterogeneous shards.
        ("celgc-I32-nesterov", _converge(epochs, algorithm="celgc", period=32, outer_optimizer="nesterov")),
        ("celgc-I256-nesterov", _converge(epochs, algorithm="celgc", period=256, outer_optimizer="nesterov")),
        ("celgc-I8-bf16", _converge(epochs, algorithm="celgc", period=8, compression="bf16")),
        ("episode-I32-hetero", _converge(short, algorithm="episode", period=32, heterogeneous=True)),
        # EPISODE runs a round that starts below the clip norm unclipped, so at η = 20 it diverges
        # like local SGD; these two compare it with CELGC at the stable η, same clip norm γ/η.
        ("episode-I32-hetero-lr5", _converge(short, algorithm="episode", period=32, heterogeneous=True, **at_stable)),
        ("celgc-I32-hetero-lr5", _converge(short, algorithm="celgc", period=32, heterogeneous=True, **at_stable)),
    ]
    return runs


CONVERGE_TUNE_DROPOUTS = (0.0, 0.2, 0.4)
CONVERGE_TUNE_DECAY_STARTS = (1 / 6, 1 / 2)  # besides the recipe's own 1/3


@sweep("converge-tune", report="converge")
def converge_tune(epochs: float = 6.0) -> Plan:
    """Tuning ptb-converge on naive parallel clipping only: dropout 0, 0.2, 0.4 and when the lr/γ decay starts.

    Naive parallel clipping, N=8, ``epochs`` epochs (default 6, half the converge length, the
    decay compressed to it): dropout 0.0, 0.2 and 0.4 with the decay starting a third of the way
    in (the recipe's), then dropout 0.2 with the decay starting at 1/6 and at 1/2 of the run.
    The decay always ends at 1/256 of the initial lr and γ. 5 runs, 4 validations per epoch;
    set the recipe's ``dropout`` and ``lr_decay_epochs`` from the best final val/ppl.
    """
    runs = [(f"naive-d{d:g}", _converge(epochs, algorithm="naive", period=1, decay_start=1 / 3, model_options=_dropout(d)))
            for d in CONVERGE_TUNE_DROPOUTS]
    runs += [(f"naive-d0.2-decay{start:.2f}", _converge(epochs, algorithm="naive", period=1, decay_start=start, model_options=_dropout(0.2)))
             for start in CONVERGE_TUNE_DECAY_STARTS]
    return runs


@sweep("converge-lsgd", report="converge")
def converge_lsgd(epochs: float = 2.0) -> Plan:
    """Probe for local SGD's largest non-diverging η on ptb-converge (N=8, I=8, no clipping): η = 10, 5, 2.5, 1.25.

    Short runs (default 2 epochs, the recipe's decay compressed to them): divergence under local
    SGD shows within the first epoch at η = 20. The converge sweep takes the largest η whose run
    ends with a finite val/ppl (``LOCAL_SGD_STABLE_LR`` in this module).
    """
    return [(f"local-sgd-I8-lr{lr:g}", _converge(epochs, algorithm="local-sgd", period=8, lr=lr)) for lr in (10.0, 5.0, 2.5, 1.25)]


def _dropout(value: float) -> dict:
    return {**get_recipe("ptb-converge").workload.model_options, "dropout": value}


# -- a fair comparison: both sides tuned on the same grid ------------------------------------------

#: The clipping parameters γ both naive parallel clipping and CELGC are tuned over, at the
#: recipe's η = 20: clip norms γ/η of 0.25 (the recipe's), 0.5 and 0.7.
TUNE_GAMMAS = (5.0, 10.0, 14.0)


@sweep("tune-gamma")
def tune_gamma(epochs: float = 3.0) -> Plan:
    """Tuning γ for both sides alike — ptb-converge, N=8: naive and CELGC I=32 at γ = 5, 10, 14 (η = 20).

    The same grid and the same budget for each side: one run per γ of ``epochs`` epochs (default
    3, a quarter of the converge length, the recipe's lr/γ decay compressed to it, so each run
    ends its own schedule). A γ at which a side is unstable stops at its first validation (a
    quarter epoch in), which makes every run its own stability probe. The γ with the lower final
    val/ppl is that side's best; the 12-epoch comparison runs each side at its own best. The
    pairs are ordered so that two jobs run one naive and one CELGC run side by side.
    """
    runs = []
    for gamma in TUNE_GAMMAS:
        runs.append((f"naive-g{gamma:g}", _converge(epochs, algorithm="naive", period=1, gamma=gamma)))
        runs.append((f"celgc-I32-g{gamma:g}", _converge(epochs, algorithm="celgc", period=32, gamma=gamma)))
    return runs


# Each side's best γ from `tune-gamma` (3 epochs, results/tuning/tune-gamma): naive 160.1 / 162.3
# / 161.5 final val/ppl at γ = 5 / 10 / 14, CELGC I=32 217.6 / 212.4 / 216.8. Naive's best lies on
# the grid's lower edge; a smaller γ could only make naive better and widen the gap.
NAIVE_BEST_GAMMA = 5.0
CELGC_BEST_GAMMA = 10.0


@sweep("fair", report="converge")
def fair(epochs: float = 12.0) -> Plan:
    """The PTB claims with both sides at their own tuned γ — ptb-converge, N=8, 12 epochs: naive vs CELGC at I = 8, 32, 256, 1024, a second seed, K=4, momentum.

    ``NAIVE_BEST_GAMMA`` and ``CELGC_BEST_GAMMA`` come from ``tune-gamma`` (the same grid and
    budget for both sides). Every run ends its own schedule (the recipe's lr/γ decay, ending at
    1/256 of the initial values). In the order of the questions:

    * ``naive`` and ``celgc-I32``: the headline pair, each at its own best γ. ``naive`` has the
      configuration of the ``converge`` sweep's naive run, which ``localclip report converge
      --check`` reproduces with this code; a link to that run's folder, or a copy of it, counts
      as this one.
    * ``celgc-I8``, ``celgc-I1024`` (the paper's headline period: an epoch is 1,162 local steps,
      so about one round an epoch), ``celgc-I256``: the period, at CELGC's best γ.
    * ``naive-s2``, ``celgc-I32-s2``: the headline pair with a second seed.
    * ``celgc-I16-K4``: partial participation (4 of 8 workers per round), against ``naive``.
    * ``naive-mom0.9``, ``celgc-I4-mom0.9``: momentum 0.9 at η = 2, γ = 0.5 for both (clip norm
      0.25), the η of the ``momentum-probe`` sweep at which both sides did best.
    * ``celgc-I32-24ep``: what a user pays at equal time: CELGC I = 32 for twice the epochs (the
      same schedule shape, stretched), against ``naive``.

    4 validations per epoch.
    """
    base = get_recipe("ptb-converge")
    seed2 = base.run.seed + 1
    naive = dict(algorithm="naive", period=1, gamma=NAIVE_BEST_GAMMA)
    celgc = dict(algorithm="celgc", gamma=CELGC_BEST_GAMMA)
    mom = dict(momentum=0.9, lr=2.0, gamma=2.0 * base.local.gamma / base.local.lr)
    return [
        ("naive", _converge(epochs, **naive)),
        ("celgc-I32", _converge(epochs, period=32, **celgc)),
        ("celgc-I8", _converge(epochs, period=8, **celgc)),
        ("celgc-I1024", _converge(epochs, period=1024, **celgc)),
        ("celgc-I256", _converge(epochs, period=256, **celgc)),
        ("naive-s2", _converge(epochs, seed=seed2, **naive)),
        ("celgc-I32-s2", _converge(epochs, period=32, seed=seed2, **celgc)),
        ("celgc-I16-K4", _converge(epochs, period=16, participants=4, **celgc)),
        ("naive-mom0.9", _converge(epochs, algorithm="naive", period=1, **mom)),
        ("celgc-I4-mom0.9", _converge(epochs, algorithm="celgc", period=4, **mom)),
        ("celgc-I32-24ep", _converge(2 * epochs, period=32, **celgc)),
    ]


@sweep("wt2", report="converge")
def wt2(epochs: float = 6.0) -> Plan:
    """WikiText-2 — wt2-converge (ptb-converge's model and schedule shape, b = 10, N = 8): naive vs CELGC I = 32, each at its PTB-tuned γ.

    Naive parallel clipping is single-machine clipped SGD with the global batch of 80 sequences,
    the paper's one-GPU baseline. γ is each side's best from ``tune-gamma`` on PTB
    (``NAIVE_BEST_GAMMA``, ``CELGC_BEST_GAMMA``); it was not tuned again on WikiText-2. 2 runs
    of ``epochs`` epochs (default 6, about 45-50 minutes an epoch on one core), 4 validations
    per epoch.
    """
    return [
        ("naive", _converge(epochs, recipe="wt2-converge", algorithm="naive", period=1, gamma=NAIVE_BEST_GAMMA)),
        ("celgc-I32", _converge(epochs, recipe="wt2-converge", algorithm="celgc", period=32, gamma=CELGC_BEST_GAMMA)),
    ]


@sweep("streaming", report="converge")
def streaming(epochs: float = 12.0) -> Plan:
    """Streaming and compressed rounds at the end of training — ptb-converge, N=8, CELGC I=8 at its tuned γ: P=4 fragments with overlap 1, int4 with and without error feedback, bf16.

    Each run is judged against plain CELGC I = 8 (``celgc-I8``, the configuration of the ``fair``
    sweep's: a link to that run's folder, or a copy of it, counts as this one) and naive parallel
    clipping (``naive``, likewise ``fair``'s). The streaming runs are validated at the end of each epoch
    only (the others 4 times an epoch): in the middle of an epoch a streaming run's evaluation
    scores the mean of the workers' live models, a different model from the just-averaged one
    the other runs score there, whereas at an epoch's end every run scores its averaged model.
    Every run's final validation is at the end of its schedule. ``celgc-I8-bf16`` (bf16 rounds) replaces
    the ``converge`` sweep's run of that name, which was made at γ = 5 by code that no longer
    reproduces it. ``celgc-I8-P4`` (fragments, blocking rounds), ``celgc-I8-P4-tau1-a0.5``
    (overlap_alpha 0.5) and ``celgc-I8-P4-tau1-carry`` (overlap_merge carry: every in-flight step
    kept) separate what the fragments and the dropped in-flight steps cost. ``celgc-I32-P4-tau1``
    against ``celgc-I32`` (``fair``'s, likewise) measures the overlap's cost at a period four times
    longer, where the steps after a round are one in 32 instead of one in 8. 11 runs of
    ``epochs`` epochs.
    """
    celgc = dict(algorithm="celgc", period=8, gamma=CELGC_BEST_GAMMA)
    return [
        ("naive", _converge(epochs, algorithm="naive", period=1, gamma=NAIVE_BEST_GAMMA)),
        ("celgc-I8", _converge(epochs, **celgc)),
        ("celgc-I8-P4-tau1", _converge(epochs, **celgc, fragments=4, overlap=1).replace(eval_interval=0)),
        ("celgc-I8-int4", _converge(epochs, **celgc, compression="int4")),
        ("celgc-I8-int4-noef", _converge(epochs, **celgc, compression="int4", error_feedback=False)),
        ("celgc-I8-bf16", _converge(epochs, **celgc, compression="bf16")),
        # Which part of a streaming round costs quality: the fragments alone, and the overlap
        # with half of the local steps taken meanwhile kept (α = 0.5 instead of dropping them).
        ("celgc-I8-P4", _converge(epochs, **celgc, fragments=4).replace(eval_interval=0)),
        ("celgc-I8-P4-tau1-a0.5", _converge(epochs, **celgc, fragments=4, overlap=1, overlap_alpha=0.5).replace(eval_interval=0)),
        # ... and all of them kept: the average of the snapshot plus each worker's own steps since.
        ("celgc-I8-P4-tau1-carry", _converge(epochs, **celgc, fragments=4, overlap=1, overlap_merge="carry").replace(eval_interval=0)),
        # The overlap at a longer period: its cost should shrink with the share of steps it touches.
        ("celgc-I32", _converge(epochs, **{**celgc, "period": 32})),
        ("celgc-I32-P4-tau1", _converge(epochs, **{**celgc, "period": 32}, fragments=4, overlap=1).replace(eval_interval=0)),
    ]


#: The validation perplexities at which ``speedup-converge`` counts each N's steps: near the end
#: of the 12-epoch schedule (CELGC I=8 at N=8 and γ = 5 ended it at 118.3).
SPEEDUP_TARGETS = (125.0, 120.0)


@sweep("speedup-converge", report="speedup-converge")
def speedup_converge(epochs: float = 12.0) -> Plan:
    """Speed-up at the end of training — ptb-converge, CELGC I=8 at N = 1, 2, 4, 8 (b = 5, η and CELGC's tuned γ fixed).

    Every run makes ``epochs`` passes over the corpus (default 12, the converge schedule), so N
    workers take 1/N as many steps each as one worker; N = 1 is the ``single`` algorithm (a world
    of one averages nothing). γ is ``CELGC_BEST_GAMMA``, so ``celgc-I8-N8`` has the
    configuration of the ``fair`` sweep's ``celgc-I8`` (a link to that run's folder, or a copy of
    it, counts as this one). The report compares validation at equal epochs (equal samples) and the steps per
    worker each N needs to reach ``SPEEDUP_TARGETS``. 4 runs, 4 validations per epoch.
    """
    tuned = dict(gamma=CELGC_BEST_GAMMA)
    runs = [("single-N1", _converge(epochs, algorithm="single", workers=1, **tuned))]
    runs += [(f"celgc-I8-N{n}", _converge(epochs, algorithm="celgc", workers=n, period=8, **tuned)) for n in (2, 4, 8)]
    return runs


AWD_REGIME_STEPS = 300


@sweep("awd-regime", report="regime")
def awd_regime(epochs: float = 1.0) -> Plan:
    """The paper's regime measured — ptb-awd (AWD-LSTM, N=8, b=3, clip norm 0.25, variable BPTT), naive, 300 steps: does naive clip every step?

    Naive parallel clipping clips the mean of the 8 workers' gradients; its ``clip/fraction`` is
    how often that mean exceeds the clip norm, and ``clip/local_fraction`` how often one worker's
    own 3-sequence gradient does (which is what CELGC's workers clip). Both, and the two norms,
    are logged every 10 steps over the first ``AWD_REGIME_STEPS`` steps (``epochs`` only bounds
    the run). One run; on one core about an hour and a half.
    """
    cfg = get_recipe("ptb-awd").replace(
        algorithm="naive", epochs=epochs, max_steps=AWD_REGIME_STEPS, log_interval=10,
        eval_interval=0, threads=1, checkpoint_interval=50, asgd_patience=0,
    )
    return [("naive", cfg)]


# -- an image task where clipping binds ------------------------------------------------------------

IMAGE_PROBE_LRS = (0.5, 1.0, 2.0)
IMAGE_PROBE_GAMMA = 0.5


@sweep("image-probe")
def image_probe(epochs: float = 1.0) -> Plan:
    """Where clipping matters on images — Fashion-MNIST ResNet-8 (GroupNorm), N=8, I=8: local SGD and CELGC (γ=0.5) at η = 0.5, 1, 2.

    The recipe's η = 0.1 and γ = 1 (clip norm 10) never clip: a worker's 16-image gradient has a
    norm of about 1-2. These short probes (default 1 epoch) look for an η at which local SGD
    without clipping diverges or falls clearly behind while CELGC, with γ = 0.5 (clip norm 0.5/η),
    clips 30-100 % of its steps. GroupNorm, because BatchNorm makes the loss scale-invariant in
    most weights, which hides what a step's length does. 6 runs, 4 validations per epoch.
    """
    group = dict(model_options={"norm": "group"})
    runs = []
    for lr in IMAGE_PROBE_LRS:
        runs.append((f"local-sgd-I8-lr{lr:g}", _fmnist(epochs, algorithm="local-sgd", workers=8, period=8, lr=lr, **group)))
        runs.append((f"celgc-I8-lr{lr:g}", _fmnist(epochs, algorithm="celgc", workers=8, period=8, lr=lr, gamma=IMAGE_PROBE_GAMMA, **group)))
    return runs


MOMENTUM_PROBE_LRS = (0.5, 1.0, 2.0)


@sweep("momentum-probe")
def momentum_probe(epochs: float = 1.0) -> Plan:
    """One η for both sides under momentum 0.9 — ptb-converge, N=8: naive and CELGC I=4 at η = 0.5, 1, 2 (clip norm 0.25).

    Momentum μ = 0.9 makes a step about 1/(1 − μ) = 10x longer, so the η of ptb-converge (20) is
    scaled down; γ follows η so that the clip norm γ/η stays the recipe's 0.25. Short runs
    (default 1 epoch, before the recipe's decay starts): the momentum comparison at 12 epochs
    uses the η whose worse side is best (the same η for both, as the paper compares them). 6 runs,
    4 validations per epoch.
    """
    base = get_recipe("ptb-converge")
    clip_norm = base.local.gamma / base.local.lr
    runs = []
    for lr in MOMENTUM_PROBE_LRS:
        mom = dict(momentum=0.9, lr=lr, gamma=lr * clip_norm)
        runs.append((f"naive-mom0.9-lr{lr:g}", _converge(epochs, algorithm="naive", period=1, **mom)))
        runs.append((f"celgc-I4-mom0.9-lr{lr:g}", _converge(epochs, algorithm="celgc", period=4, **mom)))
    return runs


# The image setting where clipping binds, from `image-probe` (1 epoch, results/images/earlier-code/image-probe):
# local SGD reaches 74.0 % and 74.2 % test accuracy at η = 0.5 and 1 but 65.4 % at η = 2, while
# CELGC with γ = 0.5 clips 89-100 % of its steps at every η (a step of length γ, whatever η).
IMAGE_CLIP_LR = 2.0
IMAGE_CLIP_GAMMA = IMAGE_PROBE_GAMMA


@sweep("image-clip")
def image_clip(epochs: float = 10.0) -> Plan:
    """RQ5 where clipping binds — Fashion-MNIST GroupNorm ResNet-8, N=8, η=2, γ=0.5: naive, CELGC I=8, local SGD I=8 (iid); naive, CELGC, EPISODE I=8 (label skew).

    ``IMAGE_CLIP_LR`` and ``IMAGE_CLIP_GAMMA`` from the ``image-probe`` sweep: an η at which local
    SGD without clipping is clearly worse and CELGC's workers clip nearly every step. The paper's
    step decay shape (lr and γ × 0.1 at half and three quarters of the run: epochs 5 and 8 of the
    default 10). The label-skewed split gives each worker one or two classes (similarity 0: the
    training set sorted by label and cut into 8 parts). 6 runs of ``epochs`` epochs, 4 validations
    per epoch.
    """
    common = dict(workers=8, lr=IMAGE_CLIP_LR, gamma=IMAGE_CLIP_GAMMA, model_options={"norm": "group"},
                  lr_decay_epochs=[round(epochs * 0.5), round(epochs * 0.75)], lr_decay=0.1)
    skew = dict(heterogeneous=True, similarity=0.0)
    return [
        ("naive", _fmnist(epochs, algorithm="naive", period=1, **common)),
        ("celgc-I8", _fmnist(epochs, algorithm="celgc", period=8, **common)),
        ("local-sgd-I8", _fmnist(epochs, algorithm="local-sgd", period=8, **common)),
        ("naive-skew", _fmnist(epochs, algorithm="naive", period=1, **common, **skew)),
        ("celgc-I8-skew", _fmnist(epochs, algorithm="celgc", period=8, **common, **skew)),
        ("episode-I8-skew", _fmnist(epochs, algorithm="episode", period=8, **common, **skew)),
    ]


# -- a transformer where clipping binds -------------------------------------------------------------

#: Local SGD at ptb-gpt-small's η = 3 blows up within its first logging interval; 200 steps
#: show it (its loss and validation are infinite from there) without spending two epochs on it.
GPT_LOCAL_SGD_STEPS = 200


@sweep("gpt")
def gpt(epochs: float = 2.0) -> Plan:
    """A transformer where clipping binds — ptb-gpt-small, N=4, η=3, γ=0.5, constant η: naive, CELGC I=8, local SGD I=8.

    The recipe's step for every run (from the one-worker scan of benchmarks/gpt_lr_scan.py);
    local SGD is CELGC without clipping (γ = ∞) at the same η and runs ``GPT_LOCAL_SGD_STEPS``
    steps. Validation at the end of each epoch. 3 runs of ``epochs`` epochs (default 2: 908
    local steps per worker).
    """
    base = get_recipe("ptb-gpt-small").replace(epochs=epochs, threads=1)
    return [
        ("naive", base.replace(algorithm="naive", period=1)),
        ("celgc-I8", base.replace(algorithm="celgc", period=8)),
        ("local-sgd-I8", base.replace(algorithm="local-sgd", period=8, max_steps=GPT_LOCAL_SGD_STEPS)),
    ]


# -- parity: what closes CELGC's gap to naive at long periods --------------------------------------

PARITY_OUTER_LRS = (0.5, 0.7, 1.0)
PARITY_DROPOUT = 0.2
PARITY_SECOND_SEED = 2021


@sweep("parity", report="converge")
def parity(epochs: float = 12.0) -> Plan:
    """Closing CELGC's gap at I = 32 — ptb-converge, N=8, 12 epochs, each side at its tuned γ: outer Nesterov (outer lr 0.5 / 0.7 / 1, and decaying), post-local SGD, dropout and a constant-lr schedule for both sides.

    The screening stage of the parity question: which method brings CELGC at I = 32 (32x fewer
    rounds than naive) to naive parallel clipping's final validation perplexity. Every run of
    this sweep is made by one pinned commit, its own ``naive`` and plain ``celgc-I32`` included,
    so each comparison is between runs of one code version on one kind of CPU. In the order of
    the questions:

    * ``naive`` (γ = ``NAIVE_BEST_GAMMA``) and ``celgc-I32-nesterov`` (DiLoCo's outer Nesterov,
      outer lr 0.7, momentum 0.9, at γ = ``CELGC_BEST_GAMMA``): the baseline and the method that
      cut the 6-epoch perplexity most (7.2 %).
    * ``celgc-I32``: plain averaging at the same commit.
    * ``celgc-I32-nesterov-olr1`` and ``-olr0.5``: the outer lr's grid (``PARITY_OUTER_LRS``).
    * ``naive-drop0.2`` and ``celgc-I32-drop0.2``: dropout ``PARITY_DROPOUT`` for both sides
      (the recipe's 0 overfits past epoch 10 at 24 epochs); each side at its tuned γ.
    * ``celgc-I32-nesterov-decay``: outer Nesterov whose outer lr takes the inner lr's step decay
      (``outer_lr_decay``), since a constant outer lr hurt at I = 256 while the inner lr decayed.
    * ``celgc-I32-postlocal1``: post-local SGD, a round after every step for the first epoch
      (``warmup_steps``, a whole number of periods), then every 32 steps: its warm-up rounds
      count: about 1,560 in all, 3.5x plain I = 32's.
    * ``naive-const-asgd`` and ``celgc-I32-const-asgd``: the paper's kind of schedule for both
      sides, a constant lr and γ with the NT-ASGD-like average of end-of-epoch weights
      (``asgd_patience`` 1: it starts after the first epoch whose validation does not improve).
    * ``naive-const-asgd-s2021`` and ``celgc-I32-const-asgd-s2021``: that pair with a second seed
      (``PARITY_SECOND_SEED``), since that pair is the one where CELGC drew level.
    * ``celgc-I256-const-asgd`` and its ``-s2021``: the constant-lr schedule at I = 256 with both
      seeds, against the constant-lr naive runs above (whether the parity holds at 8x fewer
      rounds again).
    * ``celgc-I32-drop0.2-24ep``: CELGC with dropout given twice the epochs (the decay rescaled
      to 24), judged against naive's 12: with dropout CELGC under-fits (train perplexity 110
      against naive's 43 without dropout) and stalls once the decay starts, while its rounds
      (894) stay 15.6x fewer than naive's.
    * ``naive-const-asgd-drop0.2`` and ``celgc-I32-const-asgd-drop0.2``: the constant-lr pair
      with dropout for both sides: whether the schedule where CELGC drew level holds its parity
      once naive is regularised.

    Rounds: a Nesterov run sends exactly what plain averaging sends (one round every 32 steps).
    4 validations per epoch, at the same steps for every run of a period.
    """
    naive = dict(algorithm="naive", period=1, gamma=NAIVE_BEST_GAMMA)
    celgc = dict(algorithm="celgc", period=32, gamma=CELGC_BEST_GAMMA)
    nesterov = dict(outer_optimizer="nesterov", outer_momentum=0.9)
    drop = dict(model_options=_dropout(PARITY_DROPOUT))
    olr = {lr: (f"celgc-I32-nesterov-olr{lr:g}", _converge(epochs, **celgc, **nesterov, outer_lr=lr)) for lr in PARITY_OUTER_LRS}
    # The order is the order of the questions: the first two runs started the screen; the
    # rest is ordered by what they showed (a constant outer lr of 0.7 trailed plain averaging).
    runs = [
        ("naive", _converge(epochs, **naive)),
        ("celgc-I32-nesterov", olr[0.7][1]),
        ("celgc-I32", _converge(epochs, **celgc)),
        ("celgc-I32-postlocal1", _converge(epochs, **celgc, warmup_steps=_whole_periods(_epoch_steps(8), 32))),
        (f"naive-drop{PARITY_DROPOUT:g}", _converge(epochs, **naive, **drop)),
        (f"celgc-I32-drop{PARITY_DROPOUT:g}", _converge(epochs, **celgc, **drop)),
        ("celgc-I32-nesterov-decay", _converge(epochs, **celgc, **nesterov, outer_lr=0.7, outer_lr_decay=True)),
        olr[0.5],
        ("naive-const-asgd", _converge(epochs, decay_start=1.0, **naive, asgd_patience=1)),
        ("celgc-I32-const-asgd", _converge(epochs, decay_start=1.0, **celgc, asgd_patience=1)),
        olr[1.0],
    ]
    const = {name: cfg for name, cfg in runs if name.endswith("-const-asgd")}
    runs += [(f"{name}-s{PARITY_SECOND_SEED}", cfg.replace(seed=PARITY_SECOND_SEED)) for name, cfg in const.items()]
    i256 = _converge(epochs, decay_start=1.0, **{**celgc, "period": 256}, asgd_patience=1)
    runs += [("celgc-I256-const-asgd", i256), (f"celgc-I256-const-asgd-s{PARITY_SECOND_SEED}", i256.replace(seed=PARITY_SECOND_SEED))]
    dropped = f"drop{PARITY_DROPOUT:g}"
    runs += [(f"celgc-I32-{dropped}-24ep", _converge(2 * epochs, **celgc, **drop)),
             *((f"{name}-{dropped}", cfg.replace(**drop)) for name, cfg in const.items())]
    return runs


# -- the transformer, DiLoCo's own setting: AdamW inside, Nesterov outside ---------------------------

GPT_PARITY_PERIODS = (32, 128)
GPT_PARITY_SEEDS = (2020, 2021)
GPT_PARITY_EVAL_INTERVAL = 256
"""Validation every 256 local steps for every run (about 2 per epoch): a multiple of each
period, so every run is scored at the same steps and every score is of an averaged model."""


@sweep("gpt-parity", report="converge")
def gpt_parity(epochs: float = 10.0) -> Plan:
    """The transformer in DiLoCo's setting — ptb-gpt-small with AdamW, N=4, 10 epochs: naive (the averaged gradient clipped) against clipped AdamW inside and outer Nesterov at I = 32 and 128, seeds 2020 and 2021.

    Every run takes the recipe's AdamW settings (lr 2e-3, betas 0.9/0.95, weight decay 0.1,
    gradient norm clipped to 1: nanoGPT's), the same tokens and the same schedule: the lr constant
    for the first third, then halved each epoch (``converge_schedule``, 1/256 in all). Naive
    clips and steps on the workers' mean gradient every step; the DiLoCo runs clip each worker's
    own gradient, take AdamW steps locally, and at each round take an outer Nesterov step (lr 0.7,
    momentum 0.9: DiLoCo's defaults, not tuned here; nor is naive's lr, the recipe's). Plain
    averaging at I = 32 (seed 2020) separates what the outer step adds. Two more plain I = 32
    runs test why averaging trails: each worker's AdamW step has full length whatever the noise
    in its gradient, and the mean of four such steps cancels their noise, so the averaged model
    may move about half as far as naive's, which normalises after averaging. ``avg-I32-olr2``
    doubles each round's displacement (outer SGD, lr 2, no momentum); ``avg-I32-lr2x`` doubles
    the inner lr instead. ``avg-I32-lr0.5x``, ``naive-lr0.5x`` and ``naive-lr2x`` complete a grid
    of the lr (0.5x, 1x, 2x the recipe's) for both sides, so that each is read at its own best
    lr on the same grid.
    """
    from localclip.recipes import converge_schedule, for_inner_optimizer

    base = for_inner_optimizer("ptb-gpt-small", get_recipe("ptb-gpt-small").replace(inner_optimizer="adamw"), set())
    decay_epochs, decay = converge_schedule(epochs, 1 / 3)
    per_worker = WORKER_STEPS_PER_EPOCH["ptb-gpt-small"] // base.algorithm.workers
    base = base.replace(epochs=epochs, lr_decay_epochs=decay_epochs, lr_decay=decay, threads=1,
                               eval_interval=GPT_PARITY_EVAL_INTERVAL, log_interval=max(1, per_worker // LOGS_PER_EPOCH),
                               checkpoint_interval=GPT_PARITY_EVAL_INTERVAL)
    diloco = dict(algorithm="celgc", outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9)
    def seed_runs(seed: int) -> Plan:
        tag = "" if seed == GPT_PARITY_SEEDS[0] else f"-s{seed}"
        return [(f"naive{tag}", base.replace(algorithm="naive", period=1, seed=seed)),
                *((f"diloco-I{period}{tag}", base.replace(**diloco, period=period, seed=seed)) for period in GPT_PARITY_PERIODS)]

    # The first seed's runs, plain averaging (what the outer step adds), then the second seed's.
    avg = base.replace(algorithm="celgc", period=32, seed=GPT_PARITY_SEEDS[0])
    plain = [("avg-I32", avg),
             ("avg-I32-olr2", avg.replace(outer_optimizer="sgd", outer_lr=2.0, outer_momentum=0.0)),
             ("avg-I32-lr2x", avg.replace(lr=2 * avg.local.lr))]
    naive = base.replace(algorithm="naive", period=1, seed=GPT_PARITY_SEEDS[0])
    lr_grid = [("avg-I32-lr0.5x", avg.replace(lr=avg.local.lr / 2)),
               ("naive-lr0.5x", naive.replace(lr=naive.local.lr / 2)), ("naive-lr2x", naive.replace(lr=2 * naive.local.lr))]
    return [*seed_runs(GPT_PARITY_SEEDS[0]), *plain, *(run for seed in GPT_PARITY_SEEDS[1:] for run in seed_runs(seed)), *lr_grid]


def _epoch_steps(workers: int, recipe: str = "ptb-converge") -> int:
    """Local steps per worker in one epoch of ``recipe`` at ``workers`` workers."""
    return WORKER_STEPS_PER_EPOCH[recipe] // workers


def _whole_periods(steps: int, period: int) -> int:
    """``steps`` rounded to a whole number of periods (at least one)."""
    return max(period, round(steps / period) * period)


# -- churn: what a worker's absences cost in quality (docs/algorithm.md section 11) ---------------

CHURN_AWAY = 0.1  # the fraction of the run one worker is away


@sweep("churn", report="converge")
def churn(epochs: float = 12.0) -> Plan:
    """The quality churn costs — ptb-converge, N=8, CELGC I=32 at its tuned γ: no churn against one worker of 8 away 10 % of the time (a failure plan in the simulator).

    * ``celgc-I32``: no churn (the configuration of ``fair``'s and ``parity``'s ``celgc-I32``).
    * ``celgc-I32-churn``: the same run with a failure plan (``fail``): in the middle of each
      epoch e one worker, rank e mod 8, leaves for ``CHURN_AWAY`` of an epoch's steps (117 of
      1,162, rounded to whole periods: 128, 11 %), its batches of those steps skipped, and
      heals from a live peer at the round that ends its absence. So one worker of 8 is away
      about 10 % of the time, each in turn, and the group trains on about 1/80 less data.

    Both runs are deterministic (the simulator's plan); the difference of their final
    validation perplexities is the cost. 4 validations per epoch.
    """
    celgc = dict(algorithm="celgc", period=32, gamma=CELGC_BEST_GAMMA)
    per_epoch = _epoch_steps(8)
    away = _whole_periods(math.ceil(CHURN_AWAY * per_epoch), 32)
    plan = [f"{e % 8}@{e * per_epoch + per_epoch // 2}:{e * per_epoch + per_epoch // 2 + away}" for e in range(math.ceil(epochs))]
    return [
        ("celgc-I32", _converge(epochs, **celgc)),
        ("celgc-I32-churn", _converge(epochs, **celgc, fail=plan)),
    ]
