"""audio/stream.py: window planning with fake decoders (exact bookkeeping), then streaming with a real
Decoder + Vocos whose receptive field is as deep as the official model's (quality at the seams)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from chattts_serve import Engine, SamplingParams
from chattts_serve.audio.decode import decode
from chattts_serve.audio.policy import StreamPolicy
from chattts_serve.audio.stream import AudioStream, Window
from chattts_serve.bench.stats import snr_db
from chattts_serve.engine.config import EngineConfig
from chattts_serve.engine.core import EngineCore
from chattts_serve.models.chattts.config import ConvStackConfig, DecoderConfig, ModelConfig, VocosConfig

SPT = 512  # samples per GPT step
HALF = SPT // 2


def true_signal(num_samples: int) -> np.ndarray:
    """Sample i of the utterance: +-2**-(i % 11). Powers of two, so a linear crossfade of two
    identical signals (x * (1 - f) + x * f) gives back exactly x."""
    i = np.arange(num_samples)
    sign = np.where(i % 3 == 0, -1.0, 1.0)
    return (sign * 2.0 ** -(i % 11)).astype(np.float32)


class FakeDecoder:
    """Window -> the true samples of the region it covers, with NaN wherever a real decoder's output
    would be unreliable: the first ``left_context`` steps after an interior left edge, and the last
    ``lookahead * 512 - 256 - crossfade`` samples before the right edge of a non-final window. Any of
    those samples reaching the output (even blended) makes the output NaN."""

    def __init__(self, policy: StreamPolicy, num_steps: int, poison: bool = True, offset_per_window: float = 0.0):
        self.p = policy
        self.true = true_signal(SPT * num_steps)
        self.poison = poison
        self.offset_per_window = offset_per_window
        self.calls = 0

    def __call__(self, w: Window) -> np.ndarray:
        n = SPT * w.num_steps - HALF
        out = self.true[SPT * w.start : SPT * w.start + n].copy()
        assert len(out) == n
        out += np.float32(self.offset_per_window * self.calls)
        self.calls += 1
        if self.poison:
            if w.start > 0:
                out[: SPT * min(self.p.left_context, w.num_steps)] = np.nan
            if not w.final:
                bad = SPT * self.p.lookahead - HALF - self.p.crossfade
                if bad:
                    out[-bad:] = np.nan
        return out


@dataclasses.dataclass
class Trace:
    pcm: list[np.ndarray]
    windows: list[tuple[int, Window]]  # (steps pushed when the window was planned, window)


def drive(policy: StreamPolicy, n: int, decoder=None) -> Trace:
    """As EngineCore does: one step pushed, then at most one window, per engine step; after the
    last step, one window per engine step until the stream is done."""
    stream = AudioStream(policy, 1, max(n, 1), torch.device("cpu"))
    decoder = decoder or FakeDecoder(policy, n)
    trace = Trace([], [])

    def one_window() -> bool:
        w = stream.next_window()
        if w is None:
            return False
        assert w.stream is stream
        trace.windows.append((stream.num_steps, w))
        samples = decoder(w)
        trace.pcm.append(stream.accept(w, samples))
        return True

    for i in range(n):
        stream.push((i % 625, 0, 0, 0), torch.zeros(1))
        one_window()
        assert not stream.done
    stream.finish()
    for _ in range(n + 2):
        if not one_window():
            break
    assert stream.done and stream.next_window() is None
    assert stream.total_samples == max(SPT * n - HALF, 0)
    assert stream.emitted_samples == sum(len(x) for x in trace.pcm)
    assert stream.codes == [(i % 625, 0, 0, 0) for i in range(n)]
    return trace


POLICIES = [
    StreamPolicy(),
    StreamPolicy(first_chunk=4),
    StreamPolicy(first_chunk=1, max_chunk=1, left_context=0, lookahead=1, crossfade=0),
    StreamPolicy(first_chunk=1, max_chunk=5, left_context=3, lookahead=1, crossfade=256),
    StreamPolicy(first_chunk=3, max_chunk=50, left_context=0, lookahead=2, crossfade=768),
    StreamPolicy(first_chunk=7, max_chunk=7, left_context=40, lookahead=3, crossfade=1),
    StreamPolicy(first_chunk=2, max_chunk=64, left_context=16, lookahead=6, crossfade=0),
    StreamPolicy.one_shot(),
]
LENGTHS = [1, 2, 3, 5, 11, 12, 13, 21, 22, 23, 37, 64, 100, 191, 300]


def policy_id(p: StreamPolicy) -> str:
    return f"{p.first_chunk}-{p.max_chunk}-{p.left_context}-{p.lookahead}-{p.crossfade}"


# ---------------------------------------------------------------- bookkeeping with a fake decoder


@pytest.mark.parametrize("policy", POLICIES, ids=policy_id)
def test_emits_exactly_the_true_signal(policy):
    for n in LENGTHS:
        trace = drive(policy, n)
        out = np.concatenate(trace.pcm)
        assert len(out) == SPT * n - HALF, n
        assert not np.isnan(out).any(), f"n={n}: samples from a window's unreliable margin were emitted"
        np.testing.assert_array_equal(out, true_signal(SPT * n)[: SPT * n - HALF], err_msg=f"n={n}")


@pytest.mark.parametrize("policy", POLICIES, ids=policy_id)
def test_chunk_schedule(policy):
    for n in LENGTHS:
        trace = drive(policy, n)
        emitted, expect = 0, policy.first_chunk
        for k, (pushed, w) in enumerate(trace.windows):
            chunk = w.emit_to_step - emitted
            last = k == len(trace.windows) - 1
            assert w.final == last
            if not last:
                assert chunk == expect
                # planned as soon as, and not before, the chunk plus its lookahead existed
                assert pushed == emitted + chunk + policy.lookahead
                assert w.end == w.emit_to_step + policy.lookahead <= pushed
                assert len(trace.pcm[k]) == SPT * chunk
            else:
                assert w.emit_to_step == w.end == n
                assert 1 <= chunk < expect + policy.lookahead
                assert len(trace.pcm[k]) == SPT * chunk - HALF
            assert w.start == max(0, emitted - policy.left_context)
            assert w.keep_from == SPT * (emitted - w.start)
            emitted = w.emit_to_step
            expect = min(expect * 2, policy.max_chunk)
        assert emitted == n


def test_chunk_sizes_double_up_to_max():
    trace = drive(StreamPolicy(first_chunk=3, max_chunk=20), 200)
    sizes, prev = [], 0
    for _, w in trace.windows:
        sizes.append(w.emit_to_step - prev)
        prev = w.emit_to_step
    assert sizes[:5] == [3, 6, 12, 20, 20]
    assert all(s == 20 for s in sizes[3:-1])


def test_first_window_latency():
    p = StreamPolicy(first_chunk=12, lookahead=10)
    stream = AudioStream(p, 1, 100, torch.device("cpu"))
    for i in range(21):
        stream.push((0, 0, 0, 0), torch.zeros(1))
        assert stream.next_window() is None, i
    stream.push((0, 0, 0, 0), torch.zeros(1))
    w = stream.next_window()
    assert (w.start, w.end, w.emit_to_step, w.final) == (0, 22, 12, False)
    assert (w.keep_from, w.keep_to) == (0, 12 * SPT + p.crossfade)
    assert stream.next_window() == w  # planning is idempotent until the window is accepted


def test_crossfade_blends_linearly():
    p = StreamPolicy(first_chunk=2, max_chunk=4, left_context=2, lookahead=2, crossfade=200)
    n = 30
    dec = FakeDecoder(p, n, poison=False, offset_per_window=1.0)  # window k is off by +k
    trace = drive(p, n, dec)
    out = np.concatenate(trace.pcm)
    base = true_signal(SPT * n)[: SPT * n - HALF]
    err = out - base  # the offsets: k inside chunk k, blended from k-1 to k at each seam
    fade = np.linspace(0.0, 1.0, p.crossfade + 2, dtype=np.float32)[1:-1]
    seam = emitted = 0
    assert len(trace.windows) > 4
    for k, (_, w) in enumerate(trace.windows):
        assert seam == SPT * emitted  # chunk k starts where chunk k - 1 ended, at a step boundary
        end = seam + len(trace.pcm[k])
        region = err[seam:end]
        if k:
            np.testing.assert_allclose(region[: p.crossfade], (k - 1) * (1 - fade) + k * fade, atol=1e-5)
            np.testing.assert_allclose(region[p.crossfade :], k, atol=1e-5)
        else:
            np.testing.assert_allclose(region, 0, atol=1e-6)
        seam, emitted = end, w.emit_to_step


def test_one_shot_is_one_window_when_finished():
    p = StreamPolicy.one_shot()
    stream = AudioStream(p, 1, 300, torch.device("cpu"))
    for _ in range(300):
        stream.push((0, 0, 0, 0), torch.zeros(1))
        assert stream.next_window() is None
    assert not stream.done
    stream.finish()
    w = stream.next_window()
    assert (w.start, w.end, w.keep_from, w.keep_to, w.emit_to_step, w.final) == (0, 300, 0, 300 * SPT - HALF, 300, True)
    pcm = stream.accept(w, true_signal(300 * SPT)[: 300 * SPT - HALF])
    assert len(pcm) == 300 * SPT - HALF and stream.done and stream.next_window() is None


def test_empty_stream():
    for p in (StreamPolicy(), StreamPolicy.one_shot()):
        stream = AudioStream(p, 1, 4, torch.device("cpu"))
        assert stream.next_window() is None and not stream.done
        stream.finish()
        assert stream.next_window() is None and stream.done
        assert stream.total_samples == 0 and stream.emitted_samples == 0


def test_hidden_states_are_kept_in_order():
    stream = AudioStream(StreamPolicy(), 3, 5, torch.device("cpu"))
    for i in range(5):
        stream.push((i, i, i, i), torch.full((3,), float(i)))
    assert torch.equal(stream.hidden[:, 0], torch.arange(5, dtype=torch.float32))
    assert stream.num_steps == 5 and len(stream.codes) == 5


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(first_chunk=0), "first_chunk"),
        (dict(first_chunk=-1), "first_chunk"),
        (dict(first_chunk=1.5), "first_chunk"),
        (dict(first_chunk=20, max_chunk=10), "max_chunk"),
        (dict(max_chunk=-5), "max_chunk"),
        (dict(left_context=-1), "left_context"),
        (dict(left_context=None), "left_context"),
        (dict(lookahead=-1), "lookahead"),
        (dict(lookahead=0), "lookahead"),
        (dict(lookahead=1, crossfade=257), "lookahead"),
        (dict(lookahead=2, crossfade=769), "lookahead"),
        (dict(crossfade=-1), "crossfade"),
        (dict(crossfade="256"), "crossfade"),
    ],
)
def test_policy_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        StreamPolicy(**kw)


def test_policy_limits_accepted():
    StreamPolicy(lookahead=1, crossfade=256)  # exactly enough
    StreamPolicy(lookahead=2, crossfade=768)
    StreamPolicy(first_chunk=1, max_chunk=1, left_context=0, lookahead=1, crossfade=0)
    assert StreamPolicy.one_shot().first_chunk >= 1 << 20


# ---------------------------------------------------------------- a real Decoder + Vocos


def deep_config() -> ModelConfig:
    """Tiny GPT; Decoder and Vocos as deep as the official ones (receptive field ~ +-50 steps)."""
    return dataclasses.replace(
        ModelConfig.tiny(),
        decoder=DecoderConfig(ConvStackConfig(idim=32, odim=32, hidden=48, num_layers=12, bn_dim=16)),
        vocos=VocosConfig(dim=32, intermediate_dim=64, num_layers=8),
    )


@pytest.fixture(scope="module")
def deep_engine(tmp_path_factory):
    from chattts_serve.models.chattts.random_checkpoint import write_random

    root = write_random(tmp_path_factory.mktemp("deep") / "ckpt", deep_config(), seed=0)
    return Engine.from_pretrained(root, device="cpu", config=EngineConfig.with_slots(4))


TEXT = "今天天气真不错，我们一起去公园散步吧。"
CASES = [(1, 150), (2, 300), (3, 220)]  # (seed, steps)
STREAM_POLICIES = [StreamPolicy(), StreamPolicy(first_chunk=4)]
MIN_SNR_DB = 40.0


def params(seed: int, steps: int) -> SamplingParams:
    return SamplingParams(seed=seed, min_new_tokens=steps, max_new_tokens=steps, refine_text=False)


def run_requests(core: EngineCore, reqs: dict[str, tuple[SamplingParams, StreamPolicy]]):
    """Run requests together; returns per request its non-empty audio chunks, final output, stream."""
    chunks = {rid: [] for rid in reqs}
    finals, streams = {}, {}
    for rid, (p, policy) in reqs.items():
        core.add_request(rid, core.prepare(TEXT, p), policy)
    while core.has_unfinished():
        for o in core.step():
            if len(o.audio):
                chunks[o.request_id].append(o.audio)
            if o.finished:
                finals[o.request_id] = o
        for rid in reqs:
            req = core.stage.pipeline.requests.get(rid)
            if req is not None and req.segments[0].stream is not None:
                streams[rid] = req.segments[0].stream
    assert all(finals[rid].finish_reason == "length" for rid in reqs)
    return chunks, finals, streams


@pytest.fixture(scope="module")
def one_shot(deep_engine):
    """Per case: the one-shot audio and codes (and a direct decode of the captured hidden states)."""
    core = deep_engine.core
    out = {}
    for seed, steps in CASES:
        chunks, finals, streams = run_requests(core, {"ref": (params(seed, steps), StreamPolicy.one_shot())})
        assert len(chunks["ref"]) == 1
        audio = chunks["ref"][0]
        codes = finals["ref"].segments[0].codes
        assert codes.shape == (steps, 4) and len(audio) == SPT * steps - HALF
        stream = streams["ref"]
        direct = decode(deep_engine.model, stream.hidden[: stream.num_steps], torch.as_tensor(codes))
        np.testing.assert_allclose(audio, direct, rtol=0, atol=1e-6)
        out[(seed, steps)] = (audio, codes)
    return out


def check_stream(ref: np.ndarray, chunks: list[np.ndarray], label: str) -> float:
    x = np.concatenate(chunks)
    assert len(x) == len(ref), label
    seams = np.cumsum([len(c) for c in chunks])[:-1]
    assert len(seams) >= 2, label
    assert all(s % SPT == 0 for s in seams), label
    overall = snr_db(ref, x)
    seam_snrs = [snr_db(ref[s - 512 : s + 512], x[s - 512 : s + 512]) for s in seams]
    max_step = np.abs(np.diff(ref)).max()
    seam_steps = [np.abs(np.diff(x[s - 64 : s + 64])).max() for s in seams]
    print(
        f"\n{label}: {len(seams)} seams, SNR overall {overall:.1f} dB, "
        f"seams min {min(seam_snrs):.1f} dB ({', '.join(f'{v:.1f}' for v in seam_snrs)}); "
        f"max |diff| at seams {max(seam_steps):.2e} vs one-shot {max_step:.2e}"
    )
    assert overall >= MIN_SNR_DB, label
    assert min(seam_snrs) >= MIN_SNR_DB, (label, seam_snrs)
    assert max(seam_steps) <= max_step, label  # no clicks
    return min(seam_snrs)


@pytest.mark.parametrize("policy", STREAM_POLICIES, ids=policy_id)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"seed{c[0]}-{c[1]}steps")
def test_streamed_audio_matches_one_shot(deep_engine, one_shot, policy, case):
    ref, ref_codes = one_shot[case]
    chunks, finals, _ = run_requests(deep_engine.core, {"s": (params(*case), policy)})
    np.testing.assert_array_equal(finals["s"].segments[0].codes, ref_codes)  # streaming does not change codes
    check_stream(ref, chunks["s"], f"seed {case[0]}, {case[1]} steps, policy {policy_id(policy)}")


def test_concurrent_streams_match_one_shot(deep_engine, one_shot):
    """All cases at once (windows of equal length are decoded as one batch)."""
    reqs = {f"c{i}": (params(*case), StreamPolicy()) for i, case in enumerate(CASES)}
    chunks, finals, _ = run_requests(deep_engine.core, reqs)
    for i, case in enumerate(CASES):
        ref, ref_codes = one_shot[case]
        np.testing.assert_array_equal(finals[f"c{i}"].segments[0].codes, ref_codes)
        check_stream(ref, chunks[f"c{i}"], f"concurrent seed {case[0]}, {case[1]} steps")


def test_seam_check_has_teeth(deep_engine, one_shot):
    """Without margins the same measurement sees the seams: the 40 dB bar is not trivially met."""
    bare = StreamPolicy(first_chunk=4, max_chunk=16, left_context=0, lookahead=1, crossfade=0)
    ref, _ = one_shot[CASES[0]]
    chunks, _, _ = run_requests(deep_engine.core, {"bare": (params(*CASES[0]), bare)})
    x = np.concatenate(chunks["bare"])
    assert len(x) == len(ref)
    seams = np.cumsum([len(c) for c in chunks["bare"]])[:-1]
    worst = min(snr_db(ref[s - 512 : s + 512], x[s - 512 : s + 512]) for s in seams)
    print(f"\nno-margin policy: worst seam SNR {worst:.1f} dB")
    assert worst < MIN_SNR_DB
