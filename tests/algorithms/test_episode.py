"""EPISODE: a hand-computed example, its clip rule, its communication, and its options."""

import math

import pytest
import torch

import localclip
from localclip.comm import SimulatedWorld, current

# Worker i minimises F_i(x) = a_i/2 ‖x‖² + b_i·x, so its gradient is a_i x + b_i.
A = (1.0, 3.0)
B = ((0.0, 0.0), (2.0, 4.0))


class Quadratic(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.x = torch.nn.Parameter(torch.tensor([1.0, 1.0], dtype=torch.float64))

    def loss(self, rank):
        return 0.5 * A[rank] * (self.x * self.x).sum() + (torch.tensor(B[rank], dtype=torch.float64) * self.x).sum()


def run(algorithm, steps=4, lr=0.25, gamma=1.0, period=2):
    def worker():
        comm = current()
        model = Quadratic()
        cls = localclip.EPISODE if algorithm == "episode" else localclip.CELGC
        opt = cls(model, lr=lr, gamma=gamma, period=period)
        xs = []
        for _ in range(steps):
            opt.zero_grad()
            model.loss(comm.rank).backward()
            opt.step()
            xs.append(model.x.detach().clone().tolist())
        return xs, opt.rounds, opt.bytes_communicated, float(opt.clip_fraction)

    return SimulatedWorld(2).run(worker)


def test_two_workers_two_rounds_by_hand():
    """η = 1/4, γ = 1 (γ/η = 4), I = 2, x₀ = (1, 1).

    Round 1 at x = (1, 1): G₀ = (1, 1), G₁ = (5, 7), G = (3, 4), ‖G‖ = 5 > 4: clip.
      step 1: both g' = G = (3, 4), step γ·g'/‖g'‖ = (0.6, 0.8): x = (0.4, 0.2) on both.
      step 2: worker 0: g = (0.4, 0.2), g' = g − G₀ + G = (2.4, 3.2), step (0.6, 0.8);
              worker 1: g = (3.2, 4.6), g' = (1.2, 1.6), step (0.6, 0.8): both x = (−0.2, −0.6),
              the average.
    Round 2 at x = (−0.2, −0.6): G₀ = (−0.2, −0.6), G₁ = (1.4, 2.2), G = (0.6, 0.8), ‖G‖ = 1 ≤ 4:
      no clip, steps η·g'.
      step 3: both g' = G: x = (−0.35, −0.8).
      step 4: worker 0: g = (−0.35, −0.8), g' = (0.45, 0.6): x = (−0.4625, −0.95);
              worker 1: g = (0.95, 1.6), g' = (0.15, 0.2): x = (−0.3875, −0.85);
              average (−0.425, −0.9).
    """
    expected = [[0.4, 0.2], [-0.2, -0.6], [-0.35, -0.8], [-0.425, -0.9]]
    out = run("episode")
    for xs, rounds, nbytes, clip_fraction in out:
        for got, want in zip(xs, expected):
            assert got == pytest.approx(want, abs=1e-15)
        # 2 model averages + 2 gradient all-reduces of 2 float64 each (+ the 4-byte weight per average)
        assert rounds == 4 and nbytes == 2 * (2 * 8 + 4) + 2 * (2 * 8)
        assert clip_fraction == 0.5  # round 1 clips, round 2 does not
    # CELGC on the same problem goes elsewhere (its first step clips worker 1 only)
    celgc = run("celgc")[0][0]
    assert celgc[-1] != pytest.approx(expected[-1], abs=1e-3)


def test_round_level_clip_rule_steps_gamma_even_when_the_corrected_gradient_is_short():
    # γ/η = 4 < ‖G‖ = 5: the round clips, so a step is exactly γ long, longer than η·‖g'‖.
    out = run("episode", steps=1, gamma=1.0, lr=0.1)  # γ/η = 10 > 5: no clip: η·g' = (0.3, 0.4)
    assert out[0][0][0] == pytest.approx([0.7, 0.6], abs=1e-15)
    out = run("episode", steps=1, gamma=0.5, lr=0.25)  # γ/η = 2 < 5: clip: γ·(0.6, 0.8)
    assert out[0][0][0] == pytest.approx([0.7, 0.6], abs=1e-15)


def test_episode_refuses_another_clip_mode_naming_it():
    with pytest.raises(ValueError, match="'global_average'"):
        localclip.EPISODE(Quadratic(), lr=0.1, gamma=1.0, period=2, clip_mode="global_average")


def test_episode_state_round_trip_resumes_mid_round():
    def worker(split):
        comm = current()
        model = Quadratic()
        opt = localclip.EPISODE(model, lr=0.25, gamma=1.0, period=3)
        for i in range(7):
            if i == split:
                saved = ({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict())
                model = Quadratic()
                opt = localclip.EPISODE(model, lr=0.25, gamma=1.0, period=3)
                model.load_state_dict(saved[0])
                opt.load_state_dict(saved[1])
            opt.zero_grad()
            model.loss(comm.rank).backward()
            opt.step()
        return model.x.detach().clone(), opt.rounds

    straight = SimulatedWorld(2).run(worker, 99)
    resumed = SimulatedWorld(2).run(worker, 4)
    for s, r in zip(straight, resumed):
        assert torch.equal(s[0], r[0]) and s[1] == r[1]
