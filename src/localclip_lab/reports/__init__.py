"""A sweep's report: its tables and figures, made from the files its runs commit."""

from localclip_lab.reports.sweep import report

__all__ = ["report"]
