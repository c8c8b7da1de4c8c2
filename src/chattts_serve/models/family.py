"""The model-family seam: what the engine, the server and the CLI ask of a model, whatever the model.

A *family* is one kind of checkpoint (ChatTTS, Kokoro, ...). Two objects carry it:

``ModelFamily``   what is known before a weight is read: its name, how it runs (``execution``), what it can
                  do (``Capabilities``), the request options it owns, and how to find (``is_checkpoint``,
                  ``hub_repos``), fetch (``resolve``), forge (``write_random``) and load (``load``) a checkpoint.
``FamilyModel``   one loaded checkpoint: its sample rate, its voices (``Voices``), its identity (for result
                  caches), its options check, and the ``Stage`` the engine runs it through.

The engine knows two execution shapes, and a family picks one:

"slots"  autoregressive, one step per token, each running sequence holding a KV-cache slot for its life
         (ChatTTS). The family's ``Stage`` is its own (``models.chattts.family``: the runner, the request
         pipeline and the DVAE + Vocos audio decoder).
"batch"  whole utterances batched (Kokoro, VITS): the scheduler admits sequences while the sum of their work
         units (input tokens) fits ``SchedulerConfig.max_batch_work``, and one step runs the batch to audio.
         The family implements ``BatchModel`` (text -> utterances, utterances -> audio) and the engine's
         ``engine.batch.BatchStage`` does the rest (ordering, streaming by sentence, spans, cancellation).

Every method says its contract; nothing here imports torch at module level, so the registry, the CLI and the
server's request schemas can use families without loading a model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from ..engine.outputs import Word

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ..engine.config import EngineConfig
    from ..engine.stage import Stage
    from ..sampling_params import SamplingParams

Execution = Literal["slots", "batch"]
Size = Literal["tiny", "full"]
SIZES: tuple[Size, ...] = ("tiny", "full")


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a family can do, as the server states it (``/v1/models``) and checks requests against."""

    streaming: Literal["window", "sentence"]
    """The smallest piece of audio that leaves before the rest is computed: "window" (a few tokens of a
    sentence: ChatTTS's audio windows) or "sentence" (a whole sentence: Kokoro)."""
    timestamps: Literal["sentence", "word"]
    """The finest timing the engine counts (never estimates): sentence spans always; "word" when the model
    predicts durations (Kokoro's per-phoneme frames)."""
    refine: bool
    """A text pass that rewrites the text before speech (ChatTTS's refine_text)."""
    control_tokens: bool
    """Inline tokens in the text such as ``[laugh]`` and ``[uv_break]`` (SSML breaks become them)."""


@dataclass(frozen=True, slots=True)
class OptionSpec:
    """One request option as a form offers it (the playground; ``/v1/models``' ``options``) and, for a family's own
    options that are not ``SamplingParams``' (``owned_options``), the request field's shape: ``server.protocol``
    builds those fields from it (kind, bounds, length), so a family adds its request fields from its own package.
    The family still checks the value (``FamilyModel.check_options``)."""

    name: str
    """The flat request field (``POST /v1/tts``), as ``owned_options`` and ``SamplingParams.from_options`` spell it."""
    kind: Literal["number", "integer", "text", "choice", "boolean"]
    label: str
    default: float | int | str | bool | None = None
    """What the server uses when the field is left out; None: the checkpoint's own (unknown before a load)."""
    minimum: float | None = None
    maximum: float | None = None
    step: float | None = None
    choices: tuple[str, ...] = ()
    """"choice": the values it takes (a form offers "(default)", sending nothing, besides them)."""
    help: str = ""
    max_length: int | None = None
    """"text" and "choice": the longest string the request field takes (its shape; the family checks the value)."""


class Voices(ABC):
    """A loaded model's voices. A voice travels as a string (``SamplingParams.speaker``): the family's codec
    says which strings are voices (ChatTTS: base16384 speaker strings; Kokoro: pack names such as
    ``af_heart``) and turns built-in names and blends into such a string. Saved voices (the server's store,
    one per family) hold these strings too."""

    @property
    @abstractmethod
    def builtin(self) -> tuple[str, ...]:
        """The built-in voice names a request may use (ChatTTS: OpenAI's names; Kokoro: its packs)."""

    @abstractmethod
    def voice(self, name: str) -> str | None:
        """A built-in name's voice string (``name`` in ``builtin``); None when this checkpoint has none to
        give (a ChatTTS checkpoint without speaker statistics): the request then speaks without a voice."""

    @abstractmethod
    def is_voice(self, text: str) -> bool:
        """Whether ``text`` is spelled as a voice string of this family (cheap: no decode, no check)."""

    @abstractmethod
    def check(self, voice: str) -> None:
        """Raise ValueError (saying why) unless ``voice`` is a valid voice string for this checkpoint."""

    @abstractmethod
    def blend(self, voices: Sequence[str], weights: Sequence[float]) -> str:
        """One voice string mixing ``voices`` (valid voice strings) by ``weights`` (> 0, normalised here):
        ChatTTS mixes speaker embeddings in its statistics' space, Kokoro takes the weighted mean of packs.
        Raises ValueError when they cannot be mixed."""

    def description(self, name: str) -> str:
        """How a listing (Wyoming's ``describe``) presents built-in voice ``name``: by default its name."""
        return name

    def languages(self, name: str) -> tuple[str, ...]:
        """The languages built-in voice ``name`` speaks, as BCP 47 tags ("en-US", "zh"), for listings (Home
        Assistant offers a voice for its languages); () when the checkpoint does not say."""
        return ()


class FamilyModel(ABC):
    """One loaded checkpoint of a family: what the engine and the server read from it."""

    family: ModelFamily
    root: Path
    """The checkpoint directory (after ``ModelFamily.resolve``)."""
    config: EngineConfig
    """The engine config the model was prepared for (``load`` may settle what it left open: auto slots)."""

    @property
    @abstractmethod
    def sample_rate(self) -> int:
        """Hz of every waveform the engine returns for this model."""

    @property
    @abstractmethod
    def voices(self) -> Voices: ...

    @abstractmethod
    def identity(self) -> list[str]:
        """What of the checkpoint decides its outputs' bits, for result-cache keys: the files that make it
        (path, size and modification time; hashing gigabytes buys nothing for a cache that lives as long as
        the process). The cache adds the family name, the engine config and the device."""

    @abstractmethod
    def check_options(self, params: SamplingParams) -> Any:
        """The family's options for ``params``, validated (the family's own options object; ChatTTS's is
        ``SamplingParams`` itself). Raises ValueError naming the field, and, for a field another family
        owns, that family (``foreign_options``). Thread-safe, host-only: called as a request is prepared."""

    def stage(self, config: EngineConfig) -> Stage:
        """A "slots" family's execution on the engine (``engine.stage.Stage``), which it builds itself. A "batch"
        family has none of its own: the engine runs every ``BatchModel`` through ``engine.batch.BatchStage``."""
        raise NotImplementedError(f"the {self.family.name} family runs in slots and must build its own stage")


class BatchModel(FamilyModel):
    """A "batch" family's model: whole utterances in, their audio out. ``engine.batch.BatchStage`` calls
    ``utterances`` once per request (in a worker thread, before the request reaches the engine loop) and
    ``synthesize`` once per engine step with every admitted utterance (in the engine thread)."""

    @abstractmethod
    def utterances(self, text: str, params: SamplingParams) -> list[Utterance]:
        """Input processing: one request's text -> its utterances in speaking order (sentences, or chunks
        that fit the model's context), each with its work units. Validates everything (text, voice, options:
        ``check_options``) and raises ValueError naming what is wrong; never touches the device."""

    @abstractmethod
    def synthesize(self, batch: Sequence[Utterance]) -> list[Speech]:
        """One forward for the batch (any mix of lengths and requests), one ``Speech`` per utterance in
        order. A row's result must not depend on the others (batch invariance: durations exact, waveform
        within the family's stated bound). Raising fails the step's requests, never the engine."""

    def counters(self) -> dict[str, int]:
        """The model's graph counters for ``EngineStats`` (``graph_replays``, ``eager_steps``,
        ``graphs_refused``: a family's CUDA graphs per bucket, ``engine.bucket_graphs``); empty without graphs."""
        return {}


@dataclass(frozen=True, slots=True)
class Utterance:
    """One unit of a "batch" family's request: what ``BatchModel.synthesize`` needs for it."""

    text: str
    """What a caption shows for it (the sentence as the user wrote it, normalised)."""
    work: int
    """Work units (input tokens): the scheduler admits a batch while their sum fits ``max_batch_work``."""
    inputs: Any
    """The family's own input (token ids, voice, speed, seed): opaque to the engine."""


@dataclass(frozen=True, slots=True)
class Speech:
    """``BatchModel.synthesize``'s answer for one utterance."""

    audio: np.ndarray
    """float32 mono PCM at ``FamilyModel.sample_rate``."""
    words: tuple[Word, ...] = ()
    """Word timings (families whose ``Capabilities.timestamps`` is "word"); empty otherwise."""


class ModelFamily(ABC):
    """A kind of checkpoint: everything known before a weight is read. One instance per family, registered
    in ``chattts_serve.models`` (``register``); subclasses set the class attributes and the four methods."""

    name: ClassVar[str]
    """Lower-case, stable: ``--family``, ``/v1/models``, metrics labels and cache keys use it."""
    execution: ClassVar[Execution]
    capabilities: ClassVar[Capabilities]
    hub_repos: ClassVar[tuple[str, ...]] = ()
    """Hugging Face repo ids known to hold this family's checkpoints (``detect`` maps them without a
    download; any other repo id needs ``--family``)."""
    owned_options: ClassVar[frozenset[str]] = frozenset()
    """Request options (flat names, as the HTTP API and ``SamplingParams.from_options`` spell them) that
    only this family reads: another family refuses them with a 400 that names this one."""
    title: ClassVar[str] = ""
    """The model as a listing names it ("ChatTTS", "Kokoro-82M"; Wyoming's ``describe``); "": ``name``."""
    attribution: ClassVar[tuple[str, str] | None] = None
    """Who made the model and where (a name and a URL), for listings; None: nobody is named."""
    sample_text: ClassVar[str] = "Hello! This is a quick test of the speech server."
    """A sentence in the family's language, for a first try (the playground's text)."""

    def request_options(self) -> tuple[OptionSpec, ...]:
        """The request options this family reads beyond text, voice and seed (its ``owned_options`` and the
        common ones it honours, such as ``speed``), in the order a form shows them. ``/v1/models`` lists them so
        a client (the playground) offers this family's options and no other's. By default: none."""
        return ()

    @abstractmethod
    def is_checkpoint(self, root: Path) -> bool:
        """Whether local directory ``root`` holds this family's checkpoint (by its files; reads no weights)."""

    @abstractmethod
    def resolve(self, path_or_repo: str | Path) -> Path:
        """A complete local checkpoint directory: ``path_or_repo`` itself, or the repo downloaded (and
        cached) from the hub. Raises ValueError (or ``CheckpointError``: the CLI shows either without a
        traceback) saying what is missing."""

    @abstractmethod
    def write_random(self, directory: str | Path, size: Size = "tiny", seed: int = 0) -> Path:
        """Write a deterministic random-weight checkpoint in the family's exact official layout ("full": the
        official dimensions; "tiny": for tests) and return its root. The same seed gives the same bytes."""

    @abstractmethod
    def load(self, root: Path, device: torch.device, config: EngineConfig) -> FamilyModel:
        """Load the checkpoint at ``root`` (from ``resolve``) on ``device``, prepared for ``config``
        (precision, slots); ``FamilyModel.config`` is the config as the load settled it."""

    def __repr__(self) -> str:
        return f"<family {self.name}>"


def foreign_options(family: str, given: Mapping[str, Any], owners: Mapping[str, str]) -> str | None:
    """The message for the first option in ``given`` (set options, flat names) that a family other than
    ``family`` owns (``owners``: option -> owning family), or None. One wording for the engine and the server."""
    for name in given:
        owner = owners.get(name)
        if owner is not None and owner != family:
            return f"option {name!r} belongs to the {owner} family; this model is a {family} model"
    return None
