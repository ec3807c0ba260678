"""The lab: the research tooling around :mod:`localclip`, which the library never imports.

Named sweeps of training runs (:mod:`.plans`) and running them (:mod:`.runner`), their tables and
figures (:mod:`.reports`), rerunning a committed run's start (:mod:`.reproduce`), the theory check
on a synthetic (L0, L1)-smooth problem (:mod:`.synthetic`), the smoothness probe of a run's
checkpoints (:mod:`.smoothness`), and the ``localclip`` commands that reach them (:mod:`.cli`).
"""

from localclip_lab.plans import SWEEPS, SweepError, SweepFailed, describe, plan
from localclip_lab.reports import report
from localclip_lab.runner import default_jobs, plan_lines, run_sweep

__all__ = ["SWEEPS", "SweepError", "SweepFailed", "default_jobs", "describe", "plan", "plan_lines", "report", "run_sweep"]
