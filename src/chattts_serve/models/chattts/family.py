"""ChatTTS as a model family: its checkpoint (``models.chattts.checkpoint``), its random checkpoint, its voices
(speaker strings), its options (``SamplingParams``' ChatTTS fields) and its stage (``stage.ChatTTSStage``).

``SamplingParams`` stays the one options object of ChatTTS users (every field, flag and HTTP option as before),
so ChatTTS's options object is ``SamplingParams`` itself; what the family owns is the list of its fields that
only ChatTTS reads (``OWNED_OPTIONS``), which another family refuses by name.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from ...sampling_params import SamplingParams
from ..family import Capabilities, FamilyModel, ModelFamily, OptionSpec, Size
from .config import DEFAULT_MODEL, SAMPLE_RATE

if TYPE_CHECKING:
    import torch

    from .voices import ChatTTSVoices

# torch, the checkpoint reader and the modules are imported where a model is loaded: the registry, the CLI
# and the server's config describe families without them.

logger = logging.getLogger(__name__)

OWNED_OPTIONS = frozenset(
    {
        *("temperature", "top_p", "top_k", "repetition_penalty", "min_new_tokens", "max_new_tokens", "prompt"),
        *("refine_text", "refine_prompt", "refine_temperature", "refine_top_p", "refine_top_k"),
        *("refine_repetition_penalty", "refine_min_new_tokens", "refine_max_new_tokens", "refine_seed"),
        *("do_homophone_replacement", "first_sentence_voice", "ensure_non_empty"),
        *("speaker_sample", "speaker_sample_text"),
    }
)
"""The flat options (``SamplingParams.from_options``' names) only ChatTTS reads: its sampler's, the refine
pass's, its prompt ([speed_N], control tokens), its voice step and its zero-shot voice sample (DVAE codes).
The rest of ``SamplingParams`` is common to every family: seed, speaker (the voice string), lang,
text_cleanup, lexicon, split_text, do_text_normalization, max_text_chars, options."""


class ChatTTSFamily(ModelFamily):
    name = "chattts"
    execution = "slots"
    capabilities = Capabilities(streaming="window", timestamps="sentence", refine=True, control_tokens=True)
    hub_repos: ClassVar[tuple[str, ...]] = (DEFAULT_MODEL,)
    owned_options = OWNED_OPTIONS
    title = "ChatTTS"
    attribution = ("2noise", "https://github.com/2noise/ChatTTS")
    sample_text = "今天天气真不错，我们一起去公园散步吧。"

    def request_options(self) -> tuple[OptionSpec, ...]:
        d = SamplingParams()
        return (
            OptionSpec("temperature", "number", "Temperature", d.temperature, 0.01, 5.0, 0.05),
            OptionSpec("top_p", "number", "Top-p", d.top_p, 0.01, 1.0, 0.05),
            OptionSpec("top_k", "integer", "Top-k", d.top_k, 0, 1000, 1),
            OptionSpec("refine_text", "boolean", "refine text first", d.refine_text),
            OptionSpec("refine_prompt", "text", "Control tokens (refine pass)", help="[oral_2][laugh_0][break_6]"),
        )

    def is_checkpoint(self, root: Path) -> bool:
        # Any asset/ directory: an incomplete one is still ChatTTS's, and ``resolve`` names what it lacks.
        return (root / "asset").is_dir()

    def resolve(self, path_or_repo: str | Path) -> Path:
        from . import checkpoint

        return checkpoint.resolve(path_or_repo)

    def write_random(self, directory: str | Path, size: Size = "tiny", seed: int = 0) -> Path:
        from .random_checkpoint import write_random

        return write_random(directory, size, seed=seed)

    def load(self, root: Path, device: torch.device, config) -> ChatTTSModel:
        """Every precision starts from the fp32 weights (int8 scales are taken from them, not from bf16);
        ``config.auto_slots`` sizes the KV slots from free memory; ``int8-static`` calibrates first."""
        import torch

        from ...engine.calibrate import calibrate
        from ...engine.onednn import bound_kernel_caches
        from ...engine.plan import resolve_plan
        from ...engine.runner import AUTO_SLOTS_FRACTION, auto_num_slots, fitted_model_len, free_bytes
        from ...engine.slot_memory import check_slots_fit, slot_cost
        from ...kernels.quant import check_supported, parse_precision
        from . import checkpoint
        from .prepare import prepare_model
        from .tokenizer import Tokenizer

        bound_kernel_caches()  # before any weights are packed: oneDNN reads it once (see engine.onednn)
        spec = parse_precision(config.precision)
        check_supported(spec, device)
        plan = resolve_plan(config, device.type)  # every "auto" settled here, once
        model = checkpoint.load(root, device=device, dtype=torch.float32)
        kv_dtype = plan.kv_cache_dtype
        sc = config.scheduler
        if config.auto_slots:  # as many KV slots as half the free memory holds
            n = auto_num_slots(model, sc.max_model_len, device, kv_dtype)
            logger.info("KV cache: %d slots sized from free memory", n)
            config = replace(config, scheduler=replace(sc, max_num_seqs=n), auto_slots=False)
        else:  # fixed slots: as long as memory allows (a slot's prompt grows with the voice sample)
            n = fitted_model_len(model, sc.max_num_seqs, sc.max_model_len, device, kv_dtype)
            if device.type == "cuda":  # refused here, with the real per-slot bytes, not out of memory later
                check_slots_fit(
                    sc.max_num_seqs,
                    slot_cost(model.config.gpt, n, kv_dtype, graphs=True),
                    int(free_bytes(device) * AUTO_SLOTS_FRACTION["cuda"]),
                    n,
                )
            if n < sc.max_model_len:
                logger.warning(
                    "KV cache: max_model_len lowered from %d to %d so %d slots fit in free memory "
                    "(set --max-model-len or fewer --max-num-seqs)",
                    sc.max_model_len,
                    n,
                    sc.max_num_seqs,
                )
                config = replace(config, scheduler=replace(sc, max_model_len=n))
        # Chunked prefill: where the plan's decode path takes chunks and more than one slot is (``engine.scheduler``).
        chunk = plan.chunked_prefill(config.scheduler.max_num_seqs)
        config = replace(config, scheduler=replace(config.scheduler, prefill_chunk=chunk))
        tokenizer = Tokenizer(model.root / checkpoint.TOKENIZER_DIR)
        stats = _speaker_stats(model)
        layout = prepare_model(
            model,
            spec,
            config.scheduler.max_num_seqs,
            compile=config.runner.compile,
            calibrate=lambda m: calibrate(m, tokenizer, stats),
            onnx_cache_dir=config.runner.onnx_cache_dir,
            ort_auto_crossover=config.runner.ort_auto_crossover,
        )
        logger.info("%s", plan.describe())
        return ChatTTSModel(self, model, tokenizer, stats, config, layout, plan)


class ChatTTSModel(FamilyModel):
    """A loaded ChatTTS checkpoint: the modules (``model``), tokenizer, speaker statistics, the layout
    ``prepare_model`` left for the engine config and the execution plan (``engine.plan``) it runs by."""

    def __init__(self, family: ChatTTSFamily, model, tokenizer, speaker_stats, config, layout, plan) -> None:
        self.family = family
        self.model = model
        self.root = Path(model.root)
        self.tokenizer = tokenizer
        self.speaker_stats = speaker_stats
        self.config = config
        self.layout = layout
        self.plan = plan
        from .voices import ChatTTSVoices

        self._voices = ChatTTSVoices(speaker_stats, model.config.gpt.hidden_size)

    @property
    def sample_rate(self) -> int:
        return SAMPLE_RATE

    @property
    def voices(self) -> ChatTTSVoices:
        return self._voices

    def identity(self) -> list[str]:
        from . import checkpoint

        files = []
        for rel in (*checkpoint.REQUIRED_FILES, checkpoint.SPK_STAT):
            path = self.root / rel
            if path.exists():
                st = path.stat()
                files.append(f"{rel}:{st.st_size}:{st.st_mtime_ns}")
        return [str(self.root.resolve()), *files]

    def check_options(self, params: SamplingParams) -> SamplingParams:
        """``params`` itself (validated by ``SamplingParams`` and the input processor); ChatTTS has no options
        beyond its fields, so ``params.options`` must be None."""
        from .stage import check_no_options

        check_no_options(params)
        return params

    def stage(self, config):
        from .stage import ChatTTSStage

        return ChatTTSStage(self.model, self.tokenizer, config, self.layout, self.plan)


def _speaker_stats(model):
    from . import checkpoint

    stats = checkpoint.read_speaker_stats(model.root, model.config.gpt.hidden_size)
    if stats is None:
        logger.warning(
            "no speaker statistics for hidden size %d; random speakers unavailable", model.config.gpt.hidden_size
        )
    return stats
