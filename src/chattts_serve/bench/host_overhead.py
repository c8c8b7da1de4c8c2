"""``chattts-serve bench host-overhead`` (also ``python -m chattts_serve.bench.host_overhead``): the host's
cost of one engine decode step per sequence, at 64 / 256 / 512 concurrent sequences, on the tiny random
checkpoint (written to a temporary directory unless ``--model`` names one).

Method. The runner holds N synthetic sequences (mostly code, one in 8 text; seeded and unseeded; each
with its own sampling parameters) in N slots, prefills them, then times ``--steps`` decode steps
(median), in this thread's CPU time. The trunk (the transformer step: the device's work, the same
whatever the host does) is replaced by a stub returning a fixed hidden state. On the CPU the rest of
the step still computes (heads, sort, noise: milliseconds that a GPU does in microseconds), so the
host's share is separated op by op: a ``TorchDispatchMode`` times every aten op the step dispatches, and

    host = (wall - time inside ops - ops x the timer's own cost per op) + ops x launch

that is the step's Python time (lists, dicts, loops, tensors built from lists) plus one launch's host
cost per op dispatched (``launch``: a one-element in-place add timed alone, about what the host pays to
issue one CUDA kernel). Both per-op constants are measured at start. ``host_us_per_seq`` = host / N:
what the host spends per sequence-step; on a GPU the step is host-bound whenever host exceeds the
device time. Issue 20's target: flat in N and <= 15 us per sequence-step at 512. The runner runs its
device path (``sync_free``) with counter noise, the CUDA defaults. An upper bound on the CPU: frees
of large intermediate tensors happen between ops (a CUDA caching allocator makes them free), and the
timer's cost per op is calibrated on a trivial op. ``ops_per_step`` is exact.

Two paths of the same runner: ``eager`` (the trunk stubbed, everything after it run op by op: what a
CUDA step costs with only the trunk captured, ``--step-graphs off``) and ``step-graph`` (the whole
code step, ``engine.step_graph``, stubbed as one replay that returns fixed tokens and hidden states:
what remains on the host when the step is one graph, the CUDA default). The sequences are code only
(the steady audio phase); ``--mix mixed`` makes one in 8 a text sequence (the refine pass: a second
kind's heads and sampling, in the eager step ~130 more launches, in the graph one gather more).

Allocator (``--allocator``): ``caching`` (default) tells glibc's malloc to keep freed blocks (no
``munmap`` of each large temporary, no trim of the heap top), as CUDA's caching allocator does on a
GPU; ``system`` leaves glibc's defaults, where freeing the sampler's megabyte temporaries costs page
unmapping and faults that land between ops and would count as host time. Per-size results also give
the fit ``host = fixed + marginal x N`` over the sizes (``fit``): flat per sequence means the marginal
cost holds at every size; the fixed part is the step's launches and Python, paid once per step.

``--scope core`` times the whole ``EngineCore.step`` instead of the runner's: N streamed requests
(default stream policy, no refine pass, one sentence each) are admitted, then steady steps are timed
with the same method: scheduling, the runner, the hidden-state store, the audio streams' windows, the
outputs. The audio decode (Decoder + Vocos over the windows due: device work on a GPU, on its own
stream) is timed apart, outside the op timer, and reported as ``audio_ms`` per step: on a CPU it is
compute, whose frees of large temporaries would otherwise land in the host figure. The paths are the
same two (trunk stubbed; step graph stubbed). Medians and means are both reported: windows of streams
admitted together fall due on the same steps.

``--before FILE``: also time an older ``runner.py`` (``git show main:src/chattts_serve/engine/runner.py
> /tmp/runner_main.py``) loaded side by side inside this package, with the same stub (its sampler calls
take the device path too), the two runners' steps interleaved (``measure``). The file must speak this
package's runner surface: ``ModelRunner(model, layout, slots, max_len, eos, plan)``, ``sync_free`` and
``use_decode_path`` with the paths of ``engine.decode_path``. On a shared CPU the figures
are noisy: compare ratios from one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

SIZES = (64, 256, 512)
_clock = time.thread_time
"""CPU time of this thread: time the shared machine spends elsewhere does not count (the step and the
ops all run on this thread with one torch thread)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: a tiny random one)")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma-separated concurrent sequences")
    p.add_argument("--steps", type=int, default=10, help="decode steps timed per size (median)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--before", default=None, help="an older runner.py to time side by side")
    p.add_argument("--paths", default="eager,step-graph", help="comma-separated: eager, step-graph")
    p.add_argument("--scope", choices=("runner", "core"), default="runner", help="runner.execute or EngineCore.step")
    p.add_argument("--mix", choices=("code", "mixed"), default="code", help="code only, or one in 8 text")
    p.add_argument(
        "--allocator",
        choices=("caching", "system"),
        default="caching",
        help="caching: glibc keeps freed blocks, as CUDA's allocator does; system: glibc's defaults",
    )


class _TimedOps(TorchDispatchMode):
    """Time spent inside each dispatched aten op, and how many ran."""

    def __init__(self) -> None:
        super().__init__()
        self.ops, self.inside = 0, 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = _clock()
        out = func(*args, **(kwargs or {}))
        self.inside += _clock() - t0
        self.ops += 1
        return out


def per_op_costs(n: int = 4000) -> tuple[float, float]:
    """(one trivial op's host cost, ``_TimedOps``'s own cost per op), seconds, medians of 5 rounds."""
    import torch

    x = torch.zeros(1)
    plain, timed = [], []
    for _ in range(5):
        t0 = _clock()
        for _ in range(n):
            x.add_(1)
        plain.append((_clock() - t0) / n)
        timer = _TimedOps()
        t0 = _clock()
        with timer:
            for _ in range(n):
                x.add_(1)
        timed.append((_clock() - t0 - timer.inside) / n)
    return statistics.median(plain), statistics.median(timed)


def caching_malloc() -> bool:
    """glibc's malloc keeps what is freed: large blocks come from the heap (mmap threshold at its
    32 MiB maximum, which also stops it adapting) and the heap top is never trimmed. False where the
    C library is not glibc (nothing changed)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 (glibc only)
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    ok = libc.mallopt(m_mmap_threshold, 32 << 20) == 1
    return ok and libc.mallopt(m_trim_threshold, (1 << 31) - 1) == 1


def fit(sizes: list[int], host_us: list[float]) -> dict[str, float]:
    """Least squares ``host = fixed + marginal x N``: fixed in ms per step, marginal in us per sequence."""
    if len(sizes) < 2:
        return {}
    mean_n, mean_h = statistics.fmean(sizes), statistics.fmean(host_us)
    var = sum((n - mean_n) ** 2 for n in sizes)
    marginal = sum((n - mean_n) * (h - mean_h) for n, h in zip(sizes, host_us, strict=True)) / var
    return {"fixed_ms": round((mean_h - marginal * mean_n) / 1e3, 3), "marginal_us_per_seq": round(marginal, 2)}


def _stub_paths():
    """The two decode paths with the device's work stubbed, as subclasses of the real ones that replace
    only their device step: ``StaticDecode.trunk`` (a fixed hidden state per row, no compute) and
    ``StepGraph.step_fn`` (one graph replay: fixed tokens and hidden states per bucket)."""
    import torch

    from ..engine.decode_static import StaticDecode
    from ..engine.step_graph import StepGraph

    class StubTrunk(StaticDecode):
        def __init__(self, parts, hidden) -> None:
            super().__init__(parts)
            self.hidden = hidden

        def trunk(self, emb, step):
            return self.hidden[: emb.shape[0]]

    class StubStep(StepGraph):
        def __init__(self, parts, hidden) -> None:
            super().__init__(parts)
            self.hidden = hidden
            self.tokens = torch.zeros(parts.cache.num_slots * self.num_vq, dtype=torch.int64)

        def step_fn(self, bs: int, ctx: int, text: bool = False):
            code = self.tokens[: bs * self.num_vq]
            return (code, self.hidden[:bs], self.tokens[:bs]) if text else (code, self.hidden[:bs])

    return {"static": StubTrunk, "step-graph": StubStep}


def _stub_device_work(runner, n: int, hidden_size: int) -> None:
    """The runner's device path with the device's work stubbed (``_stub_paths``), through the runner's
    public ``use_decode_path``; the sampler takes its device branches (``sync_free``)."""
    import torch

    runner.sync_free = True
    hidden = torch.randn(n, hidden_size)
    stub = _stub_paths()[runner.plan.decode]
    runner.use_decode_path(lambda parts: stub(parts, hidden))


def _timed(step, costs, apart=lambda: 0.0) -> tuple[tuple[float, float, int, float], Any]:
    """Run ``step()`` once under the op timer: (wall, python, ops, host) in seconds (module
    docstring), less the seconds ``apart()`` says were spent on work timed apart; and what it returned."""
    launch, timer_cost = costs
    timer = _TimedOps()
    t0 = _clock()
    with timer:
        result = step()
    wall = _clock() - t0 - apart()
    python = max(wall - timer.inside - timer.ops * timer_cost, 0.0)
    return (wall, python, timer.ops, python + timer.ops * launch), result


def _summary(rows: list[tuple], n: int) -> dict[str, Any]:
    """Medians of ``_timed`` rows at ``n`` sequences."""
    wall, python, ops, host = (statistics.median(col) for col in list(zip(*rows, strict=True))[:4])
    return {
        "step_ms": round(wall * 1e3, 3),
        "ops_per_step": int(ops),
        "python_us_per_seq": round(python * 1e6 / n, 2),
        "host_us_per_seq": round(host * 1e6 / n, 2),
    }


def _sequences(runner, n: int, seed: int, mix: str = "mixed") -> list:
    from ..engine.request import Sequence
    from ..engine.runner import SeqInputs, StepSampling
    from ..models.chattts.config import AUDIO_EOS

    rng = random.Random(seed)
    seqs = []
    for i in range(n):
        kind = "text" if mix == "mixed" and i % 8 == 7 else "code"
        sampling = StepSampling(
            (rng.uniform(0.2, 1.0),), rng.uniform(0.5, 1.0), rng.choice([0, 20]), 1.05, rng.choice([None, i])
        )
        ids = [rng.randrange(1000) for _ in range(8)]
        eos = AUDIO_EOS if kind == "code" else runner.text_eos_id
        seq = Sequence(f"r{i}", kind, len(ids), 0, 10_000, eos, sampling.seed is not None, False)
        seq.payload, seq.slot = SeqInputs(ids, sampling), i
        seqs.append(seq)
    return seqs


def _load_runner_class(path: str | None):
    """This package's ``ModelRunner``, or the one in ``path`` loaded as a sibling module of it."""
    from ..engine import runner as current

    if path is None:
        return current.ModelRunner
    spec = importlib.util.spec_from_file_location("chattts_serve.engine._runner_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.ModelRunner


def measure(
    model: Any, layout: Any, eos_id: int, runner_classes: dict, n: int, steps: int, costs, mix: str = "mixed"
) -> dict:
    """Each runner at ``n`` sequences: medians over ``steps`` decode steps (see the module docstring).
    The runners' steps interleave, first one then the other and the order swapped every step, so
    the state of the process (the heap after the other runner's frees, caches, the machine's load)
    weighs on both alike."""
    from ..engine.config import EngineConfig, RunnerConfig
    from ..engine.outputs import SchedulerOutput
    from ..engine.plan import resolve_plan

    state = {}
    for name, (cls, step_graphs) in runner_classes.items():
        config = RunnerConfig(decode="static", sampling_noise="counter", cuda_graphs=False, step_graphs=step_graphs)
        runner = cls(model, layout, n, 256, eos_id, resolve_plan(EngineConfig(runner=config), "cpu"))
        _stub_device_work(runner, n, model.gpt.norm.weight.shape[0])
        seqs = _sequences(runner, n, seed=n, mix=mix)
        state[name] = (runner, seqs, runner.execute(SchedulerOutput(prefill=seqs)), [])
    names = list(state)
    for i in range(steps + 1):  # the first: warm-up (and the step that builds the index tensors)
        for name in names if i % 2 else names[::-1]:
            runner, seqs, out, rows = state[name]
            for s in seqs:
                s.tokens.append(out.tokens[s.seq_id])
            row, out = _timed(lambda r=runner, q=seqs: r.execute(SchedulerOutput(decode=q)), costs)
            state[name] = (runner, seqs, out, rows)
            if i:
                rows.append(row)
    return {name: _summary(state[name][3], n) for name in names}


def measure_core(path: Any, path_name: str, n: int, steps: int, costs) -> dict:
    """``EngineCore.step`` at ``n`` streams (see ``--scope core`` in the module docstring)."""
    from ..audio.policy import StreamPolicy
    from ..engine.config import EngineConfig, RunnerConfig
    from ..engine.engine import Engine
    from ..engine.scheduler import SchedulerConfig
    from ..sampling_params import SamplingParams

    tokens = 64 + 2 * steps  # every stream decodes through admission and the timed steps
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=n, max_model_len=tokens + 64),
        runner=RunnerConfig(
            decode="static",
            sampling_noise="counter",
            cuda_graphs=False,
            step_graphs="on" if path_name == "step-graph" else "off",
        ),
    )
    engine = Engine.from_pretrained(path, "cpu", config)
    core = engine.core
    _stub_device_work(engine.runner, n, engine.hidden_size)
    for i in range(n):
        params = SamplingParams(
            seed=i if i % 2 else None,
            temperature=0.3 + 0.5 * (i % 7) / 7,
            min_new_tokens=tokens,
            max_new_tokens=tokens,
            refine_text=False,
            split_text=False,
            first_sentence_voice=False,
        )
        core.add_request(f"r{i}", core.prepare("今天天气真不错，我们一起去公园散步吧。", params), StreamPolicy())
    while core.scheduler.num_running < n or core.scheduler.num_waiting:  # admissions (prefill runs for real)
        core.step()
    audio = [0.0]

    def untimed(fn):  # the audio decode: outside the op timer, its time kept apart
        def call(*a, **k):
            t0 = _clock()
            try:
                with _disable_current_modes():
                    return fn(*a, **k)
            finally:
                audio[0] += _clock() - t0

        return call

    core.stage.decoder.submit, core.stage.decoder.collect = (
        untimed(core.stage.decoder.submit),
        untimed(core.stage.decoder.collect),
    )
    rows = []
    for _ in range(steps):
        audio[0] = 0.0
        row, _ = _timed(core.step, costs, apart=lambda: audio[0])
        rows.append((*row, audio[0]))
    assert core.scheduler.num_running == n, "a stream finished inside the timed steps"
    return {
        **_summary(rows, n),
        "host_us_per_seq_mean": round(statistics.fmean(r[3] for r in rows) * 1e6 / n, 2),
        "audio_ms": round(statistics.fmean(r[4] for r in rows) * 1e3, 3),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from ..kernels.quant import parse_precision
    from ..models.chattts import checkpoint
    from ..models.chattts.prepare import prepare_model
    from ..models.chattts.random_checkpoint import write_random
    from ..models.chattts.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    caching = caching_malloc() if args.allocator == "caching" else False
    path = args.model or write_random(Path(tempfile.mkdtemp()) / "tiny", "tiny", seed=0)
    sizes = [int(s) for s in str(args.sizes).split(",")]
    paths = [p.strip() for p in str(args.paths).split(",") if p.strip()]
    unknown = set(paths) - {"eager", "step-graph"}
    if unknown:
        raise SystemExit(f"--paths: unknown {', '.join(sorted(unknown))} (eager, step-graph)")
    current = _load_runner_class(None)
    runners = {name: (current, "on" if name == "step-graph" else "off") for name in paths}
    if args.before:
        runners["before"] = (_load_runner_class(args.before), "off")
    costs = per_op_costs()
    out: dict[str, Any] = {
        "method": "host = python time + ops x launch, stub trunk / stub step graph, medians (module docstring)",
        "allocator": "caching (glibc mallopt)" if caching else "system",
        "mix": args.mix,
        "launch_us": round(costs[0] * 1e6, 2),
        "timer_cost_us": round(costs[1] * 1e6, 2),
        "scope": args.scope,
        "sizes": {},
    }
    if args.scope == "core" and args.before:
        raise SystemExit("--before times runners: --scope runner")
    for n in sizes:
        if args.scope == "core":
            out["sizes"][n] = {name: measure_core(path, name, n, args.steps, costs) for name in paths}
            continue
        # The model prepared for n slots (fp32), as the engine prepares it; shared by both runners.
        model = checkpoint.load(path, device="cpu", dtype=torch.float32)
        eos_id = Tokenizer(model.root / checkpoint.TOKENIZER_DIR).eos_id
        layout = prepare_model(model, parse_precision("fp32"), n)
        out["sizes"][n] = measure(model, layout, eos_id, runners, n, args.steps, costs, args.mix)
    out["fit"] = {name: fit(sizes, [out["sizes"][n][name]["host_us_per_seq"] * n for n in sizes]) for name in runners}
    return out


def main(args: argparse.Namespace) -> int:
    print(json.dumps(run(args)))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
