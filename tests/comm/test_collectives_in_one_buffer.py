"""Collectives whose tensors lie one after the other in one buffer (the low-bit round's pieces):
the gloo communicator sends from and receives into that buffer directly, with the results of
separate tensors."""

import pytest
import torch

from localclip.comm.distributed import _joined
from localclip.comm.launch import spawn

from workers import collectives_in_one_buffer

JOIN = 120  # seconds: a hang fails the test instead of blocking CI


def test_rows_one_after_the_other_are_one_view_of_their_buffer():
    buffer = torch.arange(24, dtype=torch.uint8)
    rows = buffer[4:16].view(3, 4).unbind(0)
    joined = _joined(list(rows))
    assert joined is not None and joined.data_ptr() == buffer[4:].data_ptr() and joined.numel() == 12
    joined.fill_(7)  # a view: the buffer itself changes
    assert buffer[4:16].eq(7).all() and buffer[:4].eq(torch.arange(4, dtype=torch.uint8)).all()
    floats = torch.zeros(10)
    assert _joined([floats[2:5], floats[5:9]]).data_ptr() == floats[2:].data_ptr()


@pytest.mark.parametrize("tensors", [
    lambda: list(torch.zeros(3, 4, dtype=torch.uint8)[:, 1:3].unbind(0)),  # columns: gaps between the rows
    lambda: [torch.zeros(4), torch.zeros(4)],  # two buffers
    lambda: [torch.zeros(8)[4:], torch.zeros(8)[:4]],  # not in order (and two buffers)
    lambda: list(torch.zeros(8).view(2, 4).unbind(0))[::-1],  # one buffer, out of order
])
def test_anything_else_is_not_joined(tensors):
    assert _joined(tensors()) is None


@pytest.mark.full  # gloo processes
def test_gloo_collectives_over_one_buffer_equal_those_over_separate_tensors():
    for rank, got in enumerate(spawn(collectives_in_one_buffer, 2, join_timeout=JOIN, timeout=60)):
        assert torch.equal(got["recv"], got["apart"]), rank
        assert got["recv"].view(2, 5)[1 - rank].tolist() == [40 * (1 - rank) + 5 * rank + i for i in range(5)]
        assert torch.equal(got["gathered"], got["gathered_apart"]) and got["gathered"].tolist() == [0.5] * 3 + [1.5] * 3
