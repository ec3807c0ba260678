"""The one builder: every combination of the command line's choices either runs exactly what the
same composition written by hand with the library runs, or is refused in one line naming both
fields, before anything is written."""

import itertools
import math

import pytest
import torch

import localclip
from localclip.algorithms import ALGORITHMS, CELGC, EPISODE, NaiveParallelClipping, build_algorithm
from localclip.algorithms.build import adamw_param_groups, communication_period
from localclip.averaging import COMPRESSIONS
from localclip.cli import main, train_config
from localclip.comm import SimulatedWorld, current
from localclip.errors import ConfigError
from localclip.optim import CLIP_MODES, INNER_OPTIMIZERS, ClippedAdamW
from localclip.averaging.outer import OUTER_OPTIMIZERS, OuterSGD
from localclip.train import TrainConfig
from localclip.algorithms import build

from helpers import REAL_PTB, needs_real_ptb
from workers import fixed_batches, tiny_model

FIELDS = ("algorithm", "inner_optimizer", "outer_optimizer", "compression", "clip_mode", "participants")
STEPS = 5


def argv_for(algorithm, inner, outer, compression, clip_mode, participants):
    """A command line that sets exactly these choices (plus what the tiny run needs)."""
    argv = ["ptb-small", "--algorithm", algorithm, "--inner-optimizer", inner, "--outer-optimizer", outer,
            "--compression", compression, "--clip-mode", clip_mode, "--lr", "0.05" if inner == "clipped_sgd" else "0.01"]
    if algorithm != "single":
        argv += ["--workers", "2"]
    if algorithm not in ("single", "naive"):
        argv += ["--period", "2"]
    if algorithm != "local-sgd":  # local SGD fixes these to inf
        argv += ["--gamma", "0.02"] if inner == "clipped_sgd" else ["--set", "max_grad_norm=0.5"]
    if participants is not None:
        argv += ["--set", f"participants={participants}"]
    return argv


MATRIX = list(itertools.product(ALGORITHMS, INNER_OPTIMIZERS, OUTER_OPTIMIZERS, COMPRESSIONS, CLIP_MODES, (None, 1)))


def classify():
    accepted, refused = [], []
    for combo in MATRIX:
        try:
            accepted.append((combo, train_config(argv_for(*combo))))
        except ConfigError as exc:
            refused.append((combo, str(exc)))
    return accepted, refused


ACCEPTED, REFUSED = classify()


# The streaming axes beside the round's other options; the inner optimizer, clip mode and
# participants vary in MATRIX (fragments=1, overlap=0 there), which keeps this one small.
STREAM_FIELDS = ("algorithm", "outer_optimizer", "compression", "fragments", "overlap")
STREAM_MATRIX = [c for c in itertools.product(ALGORITHMS, OUTER_OPTIMIZERS, ("none", "bf16"), (1, 2), (0, 1)) if c[3:] != (1, 0)]


def stream_argv(algorithm, outer, compression, fragments, overlap):
    return [*argv_for(algorithm, "clipped_sgd", outer, compression, "local", None), "--fragments", str(fragments),
            "--overlap", str(overlap)]


def classify_streaming():
    accepted, refused = [], []
    for combo in STREAM_MATRIX:
        try:
            accepted.append((combo, train_config(stream_argv(*combo))))
        except ConfigError as exc:
            refused.append((combo, str(exc)))
    return accepted, refused


STREAM_ACCEPTED, STREAM_REFUSED = classify_streaming()


def by_hand(config, model):
    """The composition ``config`` names, written with the library's classes directly."""
    cls = {"celgc": CELGC, "local-sgd": CELGC, "single": CELGC, "naive": NaiveParallelClipping, "episode": EPISODE}[config.algorithm.name]
    averages = config.algorithm.name in ("celgc", "local-sgd", "episode")
    options = dict(skip_nonfinite=True)
    if averages:
        outer = None
        if config.round.outer_optimizer != "none":
            outer = OuterSGD(config.round.outer_lr, config.round.outer_momentum, nesterov=config.round.outer_optimizer == "nesterov")
        options.update(outer_optimizer=outer, compression=config.round.compression, participants=config.round.participants,
                       participation_seed=config.run.seed)
        if config.round.compression in ("int8", "int4"):
            options.update(error_feedback=config.round.error_feedback)
        if config.round.fragments != 1 or config.round.overlap:
            options.update(fragments=config.round.fragments, overlap=config.round.overlap, overlap_alpha=config.round.overlap_alpha,
                           overlap_merge=config.round.overlap_merge)
    gamma = math.inf if config.algorithm.name == "local-sgd" else config.local.gamma
    if config.local.inner_optimizer == "clipped_sgd":
        if cls is NaiveParallelClipping:
            return cls(model, config.local.lr, gamma, **options)
        period = config.round.period if averages else 1
        return cls(model, config.local.lr, gamma, period, clip_mode=config.local.clip_mode, **options)
    limit = math.inf if config.algorithm.name == "local-sgd" else config.local.max_grad_norm
    inner = ClippedAdamW(adamw_param_groups(model, config.local.weight_decay), lr=config.local.lr, betas=tuple(config.local.betas),
                         weight_decay=config.local.weight_decay, max_grad_norm=limit)
    return cls.from_optimizer(model, inner, config.round.period if averages else 1, **options)


def _train(model, alg):
    comm = current()
    for x, y in fixed_batches(comm.rank, STEPS):
        alg.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        alg.step()
    alg.average()
    return [t.clone() for t in model.state_dict().values()], alg.rounds, alg.bytes_communicated


def _both(configs):
    """For each config: (state, rounds, bytes) through the builder and by hand, on this worker."""
    out = []
    for config in configs:
        model = tiny_model(seed=current().rank)
        built = _train(model, build_algorithm(config, model, current()))
        model = tiny_model(seed=current().rank)
        hand = _train(model, by_hand(config, model))
        out.append((built, hand))
    return out


def _same_bits(a, b):
    return all(x.dtype == y.dtype and torch.equal(x.view(torch.uint8) if x.is_floating_point() else x,
                                                  y.view(torch.uint8) if y.is_floating_point() else y) for x, y in zip(a, b))


def test_the_matrix_is_enumerated_whole():
    assert len(MATRIX) == len(ACCEPTED) + len(REFUSED) == 5 * 2 * 3 * 5 * 4 * 2
    assert ACCEPTED and REFUSED


@pytest.mark.parametrize("workers", [1, 2])
def test_every_accepted_combination_runs_what_the_library_composition_runs(workers):
    configs = [(combo, cfg) for combo, cfg in ACCEPTED if cfg.algorithm.workers == workers]
    assert configs
    results = SimulatedWorld(workers).run(_both, [cfg for _, cfg in configs])
    for rank_results in results:
        for (combo, cfg), (built, hand) in zip(configs, rank_results):
            assert _same_bits(built[0], hand[0]), combo
            assert built[1:] == hand[1:], combo
    if workers == 2:
        for (combo, cfg), (built, hand) in zip(configs, results[0]):
            assert built[1] > 0, combo  # two workers always talk


def test_each_refused_combination_names_both_fields():
    for combo, message in REFUSED:
        assert message.startswith("Invalid "), (combo, message)
        named = [f for f in FIELDS if f in message]
        assert len(named) >= 2 or ("without lr" in message and "inner_optimizer" in message), (combo, message)
        assert "\n" not in message


def test_a_refused_combination_leaves_no_run_folder(tmp_path, capsys):
    # One of each kind of refusal (the message's first field), through the command itself.
    kinds = {}
    for combo, message in REFUSED:
        kinds.setdefault(message.split(":")[0].split("=")[0], combo)
    for i, combo in enumerate(kinds.values()):
        out = tmp_path / f"run{i}"
        code = main(["train", *argv_for(*combo), "--out", str(out), "--no-progress"])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, (combo, err)
        assert not out.exists(), combo


def test_the_streaming_matrix_runs_what_the_library_composition_runs_or_is_refused(tmp_path, capsys):
    assert len(STREAM_ACCEPTED) + len(STREAM_REFUSED) == len(STREAM_MATRIX) == 5 * 3 * 2 * 3
    # Streaming rounds compose with both model-averaging algorithms that average whole models
    # between plain local steps, whatever the outer step and compression; nowhere else.
    assert {c[0] for c, _ in STREAM_ACCEPTED} == {"celgc", "local-sgd"}
    assert len(STREAM_ACCEPTED) == 2 * 3 * 2 * 3
    results = SimulatedWorld(2).run(_both, [cfg for _, cfg in STREAM_ACCEPTED])
    for rank_results in results:
        for (combo, cfg), (built, hand) in zip(STREAM_ACCEPTED, rank_results):
            assert (cfg.round.fragments, cfg.round.overlap) == combo[3:]
            assert _same_bits(built[0], hand[0]), combo
            assert built[1:] == hand[1:] and built[1] > 0, combo
    for (combo, _), (a, b) in zip(STREAM_ACCEPTED, zip(*results)):
        assert _same_bits(a[0][0], b[0][0]), combo  # every worker holds the same model after the final average
    kinds = {}
    for combo, message in STREAM_REFUSED:
        assert message.startswith("Invalid ") and "\n" not in message, (combo, message)
        assert len([f for f in STREAM_FIELDS if f in message]) >= 2, (combo, message)
        kinds.setdefault(message.split(":")[0].split("=")[0] + combo[0], combo)
    for i, combo in enumerate(kinds.values()):
        out = tmp_path / f"run{i}"
        code = main(["train", *stream_argv(*combo), "--out", str(out), "--no-progress"])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, (combo, err)
        assert not out.exists(), combo


def test_the_carry_merge_in_the_streaming_matrix_runs_what_the_library_composition_runs_or_is_refused():
    """The streaming matrix with ``--set overlap_merge=carry``: accepted only with rounds in flight
    (overlap 1) of the model-averaging algorithms, where it runs the composition by hand."""
    accepted, refused = [], []
    for combo in STREAM_MATRIX:
        try:
            accepted.append((combo, train_config([*stream_argv(*combo), "--set", "overlap_merge=carry"])))
        except ConfigError as exc:
            refused.append((combo, str(exc)))
    assert sorted(c for c, _ in accepted) == sorted(c for c, _ in STREAM_ACCEPTED if c[4] == 1)
    assert all(cfg.round.overlap_merge == "carry" for _, cfg in accepted)
    for combo, message in refused:
        assert message.startswith("Invalid ") and "\n" not in message, (combo, message)
        assert len([f for f in (*STREAM_FIELDS, "overlap_merge") if f in message]) >= 2, (combo, message)
    assert any("Invalid overlap_merge: 'carry'" in m and "overlap >= 1" in m for _, m in refused)
    results = SimulatedWorld(2).run(_both, [cfg for _, cfg in accepted])
    for rank_results in results:
        for (combo, _), (built, hand) in zip(accepted, rank_results):
            assert _same_bits(built[0], hand[0]) and built[1:] == hand[1:] and built[1] > 0, combo
    for (combo, _), (a, b) in zip(accepted, zip(*results)):
        assert _same_bits(a[0][0], b[0][0]), combo  # every worker holds the same model after the final average


@pytest.mark.parametrize(
    "flags,match",
    [(["--fragments", "0"], "Invalid fragments: 0"), (["--fragments", "9"], "Invalid fragments: 9 .* period=8"),
     (["--overlap", "8"], "Invalid overlap: 8 .* period=8"), (["--overlap", "-1"], "Invalid overlap: -1"),
     (["--overlap", "1", "--set", "overlap_alpha=2"], "Invalid overlap_alpha: 2.0"),
     (["--fragments", "2", "--set", "optimizer_state=average"], "Invalid optimizer_state: 'average' .*fragments=2"),
     (["--set", "overlap_alpha=0.5"], "Invalid overlap_alpha: 0.5 .*overlap >= 1"),
     (["--set", "overlap_merge=carry"], "Invalid overlap_merge: 'carry' .*overlap >= 1"),
     (["--overlap", "1", "--set", "overlap_merge=carry", "--set", "overlap_alpha=0.5"], "Invalid overlap_merge: 'carry' .*overlap_alpha=0, not 0.5"),
     (["--overlap", "1", "--set", "overlap_merge=keep"], "Invalid overlap_merge: 'keep' .*mix, carry")],
)
def test_bad_streaming_values_are_refused_before_a_run_folder(tmp_path, capsys, flags, match):
    import re

    out = tmp_path / "run"
    code = main(["train", "ptb-small", *flags, "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and re.search(match, err) and err.count("\n") == 1, err
    assert not out.exists()


def test_streaming_runs_validate_at_any_step_and_the_others_at_multiples_of_the_period(tmp_path, capsys):
    """Inside an epoch a streaming run scores the mean of the workers' live models, which exists
    at every step; the others score the averaged model, which exists at the end of a period."""
    for flags in (["--overlap", "1"], ["--fragments", "2"], ["--fragments", "4", "--overlap", "3"]):
        config = train_config(["ptb-small", "--period", "8", *flags, "--set", "eval_interval=5"])
        assert config.evaluation.eval_interval == 5 and (config.round.fragments, config.round.overlap) != (1, 0)
    assert train_config(["ptb-small", "--period", "8", "--set", "eval_interval=16"]).evaluation.eval_interval == 16
    out = tmp_path / "run"
    code = main(["train", "ptb-small", "--period", "8", "--set", "eval_interval=5", "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "Invalid eval_interval: 5" in err and "multiple of period=8" in err and err.count("\n") == 1, err
    assert not out.exists()


def test_more_fragments_than_the_model_has_tensors_are_accepted():
    """Fragments are element ranges: ptb-small's LSTM has 10 averaged tensors and splits into 11
    fragments, each within one element-block of 1/11 of the model."""
    from localclip.averaging import PeriodicAverager
    from localclip.models import build_model
    from localclip.train import check_model

    config = train_config(["ptb-small", "--fragments", "11", "--period", "16"])
    check_model(config)
    model = build_model("lstm", ntoken=10000, **config.workload.model_options)
    n_tensors = sum(1 for p in model.parameters() if p.requires_grad)
    avg = PeriodicAverager(model, config.round.period, group=localclip.comm.SingleProcess(), fragments=config.round.fragments)
    assert (n_tensors, len(avg.fragment_elements)) == (10, 11)
    assert max(avg.fragment_bytes) <= 1.05 * avg.numel * 4 / 11


@pytest.mark.parametrize(
    "flags,fields",
    [
        (["--algorithm", "single", "--workers", "4"], ("workers", "single")),
        (["--algorithm", "naive", "--period", "8"], ("period", "naive")),
        (["--algorithm", "local-sgd", "--gamma", "5"], ("gamma", "local-sgd")),
        (["--algorithm", "local-sgd", "--set", "max_grad_norm=1"], ("max_grad_norm", "local-sgd")),
        (["--algorithm", "single", "--set", "participants=2"], ("participants", "single")),
        (["--algorithm", "naive", "--clip-mode", "max"], ("clip_mode", "naive")),
        (["--algorithm", "local-sgd", "--clip-mode", "global_average"], ("clip_mode", "local-sgd")),
        (["--inner-optimizer", "adamw"], ("inner_optimizer", "lr")),
    ],
)
def test_explicit_values_an_algorithm_would_replace_are_refused(tmp_path, capsys, flags, fields):
    out = tmp_path / "run"
    code = main(["train", "ptb-small", *flags, "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and all(f in err for f in fields) and err.count("\n") == 1, err
    assert not out.exists()


def test_low_bit_rounds_without_error_feedback_run_what_the_library_composition_runs():
    argvs = [
        ["--compression", "int4", "--no-error-feedback"],
        ["--compression", "int8", "--no-error-feedback", "--algorithm", "episode"],
        ["--compression", "int4", "--no-error-feedback", "--inner-optimizer", "adamw", "--lr", "0.01", "--outer-optimizer", "nesterov"],
    ]
    configs = [train_config(["ptb-small", "--workers", "2", "--period", "2", *argv]) for argv in argvs]
    assert all(cfg.round.error_feedback is False for cfg in configs)
    for rank_results in SimulatedWorld(2).run(_both, configs):
        for argv, (built, hand) in zip(argvs, rank_results):
            assert _same_bits(built[0], hand[0]) and built[1:] == hand[1:], argv


def test_low_bit_rounds_in_flight_run_what_the_library_composition_runs():
    argvs = [
        ["--compression", "int4", "--overlap", "1"],
        ["--compression", "int8", "--overlap", "1", "--fragments", "2", "--no-error-feedback", "--outer-optimizer", "nesterov"],
    ]
    configs = [train_config(["ptb-small", "--workers", "2", "--period", "2", *argv]) for argv in argvs]
    assert [(cfg.round.compression, cfg.round.overlap) for cfg in configs] == [("int4", 1), ("int8", 1)]
    for rank_results in SimulatedWorld(2).run(_both, configs):
        for argv, (built, hand) in zip(argvs, rank_results):
            assert _same_bits(built[0], hand[0]) and built[1:] == hand[1:], argv


@pytest.mark.parametrize("flags", [["--no-error-feedback"], ["--no-error-feedback", "--compression", "bf16"]])
def test_error_feedback_off_without_low_bit_rounds_is_refused_naming_both(tmp_path, capsys, flags):
    out = tmp_path / "run"
    code = main(["train", "ptb-small", *flags, "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "Invalid error_feedback: False" in err and "compression=" in err and err.count("\n") == 1, err
    assert not out.exists()


def test_a_recipes_own_values_are_not_the_users():
    """ptb-small's period 8, workers 4 and gamma 5 are the recipe's: the algorithm replaces them."""
    assert train_config(["ptb-small", "--algorithm", "naive"]).round.period == 1
    single = train_config(["ptb-small", "--algorithm", "single"])
    assert (single.algorithm.workers, single.round.period) == (1, 1)
    assert train_config(["ptb-small", "--algorithm", "local-sgd"]).local.gamma == math.inf
    # an explicit value equal to what the algorithm fixes is no conflict
    assert train_config(["ptb-small", "--algorithm", "naive", "--period", "1"]).round.period == 1


def test_schedule_questions_are_answered_by_the_algorithm():
    assert communication_period(build.resolved(TrainConfig().replace(algorithm="naive"))) == 1
    assert communication_period(build.resolved(TrainConfig().replace(algorithm="celgc", period=8))) == 8
    assert communication_period(build.resolved(TrainConfig().replace(algorithm="single"))) is None

    def worker():
        out = {}
        for name in ("celgc", "naive", "episode"):
            alg = build_algorithm(build.resolved(TrainConfig().replace(algorithm=name, workers=2, period=4)), tiny_model(), current())
            out[name] = (alg.period, [alg.communicates(s) for s in range(1, 9)])
        return out

    got = SimulatedWorld(2).run(worker)[0]
    assert got["celgc"] == (4, [False, False, False, True] * 2) == got["episode"]
    assert got["naive"] == (1, [True] * 8)


# -- what the combinations do ----------------------------------------------------------------------


def _adamw_run(outer="none", compression="none", algorithm="celgc"):
    cfg = train_config(["ptb-small", "--algorithm", algorithm, "--workers", "2", "--period", "2", "--inner-optimizer", "adamw",
                        "--lr", "0.01", "--outer-optimizer", outer, "--compression", compression])

    def worker():
        model = tiny_model(seed=current().rank)
        return _train(model, build_algorithm(cfg, model, current()))

    return SimulatedWorld(2).run(worker)[0]


def test_adamw_with_an_outer_optimizer_takes_the_outer_step():
    plain, diloco = _adamw_run(), _adamw_run(outer="nesterov")
    assert not _same_bits(plain[0], diloco[0])
    assert plain[1] == diloco[1]


def test_adamw_with_bf16_rounds_halves_the_bytes():
    plain, bf16 = _adamw_run(), _adamw_run(compression="bf16")
    rounds = plain[1]
    weights = rounds * 4  # each round's float32 participation weight
    assert bf16[1] == rounds and (bf16[2] - weights) * 2 == plain[2] - weights


def test_episode_with_adamw_is_episode():
    celgc, episode = _adamw_run(), _adamw_run(algorithm="episode")
    assert not _same_bits(celgc[0], episode[0])
    # rounds after steps 2 and 4 and the final average; EPISODE adds a gradient all-reduce at steps 1, 3 and 5
    assert celgc[1] == 3 and episode[1] == 6


def test_episode_from_optimizer_steps():
    def worker():
        model = tiny_model(seed=current().rank)
        opt = ClippedAdamW(model.parameters(), lr=1e-2, max_grad_norm=0.1)
        alg = EPISODE.from_optimizer(model, opt, period=2)
        return _train(model, alg)

    (s0, rounds, _), (s1, _, _) = SimulatedWorld(2).run(worker)
    assert _same_bits(s0, s1) and rounds > 0


def test_episode_refuses_an_optimizer_it_cannot_clip():
    model = tiny_model()
    with pytest.raises(ValueError, match="Invalid optimizer for EPISODE: AdamW"):
        EPISODE.from_optimizer(model, torch.optim.AdamW(model.parameters()), period=2, group=localclip.comm.SingleProcess())


def test_the_summary_records_what_ran(tmp_path):
    """naive communicates every step: period 1 in config.json and summary.json, one round a step."""
    import json

    from helpers import SMOKE_DATA

    out = tmp_path / "naive"
    code = main(["train", "ptb-small", "--algorithm", "naive", "--workers", "2", "--max-steps", "4", "--out", str(out),
                 *SMOKE_DATA, "--no-progress", "--set", "eval_tokens=2000"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert summary["period"] == config["round"]["period"] == 1 and summary["comm/rounds"] == summary["steps"] == 4


def test_an_average_right_after_a_round_is_no_round():
    def worker():
        model = tiny_model(seed=current().rank)
        alg = CELGC(model, lr=0.1, gamma=1.0, period=8)
        for x, y in fixed_batches(current().rank, 80):
            alg.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            alg.step()
        alg.averager.average()  # the 80th step ended a round: nothing new to send
        return alg.rounds

    assert SimulatedWorld(2).run(worker)[0] == 10


def test_a_recipe_knows_its_settings_for_another_inner_optimizer():
    cfg = train_config(["ptb-gpt-small", "--inner-optimizer", "adamw"])
    assert (cfg.local.inner_optimizer, cfg.local.lr, cfg.local.betas, cfg.local.max_grad_norm) == ("adamw", 2e-3, [0.9, 0.95], 1.0)
    assert train_config(["ptb-gpt-small", "--inner-optimizer", "adamw", "--lr", "1e-3"]).local.lr == 1e-3  # the user's wins
    assert train_config(["ptb-small", "--inner-optimizer", "adamw", "--lr", "1e-3"]).local.lr == 1e-3


@pytest.mark.slow
@needs_real_ptb  # the loss it must reach is PTB's
def test_ptb_gpt_small_trains_with_adamw(tmp_path):
    import json

    out = tmp_path / "gpt"
    code = main(["train", "ptb-gpt-small", "--inner-optimizer", "adamw", "--max-steps", "60", "--out", str(out), "--data-root", str(REAL_PTB),
                 "--no-progress", "--set", "log_interval=10", "--set", "eval_tokens=20000"])
    assert code == 0
    losses = [json.loads(line)["train/loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if "train/loss" in line]
    assert losses[-1] < losses[0] - 1.0 and math.isfinite(json.loads((out / "summary.json").read_text())["val/ppl"])


# -- devices ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("device,ok", [("cpu", True), ("auto", True), ("cuda", True), ("cuda:1", True), ("gpu", False), ("cuda:x", False)])
def test_device_values(device, ok):
    from localclip import devices

    if ok:
        devices.check(device)
    else:
        with pytest.raises(ConfigError, match=f"Invalid device: '{device}'"):
            devices.check(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_cuda_is_refused_in_one_line_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "ptb-small", "--device", "cuda", "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "Invalid device: 'cuda' (CUDA is not available" in err and err.count("\n") == 1
    assert not out.exists()


def test_checkpoint_state_is_moved_to_the_cpu_without_copying_cpu_tensors():
    from collections import namedtuple

    from localclip import devices

    Pair = namedtuple("Pair", "h c")
    t = torch.ones(2)
    state = {"a": [t, (t, 3)], "b": Pair(t, t), "c": None}
    moved = devices.to_cpu(state)
    assert moved["a"][0] is t and moved["a"][1][0] is t and moved["b"].h is t and isinstance(moved["b"], Pair)
