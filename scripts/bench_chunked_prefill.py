"""A stream's longest wait between two tokens while a burst of long prompts arrives (chunked prefill, issue 33
item 3). Per round and mode: one stream decodes; then ``--prompts`` requests of ``--chars`` characters each (one
sentence: ``split_text`` off) arrive at once. Reported per mode (medians over ``--rounds``, the modes alternating
in one process so a shared box's load drifts over both alike): the stream's step before the burst, its longest
gap between two tokens while the burst's prompts go in, the most prompt tokens one step prefilled, the steps that
took, and the burst's time to first token.

Modes: "whole" (``SchedulerConfig.prefill_chunk`` 0: the rule before chunked prefill, every step's first prompt
whole) and "chunked" (the engine's own). Engine's public surface only (``Engine.core``), so another tree's code
runs it too (``PYTHONPATH=/other/src``, ``--modes whole``).

    python scripts/bench_chunked_prefill.py --model CKPT [--prompts 8] [--chars 300] [--modes whole,chunked]
        [--rounds 3] [--max-prefill-tokens 256] [--slots 10] [--max-model-len 1024] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import fields, replace

import torch

from chattts_serve import Engine, SamplingParams
from chattts_serve.engine.config import EngineConfig
from chattts_serve.engine.scheduler import SchedulerConfig

TEXT = "今天天气很好我们一起去公园散步然后在湖边坐一会儿看看风景再去吃一顿很好吃的晚饭最后慢慢走回家"


def _prefill_tokens(out) -> int:
    """Prompt positions a ``SchedulerOutput`` prefills (written for trees with and without chunked prefill)."""
    starts = getattr(out, "prefill_from", {})
    whole = sum(s.prompt_len - starts.get(s.seq_id, 0) for s in out.prefill)
    return whole + sum(c.end - c.start for c in getattr(out, "partial", []))


def burst(engine, prompts: int, chars: int, tag: str) -> dict:
    core = engine.core
    stream_params = SamplingParams(seed=3, min_new_tokens=600, max_new_tokens=600, refine_text=False)
    core.add_request(f"stream{tag}", core.prepare("你好，今天怎么样。", stream_params))

    def stream_seq():
        return next((s for s in core.scheduler.running if s.request_id == f"stream{tag}"), None)

    while stream_seq() is None or len(stream_seq().tokens) < 3:
        core.step()
    stream = stream_seq()
    ticks = [(time.perf_counter(), len(stream.tokens), 0)]  # (time, the stream's tokens, prompt tokens prefilled)
    schedule = core.scheduler.schedule

    def step() -> None:
        outs = []
        core.scheduler.schedule = lambda *a, **k: outs.append(schedule(*a, **k)) or outs[-1]
        try:
            core.step()
        finally:
            core.scheduler.schedule = schedule
        prefilled = sum(map(_prefill_tokens, outs))
        ticks.append((time.perf_counter(), len(stream.tokens), prefilled))

    for _ in range(10):
        step()
    steady = [b[0] - a[0] for a, b in zip(ticks, ticks[1:], strict=False)]
    params = SamplingParams(seed=5, min_new_tokens=2, max_new_tokens=2, refine_text=False, split_text=False)
    text = (TEXT * (chars // len(TEXT) + 1))[:chars] + "。"
    t0 = time.perf_counter()
    first: dict[str, float] = {}
    lens: set[int] = set()
    for i in range(prompts):
        core.add_request(f"burst{tag}-{i}", core.prepare(text, params))
    start = len(ticks) - 1
    while len(first) < prompts:
        step()
        for s in core.scheduler.running:
            if s.request_id.startswith(f"burst{tag}-") and s.tokens and s.request_id not in first:
                first[s.request_id] = time.perf_counter() - t0
                lens.add(s.prompt_len)
    window = ticks[start:]
    gaps, (last_t, last_n, _) = [], window[0]  # between two of the stream's tokens
    for t, n, _ in window[1:]:
        if n > last_n:
            gaps.append(t - last_t)
            last_t, last_n = t, n
    core.abort(f"stream{tag}")
    while core.has_unfinished():
        core.step()
    return {
        "prompt_tokens": sorted(lens),
        "step_ms_before": statistics.median(steady) * 1e3,
        "longest_gap_ms": max(gaps) * 1e3,
        "most_prefill_per_step": max(p for _, _, p in window),
        "steps": len(window) - 1,
        "first_token_p50_s": statistics.median(first.values()),
        "first_token_max_s": max(first.values()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--chars", type=int, default=300, help="characters of each burst prompt (one sentence)")
    p.add_argument("--modes", default="whole,chunked")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-prefill-tokens", type=int, default=256)
    p.add_argument("--slots", type=int, default=10)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    sc = SchedulerConfig(
        max_num_seqs=args.slots, max_model_len=args.max_model_len, max_prefill_tokens=args.max_prefill_tokens
    )
    engine = Engine.from_pretrained(args.model, config=EngineConfig(scheduler=sc))
    engine.synthesize("你好。", SamplingParams(seed=1, max_new_tokens=4, refine_text=False))  # warm-up
    own = engine.core.scheduler.config
    chunk = {f.name for f in fields(own)} >= {"prefill_chunk"}
    results: dict[str, list[dict]] = {m: [] for m in args.modes.split(",")}
    for r in range(args.rounds):
        for mode in results:
            if mode == "chunked" and not (chunk and own.prefill_chunk):
                raise SystemExit("this engine has no chunked prefill (run --modes whole)")
            engine.core.scheduler.config = replace(own, prefill_chunk=0) if mode == "whole" and chunk else own
            results[mode].append(burst(engine, args.prompts, args.chars, f"{mode}{r}"))
    gpt = engine.model.config.gpt
    out = {
        "model": f"hidden {gpt.hidden_size}, {gpt.num_layers} layers",
        "threads": args.threads,
        "prompts": args.prompts,
        "max_prefill_tokens": args.max_prefill_tokens,
        "rounds": args.rounds,
    }
    for mode, runs in results.items():
        out[mode] = {
            k: runs[0][k] if k == "prompt_tokens" else round(statistics.median(r[k] for r in runs), 2) for k in runs[0]
        }
        out[mode]["longest_gap_ms_each_round"] = [round(r["longest_gap_ms"], 1) for r in runs]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
