"""The ``localclip`` command: ``train``, ``recipes``, ``data download|import`` and ``plot``, and the
lab's ``sweep``, ``report``, ``theory`` and ``smoothness`` (:mod:`localclip_lab.cli`), registered only
when the command line names one of them or asks for the list of commands.

``train``'s flags map onto the config's sections in one table (:mod:`localclip.train.flags`); every user error is one line
on stderr naming the problem, and exit status 2 (the other statuses: :data:`EXIT_STATUSES`).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from pathlib import Path

from localclip.command_line import ensure_corpus as _ensure_corpus
from localclip.command_line import positive_float as _positive_float
from localclip.command_line import positive_int as _positive_int
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


#: The commands of the library itself; any other command is the lab's.
USER_COMMANDS = ("train", "recipes", "data", "plot")


def _needs_lab(argv: list[str] | None) -> bool:
    """Whether parsing ``argv`` needs the lab's commands: it names one, or names no command of the
    library (the help and the usage error list every command). None: every command."""
    if argv is None:
        return True
    for token in argv:
        if token in ("--version", "-h", "--help"):
            return token != "--version"
        if not token.startswith("-"):
            return token not in USER_COMMANDS
    return True


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line, as every other refusal of the command
    is: what is wrong and where the help is (argparse prints the whole usage above it)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``localclip`` parser for ``argv`` (None: with every command)."""
    from localclip import __version__
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
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override any config field, by its name (period=32) or as SECTION.FIELD (round.period=32), repeatable (default: none)")
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

    if _needs_lab(argv):
        from localclip_lab.cli import add_commands

        add_commands(sub)
    return parser


def train_config(argv: list[str]):
    """The resolved config that ``localclip train ARGV`` would run (raises ConfigError as it would)."""
    return _train_config(_parser(["train"]).parse_args(["train", *argv]))


def _train_config(args):
    """The resolved config of ``localclip train``'s parsed ``args``: what the flags ask for of
    the named recipe (:func:`localclip.train.flags.requested`), with the recipe's settings for
    another inner optimizer, resolved once by the builder; raises :class:`ConfigError` naming
    every value in conflict."""
    from localclip import devices
    from localclip.algorithms import build
    from localclip.errors import ConfigError
    from localclip.recipes import for_inner_optimizer, get_recipe
    from localclip.train.flags import requested

    config, explicit = requested(get_recipe(args.recipe), args)
    try:
        config, refused = for_inner_optimizer(args.recipe, config, explicit), None
    except ConfigError as exc:
        refused = exc
    resolved = build.resolved(config, explicit)  # a value in error is named before the recipe's refusal
    if refused is not None:
        raise refused
    devices.check_available(resolved.run.device)
    return resolved


def _train(args) -> int:
    from localclip.train import run_resolved

    resolved = _train_config(args)
    if resolved.algorithm.fail and args.runtime != "simulate":
        from localclip.errors import ConfigError

        raise ConfigError(f"Invalid --fail {','.join(resolved.algorithm.fail)} with --runtime {args.runtime}: failure plans run in the simulator (--runtime simulate)")
    out = args.out or f"runs/{args.recipe}-{resolved.algorithm.name}-n{resolved.algorithm.workers}-i{resolved.round.period}-s{resolved.run.seed}"
    rank0 = os.environ.get("RANK", "0") == "0"
    if args.resume and not (Path(out) / "config.json").exists() and rank0:
        print(f"localclip: --resume: {out} holds no run yet; starting a fresh run there", file=sys.stderr)
    if "tensorboard" in (args.loggers or []) and importlib.util.find_spec("tensorboard") is None and rank0:
        print("localclip: note: tensorboard is not installed, so no RUN/tensorboard events "
              "(pip install 'localclip[tensorboard]'); metrics.jsonl holds every record", file=sys.stderr)
    # A missing corpus is fetched once the run folder has been found free and a resume's config the
    # run's: a refused folder costs no download (under torchrun each worker reads what is on disk).
    fetch = _ensure_corpus if resolved.workload.task == "lm" and args.runtime != "torchrun" else None
    summary = run_resolved(resolved, out, runtime=args.runtime, resume=args.resume, progress=not args.no_progress, fetch_corpus=fetch)
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


def _recipes(args) -> int:
    from localclip.recipes import RECIPES, describe, get_recipe

    names = args.names or sorted(RECIPES)
    configs = {name: get_recipe(name) for name in names}  # an unknown name is one line, exit 2
    if not args.fields:
        for line in describe():
            if not args.names or line.split()[0] in names:
                print(line)
        return 0
    from localclip.train.config import FLAT_NAMES

    print("config fields (--set KEY=VALUE, or --set SECTION.KEY=VALUE), each recipe's own value:")
    section = None
    for key, (where, _) in FLAT_NAMES.items():
        if where != section:
            section = where
            print(f"  [{section}]")
        by_value: dict[str, list[str]] = {}
        for name, config in configs.items():
            by_value.setdefault(repr(config.value(key)), []).append(name)
        if len(by_value) == 1:
            print(f"  {key} = {next(iter(by_value))}")
        else:
            print(f"  {key}: " + "; ".join(f"{value} ({', '.join(who)})" for value, who in by_value.items()))
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser(argv)
    args = parser.parse_args(argv)
    commands = {"train": _train, "recipes": _recipes, "data": _data, "plot": _plot}
    if args.command not in commands:  # one of the lab's, which _parser registered
        from localclip_lab.cli import COMMANDS as commands
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
