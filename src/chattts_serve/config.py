"""Server configuration: one dataclass; ``chattts-serve serve`` flags map one-to-one onto its fields.
The engine's own limits are ``engine.scheduler.SchedulerConfig`` and ``audio.stream.StreamPolicy``."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MODEL = "2Noise/ChatTTS"


ENV_PREFIX = "CHATTTS_SERVE_"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """``chattts-serve serve`` flags map one-to-one onto these fields; each can also be set from the
    environment as CHATTTS_SERVE_<FIELD> (e.g. CHATTTS_SERVE_PORT=9000, CHATTTS_SERVE_API_KEYS=a,b)."""

    model: str = DEFAULT_MODEL
    """Checkpoint directory or Hugging Face repo id."""
    device: str = "auto"
    """auto (CUDA if available, else CPU), cpu, cuda, cuda:1, ..."""
    precision: str = "fp32"
    """GPT precision: fp32, bf16, fp16 (CUDA), int8, int8-dynamic (CPU), int8-static (CPU)."""
    decode: str = "auto"
    """Decode step: rows (per-sequence attention, batch-invariant; CPU default) or static (fixed shapes,
    CUDA graphs; CUDA default; on CPU not batch-invariant, and slower than rows since the one-write KV
    change: 111 vs 131 steps/s at 16 int8 streams)."""
    cuda_graphs: bool = True
    """Capture the decode step in CUDA graphs (CUDA only)."""
    compile: bool = False
    """torch.compile the decode step (slower start-up; see BENCHMARKS.md for when it pays)."""
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    """When set, every endpoint except /health needs ``Authorization: Bearer <key>``."""
    max_num_seqs: int = 16
    """KV-cache slots (sequences decoding at once)."""
    max_model_len: int = 2048 + 256
    max_waiting: int = 256
    """Sequences that may wait for a slot; beyond it requests get 429."""
    max_concurrent_streams: int = 64
    """Requests in flight (running + waiting); beyond it requests get 429."""
    max_queue_wait_s: float = 30.0
    """A request that has not produced audio after this long while queued is refused with 503."""
    max_input_chars: int = 4096
    max_body_bytes: int = 1 << 20
    voices_db: str = "voices.sqlite3"
    """SQLite file of saved voices (survives restarts)."""
    default_voice: str | None = None
    """Voice used when a request names none that exists; None: no speaker embedding."""
    warmup: bool = True
    log_level: str = "info"
    threads: int = 0
    """torch CPU threads; 0 = torch's default."""

    def __post_init__(self) -> None:
        from .model.config import PRECISIONS

        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {self.precision!r}")
        if self.decode not in ("auto", "rows", "static"):
            raise ValueError(f"decode must be auto, rows or static; got {self.decode!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        for name in (
            "max_num_seqs",
            "max_model_len",
            "max_waiting",
            "max_concurrent_streams",
            "max_input_chars",
            "max_body_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queue_wait_s <= 0:
            raise ValueError(f"max_queue_wait_s must be > 0, got {self.max_queue_wait_s}")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides) -> ServerConfig:
        """Defaults, then CHATTTS_SERVE_* environment variables, then explicit overrides."""
        import os
        from dataclasses import fields

        environ = os.environ if environ is None else environ
        values = {}
        for f in fields(cls):
            raw = environ.get(ENV_PREFIX + f.name.upper())
            if raw is None:
                continue
            default = f.default
            if isinstance(default, bool):
                values[f.name] = raw.strip().lower() in ("1", "true", "yes", "on")
            elif isinstance(default, int):
                values[f.name] = int(raw)
            elif isinstance(default, float):
                values[f.name] = float(raw)
            elif isinstance(default, tuple):
                values[f.name] = tuple(k.strip() for k in raw.split(",") if k.strip())
            else:
                values[f.name] = raw
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)
