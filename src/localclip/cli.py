"""The ``localclip`` command: ``train``, ``recipes``, ``data download|import``, ``plot``, ``sweep``,
``report``, ``theory`` and ``smoothness``.

Flags map onto :class:`~localclip.train.config.TrainConfig` fields; every user error is one line
on stderr naming the problem, and exit status 2 (the other statuses: :data:`EXIT_STATUSES`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import sys
from pathlib import Path

from localclip.errors import Interrupted, LocalclipError

__all__ = ["EXIT_DIVERGED", "EXIT_STATUSES", "main", "train_config"]

#: ``localclip train``'s exit status for a run that ended with a diverged model.
EXIT_DIVERGED = 3

EXIT_STATUSES = f"""exit status:
  0    the run finished
  2    bad input (a flag, the data, the run folder): one line on stderr says what
  {EXIT_DIVERGED}    the run finished with a diverged model (loss NaN/Inf or an overflowing perplexity);
       its final line names the step whose validation found it, summary.json has diverged_at_step
       (under torchrun 0 instead, so that the agent does not restart a finished run)
  75   stopped by SIGTERM/SIGINT after a checkpoint: run the same command with --resume
  128+N  a second signal N: stopped at once, the last complete checkpoint kept"""


def _positive_int(flag):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {flag} value: {text!r} (expected an integer >= 1)") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"invalid {flag} value: {value} (expected an integer >= 1)")
        return value

    return parse


def _positive_float(flag, allow_inf=False):
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {flag} value: {text!r} (expected a number > 0)") from None
        if not value > 0 or math.isnan(value) or (math.isinf(value) and not allow_inf):
            raise argparse.ArgumentTypeError(f"invalid {flag} value: {text} (expected a {'number > 0 or inf' if allow_inf else 'finite number > 0'})")
        return value

    return parse


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line, as every other refusal of the command
    is: what is wrong and where the help is (argparse prints the whole usage above it)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _parser() -> argparse.ArgumentParser:
    from localclip import __version__
    from localclip.experiments.plans import SWEEPS
    from localclip.algorithms import ALGORITHMS
    from localclip.averaging import COMPRESSIONS, OUTER_OPTIMIZERS
    from localclip.optim import CLIP_MODES, INNER_OPTIMIZERS

    parser = _Parser(prog="localclip", description="Communication-efficient distributed training with local gradient clipping (CELGC).")
    parser.add_argument("--version", action="version", version=f"localclip {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    recipe_default = "(default: the recipe's; `localclip recipes --fields RECIPE` lists them)"
    train = sub.add_parser("train", help="train a recipe", description="Train a recipe; flags override the recipe's settings.",
                           epilog=EXIT_STATUSES, formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("recipe", help="a recipe name (see `localclip recipes`)")
    train.add_argument("--workers", type=_positive_int("--workers"), help=f"number of workers N {recipe_default}")
    train.add_argument("--runtime", choices=["simulate", "spawn", "torchrun", "ft"], default="simulate", help="simulate: N workers in this process (default); spawn: N gloo processes here; torchrun: join torchrun's group; "
                       "ft: N fault-tolerant torchft workers here, each with its own run folder OUT/replica-R (with TORCHFT_LIGHTHOUSE and LOCALCLIP_REPLICA set: this process is worker LOCALCLIP_REPLICA); pip install 'localclip[ft]'")
    train.add_argument("--algorithm", choices=list(ALGORITHMS), help="; ".join(f"{name}: {spec.summary}" for name, spec in ALGORITHMS.items())
                       + f" {recipe_default}")
    train.add_argument("--period", type=_positive_int("--period"), help=f"communication period I {recipe_default}")
    train.add_argument("--epochs", type=_positive_float("--epochs"), help=f"passes over the training data {recipe_default}")
    train.add_argument("--max-steps", type=_positive_int("--max-steps"), help="stop after K local steps per worker (default: no limit but --epochs)")
    train.add_argument("--lr", type=_positive_float("--lr"), help=f"step size η {recipe_default}")
    train.add_argument("--gamma", type=_positive_float("--gamma", allow_inf=True), help=f"clipping parameter γ, inf: no clipping {recipe_default}")
    train.add_argument("--inner-optimizer", choices=list(INNER_OPTIMIZERS), help="the local update: clipped_sgd (CELGC's) or adamw (clip to max_grad_norm, then AdamW); "
                       f"the recipe's settings for it, else give --lr {recipe_default}")
    train.add_argument("--clip-mode", choices=list(CLIP_MODES), help="clipped_sgd: clip with the local gradient's norm (local, the paper's), the round's averaged one, "
                       f"the larger of the two (max), or not at all {recipe_default}")
    train.add_argument("--seed", type=int, help=f"the run's seed: initial weights, data order, dropout {recipe_default}")
    train.add_argument("--device", help="where each worker computes: auto (default: cuda where available, else cpu), cpu, cuda "
                       "(each worker process its own GPU; simulated workers share one) or cuda:K")
    train.add_argument("--outer-optimizer", choices=list(OUTER_OPTIMIZERS), help="an outer step on the average at each round (nesterov with adamw inside: DiLoCo) (default: none)")
    train.add_argument("--outer-lr", type=float, help="outer step size (default 0.7)")
    train.add_argument("--outer-momentum", type=float, help="outer momentum in [0, 1) (default 0.9)")
    train.add_argument("--compression", choices=list(COMPRESSIONS), help="send each round's change since the last round in 2 bytes (bf16, fp16), "
                       "as 8- or 4-bit codes with a scale per 256 elements (int8, int4) or float32 (none) (default: none)")
    train.add_argument("--no-error-feedback", action="store_true", help="int8/int4: drop what each round's codes leave out instead of "
                       "adding it to the next round (default: error feedback on)")
    train.add_argument("--fragments", type=int, help="streaming rounds: sync the model in this many fragments on staggered schedules, "
                       "each round about 1/P of it (default: 1, the whole model every period)")
    train.add_argument("--overlap", type=int, help="streaming rounds: apply each round this many local steps after it starts, "
                       "the transport running meanwhile (default: 0, rounds block); the merge: --set overlap_alpha=A or --set overlap_merge=carry "
                       "(keep each worker's steps taken meanwhile)")
    train.add_argument("--fail", action="append", metavar="R@A:B", help="simulate a failure: worker R leaves right after its A-th local step "
                       "and heals from a live peer at the first round at a step >= B; repeatable (default: none; see docs/algorithm.md)")
    train.add_argument("--data-root", help="an existing folder holding the corpora (default: $LOCALCLIP_DATA, else ~/.cache/localclip/data, "
                                           "where a missing PTB or WikiText-2 is downloaded on first use)")
    train.add_argument("--allow-custom-corpus", action="store_true", help="accept corpus files whose checksum differs from the canonical ones (default: refuse them)")
    train.add_argument("--out", help="run folder (default: runs/RECIPE-ALGORITHM-nN-iI-sSEED)")
    train.add_argument("--resume", action="store_true",
                       help="continue the run in --out from its latest checkpoint; when --out holds no run yet, a fresh run starts there "
                            "and says so (default: off; a folder that holds a run is then refused)")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override any config field, repeatable (default: none)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar (default: a bar on stderr)")
    train.add_argument("--logger", dest="loggers", action="append", choices=["tensorboard", "wandb"],
                       help="also log to wandb (offline, into RUN/wandb; pip install 'localclip[wandb]') or tensorboard (RUN/tensorboard; "
                            "pip install 'localclip[tensorboard]'), repeatable (default: tensorboard when it is installed)")

    recipes = sub.add_parser("recipes", help="list the recipes, one line each")
    recipes.add_argument("names", nargs="*", metavar="RECIPE", help="with --fields: only these recipes (default: all)")
    recipes.add_argument("--fields", action="store_true", help="also list the config fields --set accepts, with each recipe's own values")

    data = sub.add_parser("data", help="manage corpora")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    download = data_sub.add_parser("download", help="download a corpus and verify its SHA-256")
    download.add_argument("corpus", choices=["ptb", "wikitext2"])
    download.add_argument("--data-root", help="destination root (default: $LOCALCLIP_DATA, else ~/.cache/localclip/data)")
    download.add_argument("--force", action="store_true", help="replace files whose checksum differs")
    imported = data_sub.add_parser("import", help="install corpus files fetched elsewhere (offline), verifying their SHA-256",
                                   description="Check the corpus files in DIR, under their published names (ptb.train.txt, "
                                               "wiki.train.tokens) or as train.txt, valid.txt, test.txt, against the canonical "
                                               "SHA-256 and install them where `localclip train` looks.")
    imported.add_argument("corpus", choices=["ptb", "wikitext2"])
    imported.add_argument("source", metavar="DIR", help="the folder holding the three files")
    imported.add_argument("--data-root", help="destination root (default: $LOCALCLIP_DATA, else ~/.cache/localclip/data)")

    plot = sub.add_parser("plot", help="plot runs")
    plot.add_argument("runs", nargs="+", help="run folders")
    plot.add_argument("--out", required=True, help="output image (PNG)")
    plot.add_argument("--bandwidth", type=_positive_float("--bandwidth"), default=1e9, help="modelled link bandwidth in bit/s (default 1e9)")
    plot.add_argument("--latency", type=float, default=50e-6, help="modelled per-round latency in seconds (default 5e-05)")

    # -- sweep and report (localclip.experiments) --
    from localclip.experiments.plans import describe as describe_sweeps

    sweep_cmd = sub.add_parser("sweep", help="run a named sweep (finished runs are skipped, started ones resumed)",
                               description="Run a named sweep's runs into ROOT/NAME/RUN, up to --jobs at once. Run it again to continue an "
                                           "interrupted sweep; a run that diverged is a finished result.",
                               epilog="sweeps:\n" + "\n".join(f"  {line}" for line in describe_sweeps()),
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    sweep_cmd.add_argument("name", metavar="NAME", help=f"a sweep: {', '.join(SWEEPS)}")
    sweep_cmd.add_argument("--root", default="results/sweeps", help="folder holding the sweeps (default results/sweeps)")
    sweep_cmd.add_argument("--epochs", type=_positive_float("--epochs"), help="epochs per run (default: the sweep's own, sized for about an hour of a 2-core CPU)")
    sweep_cmd.add_argument("--runtime", choices=["simulate", "spawn"], default="simulate", help="simulate (default) or spawn, as for `localclip train`")
    sweep_cmd.add_argument("--data-root", help="the corpora's folder (PTB sweeps) or the Fashion-MNIST IDX files' folder (image)")
    sweep_cmd.add_argument("--only", nargs="+", metavar="RUN", help="run only these runs of the sweep")
    sweep_cmd.add_argument("--max-steps", type=_positive_int("--max-steps"), help="stop every run after K local steps per worker (smoke tests)")
    sweep_cmd.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a config field of every run (repeatable)")
    sweep_cmd.add_argument("--list", action="store_true", help="print the planned runs, one line each, and exit")
    sweep_cmd.add_argument("--progress", action="store_true", help="a progress bar per run (with --jobs 1)")
    sweep_cmd.add_argument("--jobs", type=_positive_int("--jobs"), help="runs at once, each in its own process on its share of the cores "
                           "(default: one per core, which is fastest because every sweep run pins one thread per worker; results do not depend on it)")
    report_cmd = sub.add_parser("report", help="summarise a sweep's finished runs into summary.csv, summary.md and figure.png")
    report_cmd.add_argument("name", metavar="NAME", help=f"a sweep: {', '.join(SWEEPS)}")
    report_cmd.add_argument("--root", default="results/sweeps", help="folder holding the sweeps (default results/sweeps)")
    report_cmd.add_argument("--loss-target", type=_positive_float("--loss-target"), help="speedup: training-loss target (default: the worst final one)")
    report_cmd.add_argument("--ppl-target", type=_positive_float("--ppl-target"), help="speedup: validation-perplexity target (default: the worst final one)")
    report_cmd.add_argument("--check", action="store_true", help="instead of the tables: rerun each finished run up to its first logged interval after a "
                            "round with today's code and compare that interval's training loss with the committed one (exit 1 if any differs "
                            "by more than 1e-6 relative)")
    report_cmd.add_argument("--only", nargs="+", metavar="RUN", help="--check: only these runs")
    report_cmd.add_argument("--data-root", help="--check: the corpora's folder (default: each run's own)")
    theory = sub.add_parser("theory", help="the theory check: CELGC on a synthetic (L0, L1)-smooth problem (minutes: 4.4 on a loaded 2-core CPU with the default 3 seeds)")
    theory.add_argument("--out", default="results/theory", help="output folder (default results/theory)")
    theory.add_argument("--seeds", type=_positive_int("--seeds"), default=3, help="seeds per setting; the median is reported (default 3)")
    smooth = sub.add_parser("smoothness", help="estimate local smoothness against gradient norm from a run's checkpoints")
    smooth.add_argument("run", help="a run folder with checkpoints")
    smooth.add_argument("--steps", type=_positive_int("--steps"), default=20, help="training steps probed from each starting point (default 20)")
    smooth.add_argument("--data-root", help="the corpora's folder (default: the run's)")
    smooth.add_argument("--out", help="output folder (default: the run folder)")
    # -- end of sweep and report --
    return parser


def train_config(argv: list[str]):
    """The resolved config that ``localclip train ARGV`` would run (raises ConfigError as it would)."""
    return _train_config(_parser().parse_args(["train", *argv]))


def _train_config(args):
    from localclip import devices
    from localclip.algorithms import build as algorithms
    from localclip.errors import ConfigError
    from localclip.recipes import for_inner_optimizer, get_recipe
    from localclip.train import apply_overrides

    config = get_recipe(args.recipe)
    flags = {
        "workers": args.workers, "algorithm": args.algorithm, "period": args.period, "epochs": args.epochs,
        "max_steps": args.max_steps, "lr": args.lr, "gamma": args.gamma, "seed": args.seed, "data_root": args.data_root,
        "outer_optimizer": args.outer_optimizer, "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum,
        "compression": args.compression, "error_feedback": False if args.no_error_feedback else None,
        "fragments": args.fragments, "overlap": args.overlap, "fail": args.fail,
        "inner_optimizer": args.inner_optimizer, "clip_mode": args.clip_mode, "device": args.device,
    }
    config = dataclasses.replace(config, **{k: v for k, v in flags.items() if v is not None})
    if args.loggers:
        config = dataclasses.replace(config, loggers=list(dict.fromkeys([*config.loggers, *args.loggers])))
    if args.allow_custom_corpus:
        config = dataclasses.replace(config, allow_custom_corpus=True)
    config = apply_overrides(config, args.overrides)
    # What the user set, as against the recipe's own values.
    explicit = {k for k, v in flags.items() if v is not None} | {item.partition("=")[0].strip() for item in args.overrides}
    try:
        config.resolved()  # each value checked on its own first
    except ConfigError as exc:
        # A value the algorithm would replace is a conflict too: named in the same line.
        problem = algorithms.overridden(config, explicit) if config.algorithm in algorithms.ALGORITHMS else None
        if problem:
            raise ConfigError(f"{exc}; {problem}") from None
        raise
    config = for_inner_optimizer(args.recipe, config, explicit)
    resolved = config.resolved()
    # A value the user gave that the algorithm would replace is refused, not silently dropped.
    problem = algorithms.overridden(config, explicit)
    if problem:
        raise ConfigError(problem)
    devices.check_available(resolved.device)
    return resolved


def _train(args) -> int:
    from localclip.train import run_training

    resolved = _train_config(args)
    if resolved.fail and args.runtime != "simulate":
        from localclip.errors import ConfigError

        raise ConfigError(f"Invalid --fail {','.join(resolved.fail)} with --runtime {args.runtime}: failure plans run in the simulator (--runtime simulate)")
    out = args.out or f"runs/{args.recipe}-{resolved.algorithm}-n{resolved.workers}-i{resolved.period}-s{resolved.seed}"
    rank0 = os.environ.get("RANK", "0") == "0"
    if args.resume and not (Path(out) / "config.json").exists() and rank0:
        print(f"localclip: --resume: {out} holds no run yet; starting a fresh run there", file=sys.stderr)
    if "tensorboard" in (args.loggers or []) and importlib.util.find_spec("tensorboard") is None and rank0:
        print("localclip: note: tensorboard is not installed, so no RUN/tensorboard events "
              "(pip install 'localclip[tensorboard]'); metrics.jsonl holds every record", file=sys.stderr)
    # A missing corpus is fetched once the run folder has been found free and a resume's config the
    # run's: a refused folder costs no download (under torchrun each worker reads what is on disk).
    fetch = _ensure_corpus if resolved.task == "lm" and args.runtime != "torchrun" else None
    summary = run_training(resolved, out, runtime=args.runtime, resume=args.resume, progress=not args.no_progress, fetch_corpus=fetch)
    if summary is None:
        return 0
    keys = [k for k in ("val/ppl", "test/ppl", "val/acc", "test/acc", "steps", "comm/rounds", "comm/bytes", "time/seconds") if k in summary]
    metrics = "  ".join(f"{k}={summary[k]:.6g}" if isinstance(summary[k], float) else f"{k}={summary[k]}" for k in keys)
    diverged = _diverged_at(summary, out)
    if diverged is not None:
        print(f"diverged {out}: the validation at step {diverged} found the model diverged; {metrics}")
        # torchrun's agent takes any other status for a failure and restarts the group (--max-restarts).
        return 0 if "TORCHELASTIC_RUN_ID" in os.environ else EXIT_DIVERGED
    print(f"finished {out}: {metrics}")
    return 0


def _diverged_at(summary: dict, out: str) -> int | None:
    """The step whose validation found the run diverged: the summary's ``diverged_at_step``, or,
    for a run that trained on (``stop_on_divergence=false``) and ended diverged, the first
    validation record with a non-finite loss or perplexity."""
    if summary.get("diverged_at_step") is not None:
        return summary["diverged_at_step"]
    if all(math.isfinite(v) for k, v in summary.items() if k.startswith(("val/", "test/")) and isinstance(v, float)):
        return None
    from localclip import jsonio

    try:
        lines = (Path(out) / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    except OSError:
        return summary.get("steps")
    for line in lines:
        record = jsonio.loads(line)
        if any(isinstance(v, float) and not math.isfinite(v) for k, v in record.items() if k.startswith("val/")):
            return record.get("step")
    return summary.get("steps")


def _ensure_corpus(config) -> None:
    """Fetch a missing known corpus on first use (saying what and where); offline, fail clearly."""
    from localclip import data
    from localclip.errors import DataError

    if config.dataset not in data.CORPORA:
        return
    folder = data.corpus_path(config.dataset, config.data_root)
    if all((folder / f).is_file() for f in ("train.txt", "valid.txt", "test.txt")):
        return
    root = data.resolve_data_root(config.data_root)
    if config.data_root and not root.is_dir():
        # A typo must not become a new folder with a download in it: downloading is asked for.
        raise DataError(
            f"--data-root {root} does not exist. Point it at the folder that holds {folder.name}/, or download "
            f"{config.dataset} there with `localclip data download {config.dataset} --data-root {root}`."
        )
    print(f"localclip: {config.dataset} is not in {folder}; downloading it there (SHA-256 verified)...", file=sys.stderr)
    try:
        data.download_corpus(config.dataset, root, progress=lambda msg: print(f"  {msg}", file=sys.stderr))
    except DataError as exc:
        raise DataError(
            f"{config.dataset} is missing from {folder} and could not be downloaded ({exc}) "
            f"Or point --data-root / LOCALCLIP_DATA at a folder that holds {folder.name}/."
        ) from None


def _recipes(args) -> int:
    from localclip.recipes import RECIPES, describe, get_recipe
    from localclip.train import TrainConfig

    names = args.names or sorted(RECIPES)
    configs = {name: get_recipe(name) for name in names}  # an unknown name is one line, exit 2
    if not args.fields:
        for line in describe():
            if not args.names or line.split()[0] in names:
                print(line)
        return 0
    print("config fields (--set KEY=VALUE), each recipe's own value:")
    for f in dataclasses.fields(TrainConfig):
        by_value: dict[str, list[str]] = {}
        for name, config in configs.items():
            by_value.setdefault(repr(getattr(config, f.name)), []).append(name)
        if len(by_value) == 1:
            print(f"  {f.name} = {next(iter(by_value))}")
        else:
            print(f"  {f.name}: " + "; ".join(f"{value} ({', '.join(who)})" for value, who in by_value.items()))
    return 0


def _data(args) -> int:
    from localclip import data

    if args.data_command == "import":
        path = data.import_corpus(args.corpus, args.source, args.data_root)
    else:
        path = data.download_corpus(args.corpus, args.data_root, force=args.force)
    print(f"{args.corpus}: verified in {path}")
    return 0


def _plot(args) -> int:
    from localclip.plot import plot_runs

    plot_runs(args.runs, args.out, bandwidth=args.bandwidth, latency=args.latency)
    print(f"wrote {args.out}")
    return 0


# -- sweep and report (localclip.experiments) --


def _sweep(args) -> int:
    from localclip import experiments as sweeps

    if args.list:
        for line in sweeps.plan_lines(args.name, args.root, args.epochs, args.only):
            print(line)
        return 0
    runs = sweeps.plan(args.name, args.epochs, args.only)  # unknown names fail before anything is written
    corpora = {}
    for _, config in runs:
        resolved = dataclasses.replace(config, data_root=args.data_root or config.data_root).resolved()
        if resolved.task == "lm":
            corpora.setdefault((resolved.dataset, resolved.data_root), resolved)
    for resolved in corpora.values():
        _ensure_corpus(resolved)
    sweeps.run_sweep(
        args.name, args.root, epochs=args.epochs, runtime=args.runtime, data_root=args.data_root, only=args.only,
        progress=args.progress, max_steps=args.max_steps, overrides=args.overrides, jobs=args.jobs,
        echo=lambda line: print(line, flush=True),
    )
    print(f"sweep {args.name}: done; `localclip report {args.name} --root {args.root}` summarises it")
    return 0


def _report(args) -> int:
    from pathlib import Path

    from localclip.experiments import report

    if args.check:
        from localclip.experiments.reproduce import check_sweep

        results = check_sweep(Path(args.root) / args.name, only=args.only, data_root=args.data_root, echo=lambda line: print(line, flush=True))
        differ = [r["run"] for r in results if not r["same"]]
        print(f"{len(results) - len(differ)} of {len(results)} runs reproduced" + (f"; differ: {', '.join(differ)}" if differ else ""))
        elsewhere = [r["run"] for r in results if not r["same"] and r["other_cpu"]]
        if elsewhere:
            print(f"{', '.join(elsewhere)}: made on another CPU, or one not recorded; MKL and ATen pick their kernels "
                  "by instruction set, so rerun on that CPU type (or compare with MKL_CBWR=COMPATIBLE set for both) "
                  "before blaming the code")
        return 1 if differ else 0
    result = report(args.name, args.root, loss_target=args.loss_target, ppl_target=args.ppl_target)
    print(Path(result["markdown"]).read_text(), end="")
    written = [result["csv"], result["markdown"]] + [result[k] for k in ("figure", "curves") if result.get(k)]
    print(f"wrote {', '.join(written)}")
    if result.get("figure_note"):
        print(f"localclip: {result['figure_note']}", file=sys.stderr)
    if result["figure_error"]:
        print(f"localclip: warning: no figure: {result['figure_error']}", file=sys.stderr)
        return 1
    return 0


def _theory(args) -> int:
    from localclip.experiments.synthetic import theory_check

    result = theory_check(args.out, seeds=tuple(range(args.seeds)))
    print((Path(args.out) / "summary.md").read_text(), end="")
    print(f"wrote {args.out}/results.json, summary.md" + (", figure.png" if result.get("figure") else ""))
    if result.get("figure_note"):
        print(f"localclip: {result['figure_note']}", file=sys.stderr)
    return 0 if result["speedup"] else 1


def _smoothness(args) -> int:
    from localclip.experiments.smoothness import probe_run

    result = probe_run(args.run, steps=args.steps, data_root=args.data_root, out=args.out)
    for note in result["notes"]:
        print(f"localclip: warning: {note}", file=sys.stderr)
    fit = result["fit"]
    print(f"{len(result['points'])} points from {len(result['sources'])} starting points; "
          f"fit L(x) ≈ {fit['L0']:.4g} + {fit['L1']:.4g}·‖∇f(x)‖ (R² {fit['r2']:.3f})")
    print(f"wrote {result['json']}" + (f", {result['figure']}" if result.get("figure") else ""))
    if result.get("figure_note"):
        print(f"localclip: {result['figure_note']}", file=sys.stderr)
    return 0


# -- end of sweep and report --


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    commands = {"train": _train, "recipes": _recipes, "data": _data, "plot": _plot, "sweep": _sweep, "report": _report,
                "theory": _theory, "smoothness": _smoothness}
    try:
        return commands[args.command](args)
    except Interrupted as exc:
        if os.environ.get("RANK", "0") == "0":  # under torchrun every worker gets here: one line
            print(f"localclip: {exc}", file=sys.stderr)
        return Interrupted.exit_code
    except LocalclipError as exc:
        print(f"localclip: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("localclip: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The ``localclip`` command: :func:`main`, and a torchrun worker leaves through
    :func:`localclip.comm.distributed.exit_process` (see there why)."""
    code = main()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # set by torchrun for its workers
        from localclip.comm import distributed

        distributed.exit_process(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
