"""kernels/lengths.py: what a CUDA graph's padded forward uses instead of host lengths gives each row what the
host-length code gives it: the masked instance norm and the LSTM that stops at each row's end, against their
per-row and packed references, on ragged rows."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from chattts_serve.kernels.lengths import DeviceLengths, masked_bilstm, masked_instance_norm

LENGTHS = [7, 3, 5, 1]


def _ragged(channels: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(len(LENGTHS), channels, max(LENGTHS), generator=gen)
    return x * DeviceLengths(torch.tensor(LENGTHS), max(LENGTHS)).mask(x.device, x.dtype)


def test_masked_instance_norm_is_each_rows_own_instance_norm():
    gen = torch.Generator().manual_seed(0)
    x = _ragged(4, gen) + 3.0  # an offset: the statistics must ignore the padding's zeros
    weight, bias = torch.rand(4, generator=gen) + 0.5, torch.randn(4, generator=gen)
    got = masked_instance_norm(x, weight, bias, DeviceLengths(torch.tensor(LENGTHS), max(LENGTHS)))
    assert torch.isfinite(got).all()  # a one-step row too (its variance is 0)
    for row, n in enumerate(LENGTHS):
        if n == 1:  # torch's kernel refuses one step
            continue
        want = F.instance_norm(x[row : row + 1, :, :n], weight=weight, bias=bias, use_input_stats=True, eps=1e-5)
        torch.testing.assert_close(got[row : row + 1, :, :n], want, rtol=1e-5, atol=1e-5)
        assert not got[row, :, n:].any()  # padding comes back as zero


def test_masked_bilstm_is_the_packed_lstm():
    torch.manual_seed(0)
    lstm = nn.LSTM(6, 4, 1, batch_first=True, bidirectional=True)
    x = _ragged(6, torch.Generator().manual_seed(1)).transpose(1, 2)  # [B, T, C]
    lengths = torch.tensor(LENGTHS)
    packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    want = nn.utils.rnn.pad_packed_sequence(lstm(packed)[0], batch_first=True, total_length=max(LENGTHS))[0]
    with torch.inference_mode():
        got = masked_bilstm(lstm, x, DeviceLengths(lengths, max(LENGTHS)))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="one-layer bidirectional"):
        masked_bilstm(nn.LSTM(6, 4, 2, batch_first=True, bidirectional=True), x, DeviceLengths(lengths, 7))
