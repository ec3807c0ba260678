"""The parts of a round in localclip.averaging: the codecs by name, the averager composed of part
objects (the same bits as the same parts named by keyword options), and one stateless round."""

import importlib.util

import pytest
import torch

import localclip
from localclip.averaging import Participation, PeriodicAverager, Streaming, average_parameters, codecs, round_parts
from localclip.averaging.outer import OuterSGD
from localclip.comm import SimulatedWorld, SingleProcess, current


def _model(seed):
    g = torch.Generator().manual_seed(seed)
    with localclip.rng.seeded(seed):  # one thread at a time: the layers' own initialisation draws
        model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Tanh(), torch.nn.Linear(30, 5))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


def _bits(t):
    return t.detach().contiguous().view(-1).view(torch.uint8)


def _train(make_averager, steps=6):
    """Each worker's parameters after ``steps`` SGD steps on its own data, averaged by the
    averager that ``make_averager(model, optimizer)`` builds."""

    def worker():
        rank = current().rank
        model = _model(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        avg = make_averager(model, opt)
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(steps):
            x, y = torch.randn(8, 40, generator=g), torch.randint(0, 5, (8,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            avg.step()
        return [p.detach().clone() for p in model.parameters()], avg.rounds, avg.bytes_communicated

    return SimulatedWorld(3).run(worker)


@pytest.mark.parametrize("compression", ["none", "bf16", "fp16", "int8", "int4"])
def test_codecs_by_name(compression):
    codec = codecs.get(compression)
    assert codec.name == compression and compression in codecs.COMPRESSIONS
    assert codec.anchored == (compression != "none")
    assert codec.reduction == ("lowbit" if compression in ("int8", "int4") else "all_reduce")
    assert codecs.get(codec) is codec
    values = torch.ones(5)
    wire = codec.send_buffer(values)
    assert (wire is None) == (compression not in ("bf16", "fp16"))
    if compression in ("int8", "int4"):
        assert codec.feedback(7, "cpu").residual.numel() == 7
        assert codecs.get(compression, error_feedback=False).feedback(7, "cpu") is None


def test_codec_names_are_checked():
    with pytest.raises(ValueError, match="Invalid compression: 'zstd'"):
        codecs.get("zstd")
    with pytest.raises(ValueError, match="error_feedback=False with compression='bf16'"):
        codecs.get("bf16", error_feedback=False)


def test_no_top_level_round_modules():
    # What a round does lives in localclip.averaging only.
    assert importlib.util.find_spec("localclip.lowbit") is None
    assert importlib.util.find_spec("localclip.outer") is None
    assert localclip.OuterSGD is OuterSGD


@pytest.mark.parametrize("options", [
    dict(compression="int4", participants=2, participation_seed=5),
    dict(compression="bf16", outer_optimizer="nesterov", fragments=2),
    dict(compression="int8", error_feedback=False, overlap=1),
])
def test_parts_as_objects_give_the_bits_of_the_same_parts_by_name(options):
    options = dict(options)
    nesterov = options.pop("outer_optimizer", None) == "nesterov"

    def named(model, opt):
        extra = {"outer_optimizer": OuterSGD(0.7, 0.9, nesterov=True)} if nesterov else {}
        return PeriodicAverager(model, 2, optimizer=opt, **options, **extra)

    def composed(model, opt):
        parts = round_parts(**{k: v for k, v in options.items() if k not in ("fragments", "overlap")})
        return PeriodicAverager(model, 2, optimizer=opt, codec=parts.codec,
                                outer=OuterSGD(0.7, 0.9, nesterov=True) if nesterov else None,
                                participation=Participation(options.get("participants"), options.get("participation_seed", 0)),
                                streaming=Streaming(fragments=options.get("fragments", 1), overlap=options.get("overlap", 0)))

    by_name, by_part = _train(named), _train(composed)
    for (params, rounds, sent), (params2, rounds2, sent2) in zip(by_name, by_part):
        assert rounds == rounds2 > 0 and sent == sent2 > 0
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(params, params2))


def test_a_part_and_its_options_at_once_are_refused():
    with pytest.raises(ValueError, match="Invalid compression='int8' with codec="):
        PeriodicAverager(_model(0), 2, group=SingleProcess(), codec="bf16", compression="int8")
    with pytest.raises(ValueError, match="Invalid fragments=2 with streaming="):
        PeriodicAverager(_model(0), 2, group=SingleProcess(), streaming=Streaming(), fragments=2)


def test_average_parameters_is_the_averagers_round():
    def worker(compression):
        rank = current().rank
        mine = [t.clone() for t in _model(rank).parameters()]
        tensors = [t.detach().clone() for t in mine]
        sent = average_parameters(tensors, codec=compression)
        model = _model(0)
        with torch.no_grad():
            for p, t in zip(model.parameters(), mine):
                p.copy_(t)
        avg = PeriodicAverager(model, 1, compression=compression)  # its anchor: rank 0's model
        with torch.no_grad():
            for p, t in zip(model.parameters(), mine):
                p.copy_(t)  # after the initial broadcast: each worker's own values again
        avg.average()
        return tensors, [p.detach().clone() for p in model.parameters()], [t.detach() for t in mine], sent

    plain = SimulatedWorld(3).run(worker, "none")
    for tensors, averaged, _, sent in plain:
        assert sent == sum(t.numel() * 4 for t in tensors) + 4  # the values and the weight
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(tensors, averaged))
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(tensors, plain[0][0]))
    mean = [sum(w[2][i] for w in plain) / 3 for i in range(len(plain[0][2]))]
    lowbit = SimulatedWorld(3).run(worker, "int8")
    for tensors, *_ in lowbit:
        # The change since zero in int8: the same bits everywhere, within the codes' error of the mean.
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(tensors, lowbit[0][0]))
        assert all(torch.allclose(t, m, atol=0.05 * float(m.abs().max())) for t, m in zip(tensors, mean))
        assert not all(torch.equal(_bits(t), _bits(m)) for t, m in zip(tensors, mean))  # it was encoded


def test_algorithms_refuse_parts_given_as_objects_as_they_refuse_their_names():
    with pytest.raises(ValueError, match="Invalid codec 'int8' for naive parallel clipping"):
        localclip.NaiveParallelClipping(_model(0), lr=0.1, group=SingleProcess(), codec="int8")
    with pytest.raises(ValueError, match="Invalid participation 1 for naive parallel clipping"):
        localclip.NaiveParallelClipping(_model(0), lr=0.1, group=SingleProcess(), participation=Participation(1))
    with pytest.raises(ValueError, match="Invalid streaming=.* for EPISODE"):
        localclip.EPISODE(_model(0), lr=0.1, gamma=1.0, period=4, group=SingleProcess(), streaming=Streaming(fragments=2))
