"""Mel features, the Vocos ISTFT head, frame expansion and the GFSQ quantizer (models/chattts/mel.py, vocos.py,
dvae.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from chattts_serve.models.chattts.config import (
    HOP_LENGTH,
    N_FFT,
    NUM_MELS,
    SAMPLE_RATE,
    DVAEConfig,
    ModelConfig,
    VocosConfig,
)
from chattts_serve.models.chattts.dvae import DVAE, GFSQ, Decoder, expand_frames
from chattts_serve.models.chattts.mel import hann_window, log_mel_spectrogram, mel_filterbank
from chattts_serve.models.chattts.vocos import ISTFTHead, Vocos

# ---------------------------------------------------------------- mel filterbank


def test_mel_filterbank_shape_and_sign():
    fb = mel_filterbank()
    assert fb.shape == (N_FFT // 2 + 1, NUM_MELS) == (513, 100)
    assert fb.dtype == torch.float32
    assert (fb >= 0).all()
    assert (fb.max(dim=0).values > 0).all()  # no empty filter
    assert fb.max() <= 1.0


def test_mel_filterbank_is_triangular_with_increasing_peaks():
    fb = mel_filterbank().numpy()
    peaks = fb.argmax(axis=0)
    assert (np.diff(peaks) > 0).all()
    for m in range(fb.shape[1]):
        col = fb[:, m]
        nz = np.flatnonzero(col > 0)
        assert (np.diff(nz) == 1).all(), f"filter {m} support is not contiguous"
        seg = col[nz[0] : nz[-1] + 1]
        p = peaks[m] - nz[0]
        assert (np.diff(seg[: p + 1]) >= 0).all() and (np.diff(seg[p:]) <= 0).all(), f"filter {m} not unimodal"


def test_mel_filterbank_matches_htk_triangles():
    def hz_to_mel(f):
        return 2595.0 * math.log10(1.0 + f / 700.0)

    def mel_to_hz(m):
        return 700.0 * (10.0 ** (m / 2595.0) - 1.0)

    n_freqs, n_mels = 513, 100
    mels = np.linspace(hz_to_mel(0.0), hz_to_mel(SAMPLE_RATE / 2), n_mels + 2)
    edges = [mel_to_hz(m) for m in mels]
    freqs = np.linspace(0, SAMPLE_RATE // 2, n_freqs)
    expected = np.zeros((n_freqs, n_mels))
    for m in range(n_mels):
        lo, c, hi = edges[m], edges[m + 1], edges[m + 2]
        for i, f in enumerate(freqs):
            expected[i, m] = max(0.0, min((f - lo) / (c - lo), (hi - f) / (hi - c)))
    np.testing.assert_allclose(mel_filterbank().numpy(), expected, atol=1e-4)


# ---------------------------------------------------------------- log-mel


@pytest.mark.parametrize("length", [1024, 2048 + 17, 24000])
def test_log_mel_shape(length):
    wav = torch.randn(length) * 0.1
    mel = log_mel_spectrogram(wav, hann_window(), mel_filterbank())
    assert mel.shape == (NUM_MELS, 1 + length // HOP_LENGTH)
    batched = log_mel_spectrogram(torch.stack([wav, wav]), hann_window(), mel_filterbank())
    assert batched.shape == (2, NUM_MELS, 1 + length // HOP_LENGTH)
    torch.testing.assert_close(batched[1], mel)


def test_log_mel_matches_numpy_frames():
    rng = np.random.default_rng(0)
    wav = rng.standard_normal(4096).astype(np.float32) * 0.2
    wav[:300] = 0.0  # some frames hit the floor
    fb = mel_filterbank().numpy().astype(np.float64)
    win = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)  # periodic hann
    padded = np.pad(wav.astype(np.float64), N_FFT // 2, mode="reflect")
    n_frames = 1 + len(wav) // HOP_LENGTH
    expected = np.zeros((NUM_MELS, n_frames))
    for t in range(n_frames):
        frame = padded[t * HOP_LENGTH : t * HOP_LENGTH + N_FFT] * win
        mag = np.abs(np.fft.rfft(frame))
        expected[:, t] = np.log(np.maximum(mag @ fb, 1e-5))
    mel = log_mel_spectrogram(torch.from_numpy(wav), hann_window(), mel_filterbank())
    np.testing.assert_allclose(mel.double().numpy(), expected, atol=2e-3, rtol=1e-3)


def test_hann_window_is_periodic():
    w = hann_window()
    n = torch.arange(N_FFT, dtype=torch.float64)
    torch.testing.assert_close(w.double(), 0.5 - 0.5 * torch.cos(2 * math.pi * n / N_FFT), atol=1e-6, rtol=0)


# ---------------------------------------------------------------- ISTFT head / Vocos


def test_stft_istft_round_trip():
    torch.manual_seed(0)
    signal = torch.randn(HOP_LENGTH * 40) * 0.1
    win = hann_window()
    spec = torch.stft(signal, N_FFT, HOP_LENGTH, N_FFT, win, center=True, return_complex=True)
    out = torch.istft(spec, N_FFT, HOP_LENGTH, N_FFT, win, center=True)
    assert out.shape == signal.shape
    torch.testing.assert_close(out, signal, atol=1e-5, rtol=0)


def test_istft_head_reconstructs_signal():
    """An ISTFTHead whose linear layer is the identity turns [log|S|, angle S] back into the signal."""
    torch.manual_seed(1)
    signal = torch.randn(1, HOP_LENGTH * 32) * 0.1
    spec = torch.stft(signal, N_FFT, HOP_LENGTH, N_FFT, hann_window(), center=True, return_complex=True)
    feats = torch.cat([spec.abs().clamp_min(1e-12).log(), spec.angle()], dim=1).transpose(1, 2)  # [1, F, 1026]
    head = ISTFTHead(VocosConfig(dim=N_FFT + 2))
    with torch.no_grad():
        head.out.weight.copy_(torch.eye(N_FFT + 2))
        head.out.bias.zero_()
        rebuilt = head.spectrum(feats)
        out = head(feats)
    torch.testing.assert_close(rebuilt, spec, atol=1e-5, rtol=1e-5)
    assert out.shape == signal.shape
    torch.testing.assert_close(out, signal, atol=1e-5, rtol=0)


def test_istft_head_clips_magnitude():
    head = ISTFTHead(VocosConfig(dim=N_FFT + 2))
    with torch.no_grad():
        head.out.weight.copy_(torch.eye(N_FFT + 2))
        head.out.bias.zero_()
        feats = torch.zeros(1, 3, N_FFT + 2)
        feats[..., : N_FFT // 2 + 1] = 50.0  # e^50, far above the clip
        spec = head.spectrum(feats)
    torch.testing.assert_close(spec.abs(), torch.full_like(spec.abs(), 100.0))


@pytest.mark.parametrize("frames", [2, 7, 40])
def test_vocos_output_length(frames):
    torch.manual_seed(frames)
    vocos = Vocos(VocosConfig(dim=16, intermediate_dim=32, num_layers=1)).eval()
    with torch.no_grad():
        out = vocos(torch.randn(2, NUM_MELS, frames))
    assert out.shape == (2, HOP_LENGTH * (frames - 1))
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------- frame expansion, decoders


def test_expand_frames_channel_halves():
    b, c, t = 2, 3, 4
    x = torch.randn(b, 2 * c, t)
    y = expand_frames(x)
    assert y.shape == (b, c, 2 * t)
    for step in range(t):
        torch.testing.assert_close(y[:, :, 2 * step], x[:, :c, step], rtol=0, atol=0)
        torch.testing.assert_close(y[:, :, 2 * step + 1], x[:, c:, step], rtol=0, atol=0)


def test_decoder_and_dvae_output_shapes():
    cfg = ModelConfig.tiny()
    torch.manual_seed(0)
    dec, dvae = Decoder(cfg.decoder).eval(), DVAE(cfg.dvae).eval()
    with torch.no_grad():
        mel = dec(torch.randn(1, cfg.gpt.hidden_size, 5))
        mel2 = dvae(torch.randint(0, 625, (1, 4, 5)))
    assert mel.shape == mel2.shape == (1, NUM_MELS, 10)


def test_dvae_encode_shape():
    torch.manual_seed(0)
    dvae = DVAE(ModelConfig.tiny().dvae).eval()
    dvae.preprocessor_mel.mel_spec.spectrogram.window.copy_(hann_window())
    dvae.preprocessor_mel.mel_spec.mel_scale.fb.copy_(mel_filterbank())
    for length in (4096, 5000, 24000):
        with torch.no_grad():
            codes = dvae.encode(torch.randn(length) * 0.1)
        assert codes.shape == (4, (1 + length // HOP_LENGTH) // 2)
        assert codes.dtype == torch.int32
        assert ((codes >= 0) & (codes < 625)).all()
    with pytest.raises(ValueError, match="1-D"):
        dvae.encode(torch.zeros(2, 4096))


# ---------------------------------------------------------------- GFSQ


def identity_gfsq() -> GFSQ:
    """Two groups of 4 dims with identity projections, so codes are visible directly."""
    q = GFSQ(DVAEConfig(vq_dim=8))
    with torch.no_grad():
        for rvq in q.rvqs:
            rvq.project_in.weight.copy_(torch.eye(4))
            rvq.project_in.bias.zero_()
            rvq.project_out.weight.copy_(torch.eye(4))
            rvq.project_out.bias.zero_()
    return q


def code_vector(i: int) -> list[float]:
    return [((i // 5**d) % 5 - 2) / 2 for d in range(4)]


def test_gfsq_dequantize_matches_formula():
    q = identity_gfsq()
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 625, (2, 4, 3), generator=g)  # [B, G*R, T], column g * R + r
    with torch.no_grad():
        feats = q.dequantize(codes)
    assert feats.shape == (2, 8, 3)
    for b in range(2):
        for t in range(3):
            for grp in range(2):
                expected = [0.0] * 4
                for r in range(2):
                    c = code_vector(int(codes[b, grp * 2 + r, t]))
                    expected = [e + ci * 0.25**r for e, ci in zip(expected, c, strict=True)]
                got = feats[b, grp * 4 : grp * 4 + 4, t].tolist()
                assert got == pytest.approx(expected, abs=1e-6)


def test_gfsq_dequantize_codebook_values():
    q = identity_gfsq()
    allowed = {-1.0, -0.5, 0.0, 0.5, 1.0}
    assert q.codebook.shape == (625, 4)
    assert set(q.codebook.flatten().tolist()) == allowed
    for i in range(625):
        assert q.codebook[i].tolist() == code_vector(i)


def test_gfsq_quantize_valid_indices_and_reference():
    torch.manual_seed(3)
    q = GFSQ(DVAEConfig(vq_dim=16))  # random projections
    x = torch.randn(2, 16, 7) * 2
    with torch.no_grad():
        codes = q.quantize(x)
    assert codes.shape == (2, 4, 7) and codes.dtype == torch.int32
    assert ((codes >= 0) & (codes < 625)).all()
    # explicit reference: per group, per residual level
    half_l = 4 * (1 + 1e-3) / 2
    for b in range(2):
        for t in range(7):
            for grp in range(2):
                with torch.no_grad():
                    res = q.rvqs[grp].project_in(x[b, grp * 8 : grp * 8 + 8, t]).double()
                for r in range(2):
                    scale = 0.25**r
                    code = torch.round(torch.tanh(res / scale) * half_l) / 2
                    index = sum(int(round(float(code[d]) * 2 + 2)) * 5**d for d in range(4))
                    assert int(codes[b, grp * 2 + r, t]) == index
                    res = res - code * scale


def test_gfsq_quantize_recovers_level0_from_grid_features():
    """Features placed on the (pre-tanh) grid of code i quantize to index i at residual level 0."""
    q = identity_gfsq()
    idx = torch.tensor([0, 1, 7, 124, 312, 500, 624, 333])
    half_l = 4 * (1 + 1e-3) / 2
    grid = torch.tensor([code_vector(int(i)) for i in idx])  # [8, 4]
    feats = torch.atanh(grid * 2 / half_l)  # tanh(x) * half_l == 2 * code
    x = torch.cat([feats, feats.flip(0)], dim=1).t()[None]  # [1, 8, T=8]: group 1 gets the reversed list
    with torch.no_grad():
        codes = q.quantize(x)
    assert codes[0, 0].tolist() == idx.tolist()
    assert codes[0, 2].tolist() == idx.flip(0).tolist()
    # and dequantizing level 0 alone gives the grid back
    only0 = codes.clone()
    only0[:, [1, 3]] = 312  # index 312 is the zero vector
    assert code_vector(312) == [0.0] * 4
    with torch.no_grad():
        deq = q.dequantize(only0)
    torch.testing.assert_close(deq[0, :4].t(), grid)
    torch.testing.assert_close(deq[0, 4:].t(), grid.flip(0))
