"""engine/config.py: the configuration tree, its flat option names, and the CLI flags built from it."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from chattts_serve.audio.policy import StreamPolicy
from chattts_serve.engine.config import (
    FLAT_OPTIONS,
    EngineConfig,
    RunnerConfig,
    add_engine_arguments,
    add_max_num_seqs_argument,
    engine_config_from_args,
    flat_defaults,
    from_flat,
)
from chattts_serve.engine.plan import resolve_plan
from chattts_serve.engine.scheduler import SchedulerConfig


def test_runner_config():
    def decode(device: str, **kw) -> str:
        return resolve_plan(EngineConfig(runner=RunnerConfig(step_graphs="off", **kw)), device).decode

    assert decode("cpu") == "rows"
    assert decode("cuda") == "static"
    assert decode("cpu", decode="static") == "static"
    with pytest.raises(ValueError, match="decode must be"):
        RunnerConfig(decode="graph")
    with pytest.raises(ValueError, match="ort_auto_crossover must be >= 0"):
        RunnerConfig(ort_auto_crossover=-1)


def test_engine_config_defaults_are_the_parts_defaults():
    c = EngineConfig()
    assert c.precision == "fp32" and not c.auto_slots
    assert c.scheduler == SchedulerConfig() and c.runner == RunnerConfig() and c.stream == StreamPolicy()
    assert EngineConfig.with_slots(3, precision="bf16") == EngineConfig(
        precision="bf16", scheduler=SchedulerConfig(max_num_seqs=3)
    )


@pytest.mark.parametrize("bad", ["int3", "FP32", ""])
def test_unknown_precision_is_refused(bad):
    with pytest.raises(ValueError, match="precision must be one of"):
        EngineConfig(precision=bad)


def test_flat_options_round_trip():
    c = from_flat(precision="int8-static", max_num_seqs=4, max_waiting=9, decode="static", cuda_graphs=False)
    assert c.precision == "int8-static" and c.runner == RunnerConfig(decode="static", cuda_graphs=False)
    assert c.scheduler == SchedulerConfig(max_num_seqs=4, max_waiting=9)
    flat = flat_defaults(c)
    assert set(flat) == set(FLAT_OPTIONS) and flat["max_num_seqs"] == 4 and flat["compile"] is False
    assert from_flat(**flat) == c
    assert from_flat(c, precision=None) == c  # None keeps the value
    with pytest.raises(ValueError, match="unknown engine option"):
        from_flat(max_batch_size=3)
    with pytest.raises(ValueError, match="max_num_seqs must be a positive int"):
        from_flat(max_num_seqs=0)


def test_cli_flags_default_to_the_dataclass_defaults():
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    assert engine_config_from_args(p.parse_args([])) == EngineConfig()
    args = p.parse_args(["--precision", "bf16", "--max-num-seqs", "2", "--no-cuda-graphs", "--decode", "static"])
    assert engine_config_from_args(args) == from_flat(
        precision="bf16", max_num_seqs=2, cuda_graphs=False, decode="static"
    )
    auto = engine_config_from_args(p.parse_args(["--precision", "ort-auto", "--ort-auto-crossover", "6"]))
    assert auto == from_flat(precision="ort-auto", ort_auto_crossover=6)
    assert auto.runner == RunnerConfig(ort_auto_crossover=6)
    with pytest.raises(SystemExit):
        p.parse_args(["--precision", "int3"])
    layered = argparse.ArgumentParser()
    add_engine_arguments(layered, none_defaults=True)
    assert all(v is None for v in vars(layered.parse_args([])).values())


def test_config_imports_no_torch():
    """The CLI builds its parser from these defaults before torch is imported."""
    code = "import sys, chattts_serve.engine.config, chattts_serve.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=os.environ)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_max_num_seqs_flag_and_its_deprecated_spelling(capsys):
    p = argparse.ArgumentParser(prog="tool")
    add_max_num_seqs_argument(p, default=16, auto=True)
    assert p.parse_args([]).max_num_seqs == 16
    assert p.parse_args(["--max-num-seqs", "auto"]).max_num_seqs is None
    assert capsys.readouterr().err == ""
    assert p.parse_args(["--batch-size", "3"]).max_num_seqs == 3
    assert capsys.readouterr().err == "tool: warning: --batch-size is deprecated; use --max-num-seqs\n"
    with pytest.raises(SystemExit):
        p.parse_args(["--max-num-seqs", "0"])
    fixed = argparse.ArgumentParser()
    add_max_num_seqs_argument(fixed, default=None)
    assert fixed.parse_args([]).max_num_seqs is None
    with pytest.raises(SystemExit):
        fixed.parse_args(["--batch-size", "auto"])
