"""What a worker that heals at a round takes from its live peer and what stays its own
(docs/algorithm.md, "When workers leave and rejoin"): the peer's step count as of the round,
the step whose round heals it included, and a zero recurrent state, in the simulator's failure
plans as in torchft's heals (tests/comm/test_ft_plans.py compares the two to the bit)."""

import torch

from localclip.cli import main
from localclip.comm.membership import PlannedMembership
from helpers import SMOKE_DATA

TINY = ["--set", "model_options.emb_size=8", "--set", "model_options.hidden_size=8", "--set", "model_options.num_layers=1",
        "--set", "eval_tokens=200", "--set", "log_interval=4", "--set", "threads=1", "--no-progress"]


def test_a_joiner_counts_the_step_of_its_heal_and_starts_its_shard_from_a_zero_recurrent_state(tmp_path, monkeypatch):
    seen = []
    attach = PlannedMembership.attach

    def recording_attach(self, state_dict, load):
        def load_and_record(state):
            load(state)
            trainer = load.__self__  # the joiner's Trainer
            seen.append((self.rank, state["step"], trainer.algorithm.averager.step_count,
                         max(float(t.abs().max()) for t in trainer.workload.hidden)))

        attach(self, state_dict, load_and_record)

    monkeypatch.setattr(PlannedMembership, "attach", recording_attach)
    assert main(["train", "ptb-small", "--workers", "2", "--out", str(tmp_path / "run"), *SMOKE_DATA, *TINY,
                 "--period", "4", "--max-steps", "12", "--fail", "1@2:6"]) == 0
    # Worker 1 leaves after step 2 and heals at the round at step 8, in the middle of its peer's
    # step 8: the peer's count says 8 steps done, as its averager's does; the joiner's recurrent
    # state (non-zero since its first step) starts again from zero.
    assert seen == [(1, 8, 8, 0.0)]
