"""Values go down from the config to where they act: naive's fixed period has one owner (the
algorithm, which the builder's table reads), and the round's outer optimizer is handed to the
algorithm by whoever built it from the config instead of being read back from the algorithm."""

from localclip.algorithms import ALGORITHMS, NaiveParallelClipping, build_algorithm
from localclip.algorithms.build import communication_period, outer_optimizer, resolved
from localclip.comm import SimulatedWorld, current
from localclip.optim import ClippedSGD
from localclip.train import TrainConfig

from workers import tiny_model


def test_naives_fixed_period_is_the_algorithms_and_the_builder_reads_it_there():
    fixed = NaiveParallelClipping.fixed_period
    assert ALGORITHMS["naive"].fixed["period"][0] == fixed
    config = resolved(TrainConfig().replace(algorithm="naive", workers=2))
    assert config.round.period == fixed and communication_period(config) == fixed

    def worker():
        model = tiny_model()
        given = NaiveParallelClipping(model, lr=0.1)
        other = tiny_model()
        wrapped = NaiveParallelClipping.from_optimizer(other, ClippedSGD(other.parameters(), lr=0.1), 8)
        return given.period, wrapped.period

    assert SimulatedWorld(2).run(worker) == [(fixed, fixed)] * 2


def test_the_algorithm_takes_the_outer_optimizer_it_is_handed():
    config = resolved(TrainConfig().replace(algorithm="celgc", workers=2, period=2, outer_optimizer="nesterov", outer_lr=0.5))

    def worker():
        outer = outer_optimizer(config)
        algorithm = build_algorithm(config, tiny_model(), current(), outer=outer)
        built_here = build_algorithm(config, tiny_model(), current())
        return algorithm.averager.outer is outer, (built_here.averager.outer.kind, built_here.averager.outer.lr)

    assert SimulatedWorld(2).run(worker) == [(True, ("nesterov", 0.5))] * 2


def test_a_trainers_step_decay_and_its_rounds_share_the_outer_optimizer_built_from_the_config(monkeypatch):
    """The trainer builds the outer optimizer once, from ``config.round``, and hands that object
    down to both; the averager's attribute is never asked for it."""
    from localclip.train import trainer as trainer_module
    from helpers import CUSTOM, SHARED
    from localclip.recipes import get_recipe

    built = []
    real = trainer_module.outer_optimizer
    monkeypatch.setattr(trainer_module, "outer_optimizer", lambda cfg: built.append(real(cfg)) or built[-1])
    config = resolved(get_recipe("ptb-small").replace(
        workers=2, period=2, outer_optimizer="sgd", outer_lr=0.5, outer_lr_decay=True, lr_decay_epochs=[1], lr_decay=0.5,
        data_root=str(SHARED), allow_custom_corpus=CUSTOM, threads=1, eval_tokens=200, max_steps=2,
        model_options={"emb_size": 8, "hidden_size": 8, "num_layers": 1}))

    def worker():
        trainer = trainer_module.Trainer(config, None, progress=False)
        return trainer.step_size.outer is trainer.algorithm.averager.outer and trainer.step_size.outer in built

    assert SimulatedWorld(2).run(worker) == [True, True]
    assert len(built) == 2 and [o.lr for o in built] == [0.5, 0.5]
