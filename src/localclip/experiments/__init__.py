"""Experiments: named sweeps of training runs (:mod:`.plans`), running them (:mod:`.runner`),
their tables and figures (:mod:`.report`), the theory check on a synthetic (L0, L1)-smooth
problem (:mod:`.synthetic`) and the smoothness probe of a run's checkpoints (:mod:`.smoothness`).
"""

from localclip.experiments.plans import SWEEPS, SweepError, SweepFailed, describe, plan
from localclip.experiments.report import report
from localclip.experiments.runner import default_jobs, plan_lines, run_sweep

__all__ = ["SWEEPS", "SweepError", "SweepFailed", "default_jobs", "describe", "plan", "plan_lines", "report", "run_sweep"]
