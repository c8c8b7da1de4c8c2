"""The ``chattts-serve`` command, run as ``python -m chattts_serve.cli`` in subprocesses.

Every invocation pays for a fresh interpreter (torch import, model load), so the independent
invocations are started together once per module and each test checks its own result.
"""

from __future__ import annotations

import os
import subprocess
import sys
import wave
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from chattts_serve.models.chattts.speaker import decode_speaker

pytestmark = pytest.mark.integration

TIMEOUT = 300
ERROR_PREFIX = "chattts-serve: error: "


def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "CHATTTS_MODEL"}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONIOENCODING="utf-8")
    return env


def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "chattts_serve.cli", *args],
        cwd=cwd,
        env=cli_env(),
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=TIMEOUT,
    )


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def ckpt(workdir) -> tuple[Path, subprocess.CompletedProcess]:
    proc = run_cli(["checkpoint", "random", "ckpt", "--size", "tiny"], workdir)
    return workdir / "ckpt", proc


@pytest.fixture(scope="module")
def runs(workdir, ckpt) -> dict[str, subprocess.CompletedProcess]:
    model = str(ckpt[0])
    (workdir / "texts.txt").write_text("你好。\n\n   \n今天天气很好。\n一二三。\n", encoding="utf-8")
    commands = {
        "single": ["synthesize", "你好。", "-o", "single.wav", "--model", model, "--seed", "1"]
        + ["--max-new-tokens", "30", "--no-refine"],
        "input": ["synthesize", "--input", "texts.txt", "--output-dir", "outdir", "--model", model]
        + ["--seed", "2", "--max-new-tokens", "12", "--no-refine"],
        "speaker_a": ["speaker", "new", "--model", model, "--seed", "3"],
        "speaker_b": ["speaker", "new", "--model", model, "--seed", "3"],
        "missing_model": ["synthesize", "你好。", "-o", "m.wav", "--model", str(workdir / "no_such_model")],
        "empty_text": ["synthesize", "", "-o", "e.wav", "--model", model],
        "unknown_tag": ["synthesize", "你好。", "-o", "u.wav", "--model", model, "--no-refine", "--prompt", "[foo]"],
    }
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: pool.submit(run_cli, args, workdir) for name, args in commands.items()}
        return {name: f.result() for name, f in futures.items()}


def describe(proc: subprocess.CompletedProcess) -> str:
    return f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def read_wav(path: Path) -> tuple[int, int, int, int]:
    with wave.open(str(path), "rb") as w:
        return w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()


def assert_valid_wav(path: Path) -> int:
    channels, width, rate, frames = read_wav(path)
    assert (channels, width, rate) == (1, 2, 24_000)
    assert frames > 0 and (frames + 256) % 512 == 0, frames  # 512 * k - 256
    return frames


def test_checkpoint_random(ckpt, tiny_ckpt):
    root, proc = ckpt
    assert proc.returncode == 0, describe(proc)
    assert "ckpt" in proc.stdout
    # the CLI's default seed 0 writes the same bytes as write_random(seed=0)
    for rel in ("asset/gpt/model.safetensors", "asset/Embed.safetensors", "asset/tokenizer/tokenizer.json"):
        assert (root / rel).read_bytes() == (tiny_ckpt / rel).read_bytes(), rel


def test_synthesize_single_text(runs, workdir):
    proc = runs["single"]
    assert proc.returncode == 0, describe(proc)
    frames = assert_valid_wav(workdir / "single.wav")
    assert frames <= 512 * 30 - 256
    assert "single.wav" in proc.stdout


def test_synthesize_input_file_one_wav_per_line(runs, workdir):
    proc = runs["input"]
    assert proc.returncode == 0, describe(proc)
    out = workdir / "outdir"
    assert sorted(p.name for p in out.iterdir()) == ["0001.wav", "0002.wav", "0003.wav"]
    for p in out.iterdir():
        assert assert_valid_wav(p) <= 512 * 12 - 256


def test_speaker_new_is_deterministic(runs):
    a, b = runs["speaker_a"], runs["speaker_b"]
    assert a.returncode == 0, describe(a)
    assert b.returncode == 0, describe(b)
    lines = a.stdout.splitlines()
    assert len(lines) == 1
    assert a.stdout == b.stdout
    emb = decode_speaker(lines[0], expected_dim=64)  # the tiny checkpoint's own statistics
    assert emb.shape == (64,)


@pytest.mark.parametrize(
    "name,fragment",
    [
        ("missing_model", "no_such_model"),
        ("empty_text", "empty"),
        ("unknown_tag", "[foo]"),
    ],
)
def test_errors_exit_2_with_one_line(runs, name, fragment):
    proc = runs[name]
    assert proc.returncode == 2, describe(proc)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, describe(proc)
    assert lines[0].startswith(ERROR_PREFIX)
    assert fragment in lines[0]
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_checkpoint_random_for_each_registered_family(tmp_path, tiny_ckpt, capsys):
    """``--family`` takes every registered family; chattts is the default and writes what it always wrote."""
    from chattts_serve.cli import main
    from tests.support.sine_family import CONFIG, registered

    assert main(["checkpoint", "random", str(tmp_path / "c"), "--family", "chattts"]) == 0  # seed 0, as tiny_ckpt
    rel = "asset/gpt/model.safetensors"
    assert (tmp_path / "c" / rel).read_bytes() == (tiny_ckpt / rel).read_bytes()
    with registered():
        assert main(["checkpoint", "random", str(tmp_path / "s"), "--family", "sine", "--size", "full"]) == 0
    assert (tmp_path / "s" / CONFIG).is_file() and "random full sine checkpoint" in capsys.readouterr().out
    assert main(["checkpoint", "random", str(tmp_path / "k"), "--family", "kokoro", "--size", "tiny"]) == 0
    assert "random tiny kokoro checkpoint" in capsys.readouterr().out
    assert {p.name for p in (tmp_path / "k").iterdir()} == {"config.json", "kokoro-v1_0.pth", "voices"}
    with pytest.raises(SystemExit):
        main(["checkpoint", "random", str(tmp_path / "b"), "--family", "bark"])
    assert "invalid choice: 'bark' (choose from 'chattts', 'vits', 'kokoro')" in capsys.readouterr().err


def test_a_random_vits_checkpoint_is_written_detected_and_spoken(tmp_path, capsys):
    """``checkpoint random --family vits`` writes the MMS-TTS layout; ``synthesize --model`` detects and speaks it."""
    import wave

    from chattts_serve.cli import main

    root = tmp_path / "v"
    assert main(["checkpoint", "random", str(root), "--family", "vits", "--size", "tiny", "--seed", "3"]) == 0
    assert "random tiny vits checkpoint (seed 3)" in capsys.readouterr().out
    names = {p.name for p in root.iterdir()}
    assert {"config.json", "model.safetensors", "vocab.json", "tokenizer_config.json"} <= names
    out = tmp_path / "hello.wav"
    assert main(["synthesize", "Hello there.", "-o", str(out), "--model", str(root), "--seed", "1"]) == 0
    with wave.open(str(out)) as w:
        assert w.getframerate() == 16000 and w.getnframes() > 0


def test_a_broken_vits_checkpoint_is_one_line_not_a_traceback(tmp_path, capsys):
    from chattts_serve.cli import main
    from chattts_serve.models.vits.random_checkpoint import write_random

    root = write_random(tmp_path / "v", "tiny")
    (root / "model.safetensors").write_bytes(b"not safetensors")
    assert main(["synthesize", "Hello.", "-o", str(tmp_path / "x.wav"), "--model", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("chattts-serve: error: ") and "not a readable safetensors file" in err
    (root / "vocab.json").unlink()
    assert main(["synthesize", "Hello.", "-o", str(tmp_path / "x.wav"), "--model", str(root), "--family", "vits"]) == 2
    assert "incomplete; missing: vocab.json" in capsys.readouterr().err


def test_synthesize_detects_a_kokoro_checkpoint(tmp_path, capsys):
    """``--model DIR`` of a Kokoro checkpoint: its family from the files, its voice names as ``--speaker``, its
    rate in the file; a ChatTTS-only flag is an error that names the option and both families."""
    from chattts_serve.cli import main

    assert main(["checkpoint", "random", str(tmp_path / "k"), "--family", "kokoro"]) == 0
    out = tmp_path / "x.wav"
    args = ["synthesize", "你好，世界。", "-o", str(out), "--model", str(tmp_path / "k"), "--seed", "1"]
    assert main([*args, "--speaker", "zf_xiaobei"]) == 0
    with wave.open(str(out)) as w:
        assert w.getframerate() == 24000 and w.getnframes() > 0
    assert main([*args, "--temperature", "0.5"]) == 2
    assert "option 'temperature' belongs to the chattts family; this model is a kokoro model" in capsys.readouterr().err


def test_synthesize_takes_vitss_noise_scales(tmp_path, capsys):
    """``--noise-scale`` and ``--noise-scale-duration`` reach the model: with both 0, VITS samples nothing, so
    two seeds speak the same; with the checkpoint's noise they do not. Another family's model refuses them."""
    from chattts_serve.cli import main
    from chattts_serve.models.vits.random_checkpoint import write_random

    root = write_random(tmp_path / "v", "tiny", seed=0)

    def speak(seed: int, *flags: str) -> bytes:
        out = tmp_path / f"{seed}{''.join(flags)}.wav"
        args = ["synthesize", "hello world", "-o", str(out), "--model", str(root), "--seed", str(seed), *flags]
        assert main(args) == 0
        with wave.open(str(out)) as w:
            return w.readframes(w.getnframes())

    quiet = ("--noise-scale", "0", "--noise-scale-duration", "0")
    assert speak(1, *quiet) == speak(2, *quiet)
    assert speak(1) != speak(2)
    assert main(["checkpoint", "random", str(tmp_path / "k"), "--family", "kokoro"]) == 0
    capsys.readouterr()
    args = ["synthesize", "你好。", "-o", str(tmp_path / "k.wav"), "--model", str(tmp_path / "k"), "--noise-scale", "0"]
    assert main(args) == 2
    assert "option 'noise_scale' belongs to the vits family; this model is a kokoro model" in capsys.readouterr().err
