"""The lab's commands of ``localclip``: ``sweep``, ``report``, ``theory`` and ``smoothness``.

:func:`localclip.cli.main` registers them through :func:`add_commands` only when one of them is
named or the list of commands is asked for, so that ``localclip train`` never imports the lab.
Each command is one call into the lab; errors are :class:`~localclip.errors.LocalclipError`, which
the ``localclip`` command prints as one line (exit status 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from localclip.command_line import ensure_corpus, positive_float, positive_int
from localclip_lab.plans import SWEEPS
from localclip_lab.plans import describe as describe_sweeps

__all__ = ["COMMANDS", "add_commands"]


def add_commands(sub) -> None:
    """Add the lab's commands to ``sub``, the ``localclip`` parser's subparsers."""
    sweep_cmd = sub.add_parser("sweep", help="run a named sweep (finished runs are skipped, started ones resumed)",
                               description="Run a named sweep's runs into ROOT/NAME/RUN, up to --jobs at once. Run it again to continue an "
                                           "interrupted sweep; a run that diverged is a finished result.",
                               epilog="sweeps:\n" + "\n".join(f"  {line}" for line in describe_sweeps()),
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    sweep_cmd.add_argument("name", metavar="NAME", help=f"a sweep: {', '.join(SWEEPS)}")
    sweep_cmd.add_argument("--root", default="results/sweeps", help="folder holding the sweeps (default results/sweeps)")
    sweep_cmd.add_argument("--epochs", type=positive_float("--epochs"), help="epochs per run (default: the sweep's own, sized for about an hour of a 2-core CPU)")
    sweep_cmd.add_argument("--runtime", choices=["simulate", "spawn"], default="simulate", help="simulate (default) or spawn, as for `localclip train`")
    sweep_cmd.add_argument("--data-root", help="the corpora's folder (PTB sweeps) or the Fashion-MNIST IDX files' folder (image)")
    sweep_cmd.add_argument("--only", nargs="+", metavar="RUN", help="run only these runs of the sweep")
    sweep_cmd.add_argument("--max-steps", type=positive_int("--max-steps"), help="stop every run after K local steps per worker (smoke tests)")
    sweep_cmd.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a config field of every run (repeatable)")
    sweep_cmd.add_argument("--list", action="store_true", help="print the planned runs, one line each, and exit")
    sweep_cmd.add_argument("--progress", action="store_true", help="a progress bar per run (with --jobs 1)")
    sweep_cmd.add_argument("--jobs", type=positive_int("--jobs"), help="runs at once, each in its own process on its share of the cores "
                           "(default: one per core, which is fastest because every sweep run pins one thread per worker; results do not depend on it)")
    report_cmd = sub.add_parser("report", help="summarise a sweep's finished runs into summary.csv, summary.md and figure.png")
    report_cmd.add_argument("name", metavar="NAME", help=f"a sweep: {', '.join(SWEEPS)}")
    report_cmd.add_argument("--root", default="results/sweeps", help="folder holding the sweeps (default results/sweeps)")
    report_cmd.add_argument("--loss-target", type=positive_float("--loss-target"), help="speedup: training-loss target (default: the worst final one)")
    report_cmd.add_argument("--ppl-target", type=positive_float("--ppl-target"), help="speedup: validation-perplexity target (default: the worst final one)")
    report_cmd.add_argument("--check", action="store_true", help="instead of the tables: rerun each finished run up to its first logged interval after a "
                            "round with today's code and compare that interval's training loss with the committed one (exit 1 if any differs "
                            "by more than 1e-6 relative)")
    report_cmd.add_argument("--only", nargs="+", metavar="RUN", help="--check: only these runs")
    report_cmd.add_argument("--data-root", help="--check: the corpora's folder (default: each run's own)")
    theory = sub.add_parser("theory", help="the theory check: CELGC on a synthetic (L0, L1)-smooth problem (minutes: 4.4 on a loaded 2-core CPU with the default 3 seeds)")
    theory.add_argument("--out", default="results/theory", help="output folder (default results/theory)")
    theory.add_argument("--seeds", type=positive_int("--seeds"), default=3, help="seeds per setting; the median is reported (default 3)")
    smooth = sub.add_parser("smoothness", help="estimate local smoothness against gradient norm from a run's checkpoints")
    smooth.add_argument("run", help="a run folder with checkpoints")
    smooth.add_argument("--steps", type=positive_int("--steps"), default=20, help="training steps probed from each starting point (default 20)")
    smooth.add_argument("--data-root", help="the corpora's folder (default: the run's)")
    smooth.add_argument("--out", help="output folder (default: the run folder)")
def _sweep(args) -> int:
    import localclip_lab as sweeps

    if args.list:
        for line in sweeps.plan_lines(args.name, args.root, args.epochs, args.only):
            print(line)
        return 0
    # The sweep resolves each run's config once and, before it writes anything, fetches the
    # corpora its selected runs read.
    sweeps.run_sweep(
        args.name, args.root, epochs=args.epochs, runtime=args.runtime, data_root=args.data_root, only=args.only,
        progress=args.progress, max_steps=args.max_steps, overrides=args.overrides, jobs=args.jobs,
        echo=lambda line: print(line, flush=True), fetch_corpus=ensure_corpus,
    )
    print(f"sweep {args.name}: done; `localclip report {args.name} --root {args.root}` summarises it")
    return 0


def _report(args) -> int:
    from localclip_lab import report

    if args.check:
        from localclip_lab.reproduce import check_sweep

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
    from localclip_lab.synthetic import theory_check

    result = theory_check(args.out, seeds=tuple(range(args.seeds)))
    print((Path(args.out) / "summary.md").read_text(), end="")
    print(f"wrote {args.out}/results.json, summary.md" + (", figure.png" if result.get("figure") else ""))
    if result.get("figure_note"):
        print(f"localclip: {result['figure_note']}", file=sys.stderr)
    return 0 if result["speedup"] else 1


def _smoothness(args) -> int:
    from localclip_lab.smoothness import probe_run

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


#: Each command's function by name, for :func:`localclip.cli.main`.
COMMANDS = {"sweep": _sweep, "report": _report, "theory": _theory, "smoothness": _smoothness}
