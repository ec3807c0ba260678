"""Two torchrun agents on this machine as two "nodes" (c10d rendezvous, 2 workers each) train
exactly as one node of four workers."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from localclip.cli import main

from helpers import SHARED, SMOKE

TORCHRUN = Path(sys.executable).with_name("torchrun")
pytestmark = [
    pytest.mark.full,  # six processes
    pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed next to this Python"),
]

# Four steps at period 2: the last step is a round, so the checkpoint taken at the end (before
# the final averaging) holds the averaged model on every worker.
ARGS = ["--workers", "4", "--period", "2", "--max-steps", "4", "--set", "threads=1", "--set", "timeout=120"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def models(out: Path) -> list[dict]:
    step = json.loads((out / "checkpoints" / "latest.json").read_text())["dir"]
    return [torch.load(out / "checkpoints" / step / f"rank-{r}.pt", weights_only=True)["model"] for r in range(4)]


def test_two_nodes_of_two_workers_equal_one_node_of_four(tmp_path):
    out = tmp_path / "two-nodes"
    port = free_port()
    nodes = []
    for node_rank in (0, 1):
        cmd = [
            str(TORCHRUN), "--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "localclip-two-nodes",
            # node 0 hosts the rendezvous store, as the first node of a real cluster would
            "--rdzv-conf", f"is_host={node_rank == 0}",
            "-m", "localclip.cli", "train", "ptb-small", "--runtime", "torchrun", *ARGS, "--out", str(out), *SMOKE,
        ]
        nodes.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}))
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=300)[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for node, text in zip(nodes, outputs):
        assert node.returncode == 0, text[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["workers"] == 4 and summary["steps"] == 4

    assert main(["train", "ptb-small", "--runtime", "spawn", *ARGS, "--out", str(tmp_path / "one-node"), *SMOKE]) == 0
    single = json.loads((tmp_path / "one-node" / "summary.json").read_text())

    two, one = models(out), models(tmp_path / "one-node")
    for r in range(1, 4):
        for key in two[0]:
            assert torch.equal(two[r][key], two[0][key]), f"rank {r} differs from rank 0 in {key}"
    for key in two[0]:
        assert torch.equal(two[0][key], one[0][key]), f"two nodes and one node differ in {key}"
    strip = lambda s: {k: v for k, v in s.items() if not k.startswith("time/")}  # noqa: E731
    assert strip(summary) == strip(single)
