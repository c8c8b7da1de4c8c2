"""The ONNX export of the GPT trunk (models/chattts/onnx_export.py with onnx_graph.py, onnx_quant.py and
onnx_cache.py) and its ORT step over the KV slot cache (models/chattts/onnx_trunk.py), against the torch trunk
on the tiny checkpoint."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime", reason="the ort-* precisions need the [onnx] extra")

from chattts_serve.bench.ort_ops import op_seconds  # noqa: E402
from chattts_serve.kernels import onnx_runtime  # noqa: E402
from chattts_serve.kernels.onnx_quant import int8_reduce_range  # noqa: E402
from chattts_serve.kernels.quant import check_supported, parse_precision  # noqa: E402
from chattts_serve.models.chattts import checkpoint, onnx_cache, onnx_export  # noqa: E402
from chattts_serve.models.chattts.onnx_cache import Manifest  # noqa: E402
from chattts_serve.models.chattts.onnx_export import cached_export, export  # noqa: E402
from chattts_serve.models.chattts.onnx_trunk import OnnxTrunk, check_export, gqa_providers  # noqa: E402

NUM_SLOTS, MAX_LEN = 6, 64
PROMPTS = {0: 5, 1: 9, 2: 3, 3: 12, 5: 7}  # slot -> prompt length (slot 4 stays empty)
# (slots decoding) per step: gaps (idle rows inside the block), one row, an unsorted set, every slot.
STEPS = [[0, 2, 3], [1, 3], [5], [3, 0, 5, 1], [0, 1, 2, 3, 5], [2, 5]]
# Relative error of a decode step's hidden state vs torch fp32, measured on the tiny random checkpoint
# (fp32 ~3e-7; int8 ~1 %; 4-bit ~10 %: random tiny weights are its worst case) with room to spare.
BOUND = {"fp32": 1e-4, "int8": 0.05, "int8r7": 0.05, "int4": 0.3}


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return checkpoint.load(tiny_ckpt)


@pytest.fixture(scope="module")
def exports(model, onnx_cache_dir):
    """Every weight kind, written where ``cached_export`` looks for it (the engines of test_onnx_runner.py
    then load these instead of exporting again)."""
    base, digest = Path(onnx_cache_dir), onnx_cache.checkpoint_digest(model.root)

    def build(weights: str, reduce_range: bool) -> Path:
        out = base / onnx_cache.cache_key(digest, weights, reduce_range)
        if not (out / onnx_cache.MANIFEST).exists():
            export(model, out, weights, digest, reduce_range)
        return out

    out = {w: build(w, False) for w in onnx_runtime.WEIGHT_KINDS}
    out["int8r7"] = build("int8", True)  # as on x86 without VNNI
    return out


def _trunk(model, exports, key):
    weights = "int8" if key == "int8r7" else key
    return OnnxTrunk(exports[key], model.config.gpt, weights, torch.device("cpu"))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _ort_decode(trunk, cache, emb, slots, lengths, block=None):
    """The runner's block step: rows lo..hi (or ``block`` rows from lo), the ones not in ``slots`` idle."""
    lo = min(slots)
    block = block or max(slots) - lo + 1
    rows = [s - lo for s in slots]
    x = torch.zeros(block, 1, emb.shape[1])
    x[rows, 0] = emb
    seqlens = np.zeros(block, np.int32)
    seqlens[rows] = lengths
    active = np.zeros(block, np.int32)
    active[rows] = 1
    return trunk.run(x, cache, lo, seqlens, active)[rows, 0]


def _run_both(model, trunk):
    """Prefill PROMPTS, then decode STEPS, in torch fp32 and in ORT; yields (what, torch, ort) hidden
    states, then the two caches."""
    gpt, hidden = model.gpt, model.config.gpt.hidden_size
    gen = torch.Generator().manual_seed(0)
    cache_t, cache_o = gpt.new_cache(NUM_SLOTS, MAX_LEN), trunk.new_cache(NUM_SLOTS, MAX_LEN)
    out = []
    lengths = dict(PROMPTS)
    with torch.inference_mode():
        for slot, n in PROMPTS.items():
            emb = torch.randn(1, n, hidden, generator=gen)
            ht = gpt(emb, torch.arange(n)[None], cache_t, torch.tensor([slot]), 0, None, last_only=False)
            ho = trunk.run(emb, cache_o, slot, np.array([n - 1], np.int32), np.array([n], np.int32))
            out.append((f"prefill slot {slot}", ht[0], ho[0]))
        for step, slots in enumerate(STEPS):
            emb = torch.randn(len(slots), hidden, generator=gen)
            lens = [lengths[s] for s in slots]
            ht = gpt.decode(emb, cache_t, slots, lens)
            ho = _ort_decode(trunk, cache_o, emb, slots, lens)
            out.append((f"decode step {step} slots {slots}", ht, ho))
            for s in slots:
                lengths[s] += 1
    return out, cache_t, cache_o, lengths


def test_fp32_matches_torch_over_steps_and_slot_layouts(model, exports):
    trunk = _trunk(model, exports, "fp32")
    steps, cache_t, cache_o, lengths = _run_both(model, trunk)
    for what, ht, ho in steps:
        assert _rel(ho, ht) < BOUND["fp32"], what
        # The heads run in torch on either: logits as close as the hidden states.
        assert _rel(model.embed.code_logits(ho), model.embed.code_logits(ht)) < BOUND["fp32"], what
    # Every position each slot wrote holds the same keys and values (idle rows wrote nothing).
    for slot, n in lengths.items():
        for name in ("k", "v"):
            a, b = getattr(cache_t, name)[:, slot, :, :n], getattr(cache_o, name)[:, slot, :, :n]
            assert _rel(b, a) < BOUND["fp32"], (slot, name)


@pytest.mark.parametrize("weights", ["int8", "int8r7", "int4"])
def test_quantized_stays_within_its_bound(model, exports, weights):
    steps, *_ = _run_both(model, _trunk(model, exports, weights))
    errors = [_rel(ho, ht) for _, ht, ho in steps]
    assert all(np.isfinite(errors)) and max(errors) < BOUND[weights]
    assert max(errors) > 1e-6  # the weights really are quantized


def test_idle_rows_leave_their_cache_alone(model, exports):
    trunk = _trunk(model, exports, "fp32")
    cache = trunk.new_cache(4, MAX_LEN)
    cache.k.normal_(), cache.v.normal_()
    before_k, before_v = cache.k.clone(), cache.v.clone()
    hidden = model.config.gpt.hidden_size
    # Slots 0 and 3 decode at positions 10 and 20; slots 1 and 2 (say, one free, one just prefilled) idle.
    _ort_decode(trunk, cache, torch.randn(2, hidden), [0, 3], [10, 20])
    changed = (cache.k != before_k).any(-1)  # [layers, slots, heads, positions]
    assert changed[:, [1, 2]].sum() == 0 and torch.equal(cache.v[:, 1:3], before_v[:, 1:3])
    assert changed[:, 0, :, 10].all() and changed[:, 3, :, 20].all()
    assert changed[:, 0].sum() == changed[:, 0, :, 10].sum()  # nothing else of slot 0 either


@pytest.mark.parametrize("weights", onnx_runtime.WEIGHT_KINDS)
def test_batch_invariance_per_mode(model, exports, weights):
    """What each mode promises: fp32 and 4-bit compute a row the same whatever else is in the call
    (MLAS's GEMMs and the 4-bit kernel's per-row activation blocks); int8 quantises the activations with
    one scale per call, so active neighbours change a row's result, idle (zero) rows do not."""
    trunk = _trunk(model, exports, weights)
    hidden = model.config.gpt.hidden_size
    gen = torch.Generator().manual_seed(1)
    base = trunk.new_cache(8, MAX_LEN)
    base.k.copy_(torch.randn(base.k.shape, generator=gen))
    base.v.copy_(torch.randn(base.v.shape, generator=gen))
    emb = torch.randn(8, hidden, generator=gen) * 3
    lengths = [11, 30, 5, 17, 40, 8, 23, 2]

    def row0(slots, block=None):
        cache = trunk.new_cache(8, MAX_LEN)
        cache.k.copy_(base.k), cache.v.copy_(base.v)
        return _ort_decode(trunk, cache, emb[slots], slots, [lengths[s] for s in slots], block)[0]

    alone = row0([0])
    assert torch.equal(alone, row0([0], block=6)), "idle rows must not change a row"
    with_neighbours = [row0(list(range(n))) for n in (2, 3, 4, 8)]
    if weights == "int8":
        assert not all(torch.equal(alone, h) for h in with_neighbours)
    else:
        assert all(torch.equal(alone, h) for h in with_neighbours)


@pytest.mark.parametrize("weights", onnx_runtime.WEIGHT_KINDS)
def test_batched_prefill_right_padded(model, exports, weights):
    """Prompts of consecutive slots prefilled in one call (the runner's burst of admissions): each row's
    hidden states and cache are what it gets alone (fp32, 4-bit: exactly; int8, whose activation scale
    is per call: exactly when its only company is padding), and its padding comes out as zeros and
    writes nothing to the cache."""
    trunk = _trunk(model, exports, weights)
    hidden = model.config.gpt.hidden_size
    gen = torch.Generator().manual_seed(2)
    lens = np.array([5, 12, 1, 9], np.int32)
    x = torch.zeros(len(lens), int(lens.max()), hidden)
    for b, n in enumerate(lens):
        x[b, :n] = torch.randn(n, hidden, generator=gen)

    def prefill(rows: list[int], pad_to: int | None = None):
        cache = trunk.new_cache(4, MAX_LEN)
        cache.k.fill_(7.0), cache.v.fill_(7.0)  # whatever a slot held before
        n = lens[rows]
        width = pad_to or int(n.max())
        h = trunk.run(x[rows, :width].contiguous(), cache, rows[0], n - 1, n)
        return h, cache

    together, cache = prefill([0, 1, 2, 3])
    for b, n in enumerate(lens):
        assert torch.count_nonzero(together[b, n:]) == 0, "padding must come out as zeros"
        assert (cache.k[:, b, :, n:] == 7.0).all() and (cache.v[:, b, :, n:] == 7.0).all()
    # Padding alone changes nothing, in every mode.
    (alone, cache_alone), (padded, cache_padded) = prefill([0]), prefill([0], pad_to=int(lens.max()))
    assert torch.equal(padded[0, : lens[0]], alone[0])
    assert torch.equal(cache_padded.k[:, 0], cache_alone.k[:, 0])
    if weights == "int8":
        return
    for b, n in enumerate(lens):  # and neighbours change nothing where the mode is batch-invariant
        h, single = prefill([b])
        assert torch.equal(together[b, :n], h[0]), b
        assert torch.equal(cache.k[:, b, :, :n], single.k[:, b, :, :n])
        assert torch.equal(cache.v[:, b, :, :n], single.v[:, b, :, :n])


def test_op_profile_splits_the_runs_by_kind_and_changes_nothing(model, exports, tmp_path):
    """``profile --ops``: under ORT's profiler the trunk computes exactly what it computes without it,
    reports every run's kernels under its kind, cleans its file up, and runs on without the profiler."""
    trunk = _trunk(model, exports, "fp32")
    x = torch.randn(1, 3, model.config.gpt.hidden_size, generator=torch.Generator().manual_seed(4))

    def three_runs():
        cache = trunk.new_cache(1, 8)
        out = [trunk.run(x, cache, 0, np.array([2], np.int32), np.array([3], np.int32))]
        for n in (3, 4):
            out.append(trunk.run(x[:, :1].contiguous(), cache, 0, np.array([n], np.int32), np.array([1], np.int32)))
        return out

    plain = three_runs()
    trunk.start_op_profile(tmp_path)
    profiled = three_runs()
    recorded = trunk.end_op_profile()
    assert recorded.kinds == ["prefill", "decode", "decode"]
    seconds = op_seconds(recorded.events, recorded.kinds)
    assert all(torch.equal(a, b) for a, b in zip(plain, profiled, strict=True))
    assert seconds["runs"] == {"decode": 2, "prefill": 1}
    for kind in ("decode", "prefill"):
        ops = seconds[kind]
        assert ops["GroupQueryAttention"] > 0 and ops["MatMul"] > 0
        # One inter-op thread: a run's kernels follow each other inside its span.
        assert sum(ops.values()) <= seconds["run_s"][kind] + 1e-6 * len(ops) * 40
    assert list(tmp_path.iterdir()) == []  # the profile file is read and removed
    assert all(torch.equal(a, b) for a, b in zip(plain, three_runs(), strict=True))  # profiler off again
    assert trunk.session.end_profiling() == ""  # nothing was being recorded any more
    with pytest.raises(RuntimeError, match="without start_op_profile"):
        trunk.end_op_profile()


def test_run_refuses_slots_and_positions_outside_the_cache(model, exports):
    trunk = _trunk(model, exports, "fp32")
    cache = trunk.new_cache(2, 16)
    x = torch.zeros(2, 1, model.config.gpt.hidden_size)
    one = np.ones(2, np.int32)
    with pytest.raises(ValueError, match="outside the cache"):
        trunk.run(x, cache, 1, one, one)
    with pytest.raises(ValueError, match="exceeds cache"):
        trunk.run(x, cache, 0, one * 16, one)
    with pytest.raises(ValueError, match="rotary table"):
        trunk.new_cache(1, trunk.max_positions + 1)


def test_export_is_checked_against_the_model(model, exports, tmp_path):
    manifest = Manifest.read(exports["int8"])
    assert manifest.weights == "int8" and manifest.num_layers == model.config.gpt.num_layers
    assert not manifest.int8_reduce_range and Manifest.read(exports["int8r7"]).int8_reduce_range
    with pytest.raises(ValueError, match="does not fit"):
        OnnxTrunk(exports["int8"], model.config.gpt, "fp32", torch.device("cpu"))
    with pytest.raises(ValueError, match="not an ONNX export"):
        Manifest.read(tmp_path)


def test_cache_reuses_an_export_and_keys_it_by_checkpoint_and_mode(model, tmp_path, monkeypatch):
    first = cached_export(model, "fp32", tmp_path)
    assert (first / onnx_runtime.MODEL_FILE).exists()

    def no_export(*_a, **_k):
        raise AssertionError("exported again")

    monkeypatch.setattr(onnx_export, "export", no_export)
    assert cached_export(model, "fp32", tmp_path) == first
    monkeypatch.setattr(onnx_export, "checkpoint_digest", lambda _root: "f" * 64)  # another checkpoint
    with pytest.raises(AssertionError, match="exported again"):
        cached_export(model, "fp32", tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # the failed attempt left nothing


def test_checkpoint_digest_follows_the_trunk_files(tiny_ckpt, tmp_path):
    import shutil

    copy = shutil.copytree(tiny_ckpt, tmp_path / "ckpt")
    assert onnx_cache.checkpoint_digest(copy) == onnx_cache.checkpoint_digest(tiny_ckpt)
    config = copy / checkpoint.GPT_CONFIG
    config.write_text(config.read_text() + "\n")
    assert onnx_cache.checkpoint_digest(copy) != onnx_cache.checkpoint_digest(tiny_ckpt)


def test_int8_keeps_to_7_bits_where_the_kernel_can_saturate():
    from chattts_serve.cpu import parse_cpuinfo

    def cpu(flags: str, arch: str = "x86_64"):
        return parse_cpuinfo(f"flags\t: {flags}\n", arch=arch)

    assert int8_reduce_range(cpu("fpu sse avx2 fma"))  # AVX2 only: vpmaddubsw (int16 sums)
    assert not int8_reduce_range(cpu("avx2 avx512f avx512_vnni"))
    assert not int8_reduce_range(cpu("avx2 avx_vnni"))
    assert int8_reduce_range(parse_cpuinfo("", arch="x86_64"))  # unreadable: the safe choice
    assert not int8_reduce_range(parse_cpuinfo("", arch="aarch64"))  # Arm's dot products sum in int32
    digest = "0" * 64
    assert onnx_cache.cache_key(digest, "int8", True) != onnx_cache.cache_key(digest, "int8", False)
    assert onnx_cache.cache_key(digest, "int4", True) == onnx_cache.cache_key(digest, "int4", False)


def test_missing_onnxruntime_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(ValueError, match=r"pip install 'chattts-serve\[onnx\]'"):
        check_supported(parse_precision("ort-int8"), torch.device("cpu"))


def test_ort_modes_are_cpu_only_for_now():
    with pytest.raises(ValueError, match="CPU only"):
        check_supported(parse_precision("ort-fp32"), torch.device("cuda"))


def test_export_cli_writes_a_checked_export(tiny_ckpt, tmp_path, capsys):
    from chattts_serve.cli import main

    out = tmp_path / "int8"
    argv = ["export", "onnx", "--model", str(tiny_ckpt), "--out", str(out), "--quant", "int8"]
    assert main([*argv, "--reduce-range", "on"]) == 0
    assert "checked on ORT's cpu" in capsys.readouterr().out
    assert Manifest.read(out).weights == "int8" and Manifest.read(out).int8_reduce_range
    size = (out / onnx_runtime.DATA_FILE).stat().st_size
    assert main(argv) == 0  # again into the same directory: replaced, not appended to
    assert (out / onnx_runtime.DATA_FILE).stat().st_size == size
    capsys.readouterr()
    for provider in ("cuda", "tensorrt"):  # this ONNX Runtime build has no GPU provider: refused, exit 2
        assert main([*argv, "--provider", provider]) == 2
        err = capsys.readouterr().err
        assert f"--provider {provider} refused" in err and "ExecutionProvider" in err
        assert "no fp32 CUDA kernel" in err and "--device cuda with --precision bf16 or fp16" in err
    assert main(["export", "onnx", "--model", str(tmp_path / "missing"), "--out", str(out)]) == 2


def test_gqa_placement_is_read_from_the_profiler(model, exports):
    """What the GPU check relies on: ORT's profiler names the provider each GroupQueryAttention ran on."""
    assert gqa_providers(_trunk(model, exports, "fp32"), torch.device("cpu")) == {"CPUExecutionProvider"}


def _pretend_gpu(monkeypatch, placed: set[str]) -> None:
    import onnxruntime

    import chattts_serve.models.chattts.onnx_trunk as onnx_trunk

    names = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: names)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(onnx_trunk, "OnnxTrunk", lambda *a, **k: None)
    monkeypatch.setattr(onnx_trunk, "gqa_providers", lambda trunk, device: placed)


@pytest.mark.parametrize("provider", ["cuda", "tensorrt"])
def test_gpu_provider_refused_when_gqa_falls_back_to_the_cpu(model, exports, monkeypatch, provider):
    _pretend_gpu(monkeypatch, {"CPUExecutionProvider"})
    with pytest.raises(ValueError, match=rf"--provider {provider} refused: GroupQueryAttention ran on CPUExec"):
        check_export(exports["fp32"], model.config.gpt, "fp32", provider)
    _pretend_gpu(monkeypatch, set())  # nothing recorded: cannot be verified, so refused
    with pytest.raises(ValueError, match="no provider ORT reported"):
        check_export(exports["fp32"], model.config.gpt, "fp32", provider)


def test_gpu_provider_accepted_only_when_gqa_runs_on_it(model, exports, monkeypatch):
    _pretend_gpu(monkeypatch, {"CUDAExecutionProvider"})
    check_export(exports["fp32"], model.config.gpt, "fp32", "cuda")
    with pytest.raises(ValueError, match="refused"):  # TensorRT wanted, the CUDA EP ran it
        check_export(exports["fp32"], model.config.gpt, "fp32", "tensorrt")


def test_gpu_provider_refused_without_a_cuda_device(model, exports, monkeypatch):
    _pretend_gpu(monkeypatch, {"CUDAExecutionProvider"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA device"):
        check_export(exports["fp32"], model.config.gpt, "fp32", "cuda")
