"""The command's start-up: what every ``localclip`` invocation imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import localclip

SRC = Path(localclip.__file__).resolve().parents[1]  # the source under test, in the child too


def _modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter has imported after running ``code``."""
    probe = f"import sys\n{code}\nprint('\\n'.join(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def test_the_command_and_the_replica_check_do_not_import_fsdp():
    """torch.distributed.fsdp takes seconds to import; it is needed only to recognise a model
    that something else has sharded with it. (Constructing a torch optimizer imports
    torch._dynamo, which imports it: that is torch's cost, not the command's.)"""
    modules = _modules_after(
        "import contextlib, io, torch, localclip\n"
        "from localclip.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['recipes']) == 0\n"
        "from localclip.comm.distributed import why_not_a_replica\n"
        "assert why_not_a_replica(torch.nn.Linear(2, 2)) is None"
    )
    assert "localclip.comm.distributed" in modules  # the check above ran
    assert "torch.distributed.fsdp" not in modules


def test_a_model_sharded_by_fsdp_is_still_recognised_once_fsdp_is_imported():
    """Without a process group: FSDP1's wrapper class stands for any module of fsdp's (the
    spawned test in test_distributed.py shards a real one)."""
    modules = _modules_after(
        "import torch\n"
        "import torch.distributed.fsdp as fsdp\n"
        "from localclip.comm.distributed import why_not_a_replica\n"
        "class Sharded(fsdp.FullyShardedDataParallel):\n"
        "    def __init__(self):\n"
        "        torch.nn.Module.__init__(self)\n"
        "        self.inner = torch.nn.Linear(2, 2)\n"
        "reason = why_not_a_replica(torch.nn.Sequential(Sharded()))\n"
        "assert reason is not None and 'sharded by FSDP' in reason, reason"
    )
    assert "torch.distributed.fsdp" in modules


def test_the_library_commands_do_not_import_the_lab():
    """`localclip --version`, `recipes` and the parse of `train` leave the lab (sweeps, reports,
    studies) unimported; naming one of its commands brings its commands in."""
    modules = _modules_after(
        "import contextlib, io\n"
        "from localclip.cli import main, train_config\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        "        main(['--version'])\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code == 0, exc.code\n"
        "    assert main(['recipes']) == 0\n"
        "assert train_config(['ptb-small', '--period', '4']).round.period == 4\n"
        "lab = sorted(m for m in sys.modules if m.startswith('localclip_lab'))\n"
        "assert lab == [], lab\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['sweep', 'isweep', '--list']) == 0\n"
    )
    assert "localclip_lab.cli" in modules  # the probe got past its checks
