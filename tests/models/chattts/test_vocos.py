"""models/chattts/vocos.py: the inverse STFT without a host sync, against ``torch.istft``."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from chattts_serve.models.chattts.config import HOP_LENGTH, N_FFT, VocosConfig
from chattts_serve.models.chattts.mel import hann_window
from chattts_serve.models.chattts.vocos import ISTFTHead, istft, window_envelope

SYNCING_OPS = {"aten._local_scalar_dense.default", "aten.item.default", "aten.equal.default", "aten.nonzero.default"}
"""Ops whose result the host reads: each one waits for the device on CUDA."""


class _OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _spectra(batch: int, frames: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (batch, N_FFT // 2 + 1, frames)
    return torch.complex(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) * 10


def _reference(spec: torch.Tensor) -> torch.Tensor:
    return torch.istft(spec, N_FFT, HOP_LENGTH, N_FFT, hann_window(), center=True)


@pytest.mark.parametrize(("batch", "frames"), [(1, 2), (1, 5), (3, 37), (2, 245)])
def test_istft_is_torch_istft_to_the_bit_on_cpu(batch, frames):
    spec = _spectra(batch, frames)
    want = _reference(spec)
    got = istft(spec, hann_window())
    assert got.shape == want.shape == (batch, HOP_LENGTH * (frames - 1))
    assert torch.equal(got, want)
    assert torch.equal(istft(spec, hann_window(), window_envelope(hann_window(), frames)), want)


def test_right_padded_rows_decode_as_each_row_alone():
    """Rows padded to one frame count (window buckets) keep their own samples: the padding frames do
    not leak into a row's tail, and each row is normalised by its own envelope."""
    lens = [40, 17, 2, 39]
    spec = _spectra(len(lens), 40, seed=1)
    spec[1, :, 17:] = 1e6  # whatever the padding frames hold, they are dropped
    got = istft(spec, hann_window(), frames=torch.tensor(lens))
    for i, n in enumerate(lens):
        alone = _reference(spec[i : i + 1, :, :n])[0]
        assert torch.equal(got[i, : HOP_LENGTH * (n - 1)], alone), f"row {i}"
    assert torch.isfinite(got).all()


def test_istft_reads_nothing_back_to_the_host():
    """torch.istft checks NOLA with a device-to-host read (a sync per call on CUDA); ours has none."""
    spec = _spectra(2, 9)
    with _OpLog() as ref_log:
        _reference(spec)
    assert SYNCING_OPS & set(ref_log.ops), "torch.istft no longer syncs: this test would prove nothing"
    for frames in (None, torch.tensor([9, 4])):
        with _OpLog() as log:
            istft(spec, hann_window(), frames=frames)
        assert not SYNCING_OPS & set(log.ops)


def test_head_keeps_a_bounded_number_of_envelopes():
    from chattts_serve.models.chattts import vocos

    head = ISTFTHead(VocosConfig(dim=8, intermediate_dim=16, num_layers=1))
    for frames in range(2, 2 + vocos._ENVELOPES_KEPT + 5):
        env = head.envelope(frames)
        assert torch.equal(env, window_envelope(head.istft.window, frames))
    assert len(head._envelopes) == vocos._ENVELOPES_KEPT
    assert head.envelope(frames) is env  # the latest length is kept
