"""An algorithm refuses a round part it cannot use as the part is given (a name or an object),
before its averager is built: a refused construction leaves the module's parameters where they
were (the averager would re-home them into its flat buffers) and reads nothing back from an
averager."""

import pytest

import localclip
from localclip.averaging import Participation, Streaming
from localclip.averaging.outer import OuterSGD
from localclip.comm import SingleProcess
from workers import tiny_model


def _storage(model) -> list[int]:
    return [p.data_ptr() for p in model.parameters()]


@pytest.mark.parametrize("build, message", [
    (lambda m: localclip.NaiveParallelClipping(m, lr=0.1, group=SingleProcess(), codec="int8"),
     "Invalid codec 'int8' for naive parallel clipping"),
    (lambda m: localclip.NaiveParallelClipping(m, lr=0.1, group=SingleProcess(), outer=OuterSGD(0.7)),
     "Invalid outer OuterSGD.* for naive parallel clipping"),
    (lambda m: localclip.NaiveParallelClipping(m, lr=0.1, group=SingleProcess(), participation=Participation(1)),
     "Invalid participation 1 for naive parallel clipping"),
    (lambda m: localclip.EPISODE(m, lr=0.1, gamma=1.0, period=4, group=SingleProcess(), streaming=Streaming(fragments=2)),
     "Invalid streaming=.* for EPISODE"),
], ids=["naive-codec", "naive-outer", "naive-participation", "episode-streaming"])
def test_a_part_given_as_an_object_is_refused_before_the_module_is_touched(build, message):
    model = tiny_model()
    before = _storage(model)
    with pytest.raises(ValueError, match=message):
        build(model)
    assert _storage(model) == before


def test_the_parts_it_can_use_are_built_into_its_averager():
    model = tiny_model()
    before = _storage(model)
    naive = localclip.NaiveParallelClipping(model, lr=0.1, group=SingleProcess(), codec="none", participation=Participation(None))
    assert naive.averager.codec.name == "none" and _storage(model) != before  # re-homed: the check let it through
