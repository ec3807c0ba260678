"""The final evaluation's settings that docs/README offer to make it cheaper: longer windows
(``eval_bptt``) score a recurrent model on the same quantity, a larger ``test_batch_size`` on
another one (more streams, each from a zero state)."""

import math

import pytest

from localclip.comm import SimulatedWorld, current
from localclip.recipes import get_recipe
from localclip.train.workloads import LMWorkload
from helpers import CUSTOM, SHARED


def perplexities(settings: list[dict]) -> list[float]:
    """The test perplexity of one small LSTM (one worker) under each of ``settings``."""
    config = get_recipe("ptb-small").replace(data_root=str(SHARED), allow_custom_corpus=CUSTOM, eval_tokens=3000,
                                 model_options=dict(emb_size=32, hidden_size=32, dropout=0.0))

    def worker():
        workload = LMWorkload(config, current())  # the corpus is read once
        found = []
        for changes in settings:
            workload.config = config.replace(**changes)
            found.append(workload.evaluate("test")["ppl"])
        return found

    [found] = SimulatedWorld(1).run(worker)
    return found


@pytest.mark.full  # reads the corpus
def test_longer_windows_give_the_same_perplexity_and_more_streams_another():
    reference, long, short, streams = perplexities([dict(eval_bptt=35), dict(eval_bptt=350), dict(eval_bptt=7), dict(test_batch_size=10)])
    assert math.isfinite(reference)  # ptb-small's windows at its test batch 2
    assert long == pytest.approx(reference, rel=1e-6) and short == pytest.approx(reference, rel=1e-6)
    assert streams != pytest.approx(reference, rel=1e-6)
