"""core's loss-mask weights (``stablerl.mask_weights``): 1/D per span of rows, read back exactly; a mask whose valid
weights differ is refused; and ``stablerl.reach.runnable_names`` (what an adapter registers)."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import stablerl
from stablerl.mask_weights import read_weights, span_weights
from stablerl.params import StableRLError


def _mask():
    lengths = torch.tensor([3, 1, 4, 0, 2, 5])
    return (torch.arange(5).unsqueeze(0) < lengths.unsqueeze(1)).long()


def test_span_weights_per_token_and_per_row():
    mask = _mask()
    w = span_weights(mask, [(0, 3), (3, 6)], per_token=True)
    assert torch.allclose(w[:3][mask[:3] > 0], torch.tensor(1 / 8)) and torch.allclose(w[3:][mask[3:] > 0], torch.tensor(1 / 7))
    assert float(w[:3].sum()) == pytest.approx(1.0) and float(w[3:].sum()) == pytest.approx(1.0)
    assert (w[mask == 0] == 0).all() and w.dtype == torch.float32
    rows = span_weights(mask, [(0, 6)], per_token=False)
    assert torch.allclose(rows[mask > 0], torch.tensor(1 / 6))  # D = the span's rows, the empty one included
    for start, end, d in ((0, 3, 8), (3, 6, 7)):
        valid, got = read_weights(w[start:end])
        assert got == d and torch.equal(valid, (mask[start:end] > 0).float())


def test_read_weights_of_an_empty_micro_batch_and_bf16():
    valid, d = read_weights(torch.zeros(2, 3))
    assert d is None and valid.sum() == 0
    w = span_weights(_mask(), [(0, 6)], per_token=True).to(torch.bfloat16)  # 1/15 in bf16: D read back by rounding
    assert read_weights(w)[1] == 15


@settings(max_examples=30, deadline=None)
@given(scale=st.floats(min_value=1.001, max_value=100.0))
def test_differing_weights_are_refused(scale):
    w = span_weights(_mask(), [(0, 6)], per_token=True)
    w[0, 0] = w[0, 0] * scale
    with pytest.raises(StableRLError, match="skyrl: the loss mask's weights differ"):
        read_weights(w, "skyrl: ")


def test_runnable_names_are_the_selectable_or_partial():
    from stablerl.frameworks import REFUSED, get_framework, reach
    from stablerl.reach import runnable_names

    verl = get_framework("verl")
    names = runnable_names("verl", stablerl.POLICY_LOSS)
    want = [s.name for s in stablerl.list_algorithms(stablerl.POLICY_LOSS) if reach(verl, s)[0] != REFUSED]
    assert names == want and "gmpo" in names and runnable_names(verl, stablerl.POLICY_LOSS) == names
    assert not set(names) & {s.name for s in stablerl.list_algorithms(stablerl.POLICY_LOSS) if s.status == "unavailable"}
