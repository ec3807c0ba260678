"""localclip.integrations.accelerate in one process: prepare returns the model unwrapped and the
algorithm around the user's optimizer, and refuses in one line what it cannot wrap. (The
two-process run is tests/integrations/test_examples.py's.)"""

import importlib.util

import pytest
import torch

from localclip.algorithms import DistributedAlgorithm
from localclip.errors import ConfigError
from localclip.optim import ClippedSGD

pytestmark = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                                reason="accelerate not installed (pip install 'localclip[accelerate]')")


def _parts():
    from accelerate import Accelerator

    model = torch.nn.Linear(4, 2)
    return Accelerator(cpu=True), model, ClippedSGD(model.parameters(), lr=0.5, gamma=0.1)


def test_prepare_wraps_the_optimizer_and_leaves_the_model_as_it_is():
    from localclip.integrations.accelerate import prepare

    accelerator, model, optimizer = _parts()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))), batch_size=4)
    prepared, alg, prepared_loader = prepare(accelerator, model, optimizer, loader, period=2)
    assert prepared is model and isinstance(alg, DistributedAlgorithm)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    for x, y in prepared_loader:
        alg.zero_grad()
        accelerator.backward(torch.nn.functional.cross_entropy(prepared(x), y))
        alg.step()
    moved = torch.linalg.vector_norm(torch.cat([p.detach().flatten() for p in model.parameters()]) - before)
    assert 0 < moved <= 2 * 0.1 + 1e-6  # two clipped steps, each at most gamma long
    assert alg.averager.schedule.step_count == 2 and alg.rounds == 0  # a world of one has nothing to average


@pytest.mark.parametrize("algorithm,message", [("local-sgd", "Invalid algorithm: 'local-sgd'"), ("single", "Invalid algorithm: 'single'")])
def test_prepare_refuses_an_algorithm_that_fixes_the_local_update_or_the_world(algorithm, message):
    from localclip.integrations.accelerate import prepare

    accelerator, model, optimizer = _parts()
    with pytest.raises(ConfigError, match=message):
        prepare(accelerator, model, optimizer, algorithm=algorithm)


def test_prepare_refuses_an_algorithm_in_place_of_the_optimizer():
    from localclip.integrations.accelerate import prepare

    accelerator, model, optimizer = _parts()
    _, alg = prepare(accelerator, model, optimizer, period=2)
    with pytest.raises(ConfigError, match="pass the inner optimizer"):
        prepare(accelerator, model, alg, period=2)
