"""Values a store or feature set must not hold: int8 quantization refuses NaN and inf (it
would store them as 0), and `ditdata verify` reports NaN/inf of feature sets as faults and
tokens that are exactly zero in every dimension as warnings."""

from __future__ import annotations

import numpy as np
import pytest
from cliutil import raises_one_line

from ditdata.store import StoreError, quantize


@pytest.mark.parametrize("bad, counts", [(np.nan, "1 NaN and 0 inf"), (np.inf, "0 NaN and 1 inf"),
                                         (-np.inf, "0 NaN and 1 inf")])
def test_quantize_refuses_non_finite_values(bad, counts):
    x = np.random.default_rng(0).standard_normal((2, 4, 8)).astype(np.float32)
    x[1, 2, 3] = bad
    message = raises_one_line(StoreError, lambda: quantize(x))
    assert f"{counts} value(s) of 64" in message and "int8 cannot store them" in message
    x[1, 2, 3] = 0.5  # the same tokens, finite: quantized as always
    q, scale = quantize(x)
    assert q.dtype == np.int8 and np.isfinite(scale).all() and scale[1, 2] == np.float32(np.abs(x[1, 2]).max() / 127)
