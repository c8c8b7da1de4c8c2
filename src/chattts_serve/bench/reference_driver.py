"""The reference ``chattts`` 0.2.5 side of the benchmarks. Runs in the reference environment ONLY
(``bash ../shared/oracle/setup_venv.sh DIR``), so it imports nothing from chattts_serve:

    DIR/bin/python src/chattts_serve/bench/reference_driver.py offline CKPT --texts-file F --steps 469
    DIR/bin/python src/chattts_serve/bench/reference_driver.py stream CKPT --steps 469

``offline``: the texts as ONE batched ``Chat.infer`` (the reference's only form of concurrency;
split_text=False, refine skipped, min = max new tokens). ``stream``: ``stream=True`` on the first
text, timing its first audio chunk. Prints one JSON line. ``load_reference`` is also used by
``scripts/reference_oracle.py`` (fidelity).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import ChatTTS  # reference env only
import torch


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_reference(ckpt: Path) -> ChatTTS.Chat:
    from safetensors import safe_open

    chat = ChatTTS.Chat()
    cfg = json.loads((ckpt / "asset/gpt/config.json").read_text())
    hidden = cfg["hidden_size"]
    # Only the GPT trunk sizes itself from config.json; the other modules take Config defaults, so set
    # them from the checkpoint's tensor shapes (official values for a full-size checkpoint).
    c = chat.config
    c.gpt.hidden_size = hidden
    c.gpt.intermediate_size = cfg["intermediate_size"]
    c.gpt.num_attention_heads = cfg["num_attention_heads"]
    c.gpt.num_hidden_layers = cfg["num_hidden_layers"]
    c.embed.hidden_size = hidden

    def shapes(rel):
        with safe_open(str(ckpt / rel), "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}

    def stack(sh, prefix, target):
        target.bn_dim, target.idim = sh[f"{prefix}.conv_in.0.weight"][:2]
        target.hidden = sh[f"{prefix}.conv_in.2.weight"][0]
        target.odim = sh[f"{prefix}.conv_out.weight"][0]
        target.n_layer = len({k.split(".")[2] for k in sh if k.startswith(f"{prefix}.decoder_block.")})

    dec = shapes("asset/Decoder.safetensors")
    stack(dec, "decoder", c.decoder)
    dv = shapes("asset/DVAE.safetensors")
    stack(dv, "decoder", c.dvae.decoder)
    stack(dv, "encoder", c.dvae.encoder)
    c.dvae.vq.dim = 2 * dv["vq_layer.quantizer.rvqs.0.project_in.weight"][1]
    vo = shapes("asset/Vocos.safetensors")
    c.vocos.backbone.init_args.dim = vo["backbone.embed.weight"][0]
    c.vocos.backbone.init_args.intermediate_dim = vo["backbone.convnext.0.pwconv1.weight"][0]
    c.vocos.backbone.init_args.num_layers = len({k.split(".")[2] for k in vo if k.startswith("backbone.convnext.")})
    c.vocos.head.init_args.dim = vo["backbone.embed.weight"][0]
    spk = ckpt / "asset/spk_stat.txt"
    if spk.is_file():
        c.spk_stat = spk.read_text().strip()
    # The reference checks every file against its sha256 map: register our files' hashes.
    for key in list(chat.sha256_map):
        rel = key[len("sha256_") :]
        for cand in ckpt.rglob("*"):
            if cand.is_file() and str(cand.relative_to(ckpt)).replace("/", "_").replace(".", "_") == rel:
                chat.sha256_map[key] = _sha256(cand)
    if not chat.load(source="custom", custom_path=str(ckpt), device=torch.device("cpu")):
        raise SystemExit("reference failed to load the checkpoint")
    return chat


def _params(chat, steps: int, seed: int = 1):
    return chat.InferCodeParams(manual_seed=seed, min_new_token=steps, max_new_token=steps, show_tqdm=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("offline", "stream"))
    ap.add_argument("ckpt")
    ap.add_argument("--texts-file", required=True, help="UTF-8, one text per line")
    ap.add_argument("--steps", type=int, default=469)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    texts = [t for t in Path(args.texts_file).read_text(encoding="utf-8").splitlines() if t.strip()]
    chat = load_reference(Path(args.ckpt))
    chat.infer(texts[0], skip_refine_text=True, params_infer_code=_params(chat, 8), split_text=False)  # warm-up
    out: dict = {"impl": "reference chattts 0.2.5", "mode": args.mode, "steps": args.steps, "n": len(texts)}
    t0 = time.perf_counter()
    if args.mode == "offline":
        wavs = chat.infer(texts, skip_refine_text=True, params_infer_code=_params(chat, args.steps), split_text=False)
        out["wall_s"] = time.perf_counter() - t0
        out["audio_s"] = sum(len(w) for w in wavs) / 24000
    else:
        first = None
        for _ in chat.infer(
            texts[0], stream=True, skip_refine_text=True, params_infer_code=_params(chat, args.steps), split_text=False
        ):
            if first is None:
                first = time.perf_counter() - t0
        out["first_chunk_s"] = first
        out["wall_s"] = time.perf_counter() - t0
    print(json.dumps(out))


if __name__ == "__main__":
    main()
