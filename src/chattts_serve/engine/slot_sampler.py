"""Sampling by KV slot: every row's parameters gathered from the slot state (``engine.slot_state``) on the
device, its noise drawn (``engine.noise``), its token recorded back: a fixed number of launches per kind,
whatever the batch. Every decode path samples through it (``engine.decode_path``), and the runner samples
its admissions' first tokens with it.
"""

from __future__ import annotations

import torch

from ..models.chattts.config import AUDIO_EOS
from .noise import CounterNoise, GeneratorNoise
from .sampler import PENALTY_WINDOW, batched_probs, sample_with_noise
from .slot_state import SlotState
from .step_plan import KindRows


class SlotSampler:
    def __init__(
        self, slot_state: SlotState, num_slots: int, noise: str, text_eos_id: int, device: torch.device
    ) -> None:
        """``noise``: the plan's source, "generator" or "counter"."""
        self.slot_state = slot_state
        self.noise = noise
        self.text_eos_id = text_eos_id
        self.generator_noise = GeneratorNoise(num_slots, device) if noise == "generator" else None
        self.counter_noise = CounterNoise(device)
        self.sync_free = device.type != "cpu"
        """Sampling takes no branch that reads a device value back. On the CPU (False) two such
        shortcuts are free and faster (``sampler.batched_probs``); tests set True there to run the
        device path."""

    def admit(self, slot: int, seed: int, seeded: bool, rows: int, vocab: int) -> None:
        """A sequence entered ``slot``: the generator source makes its generator now."""
        if self.generator_noise is not None:
            self.generator_noise.admit(slot, seed, seeded, rows, vocab)

    def release(self, slot: int) -> None:
        if self.generator_noise is not None:
            self.generator_noise.release(slot)

    def sample_kind(self, k: KindRows, logits: torch.Tensor) -> torch.Tensor:
        """One kind's tokens ``[len(seqs) * rows]`` (its admissions, then its decodes), every row with its
        slot's parameters; then recorded into the slots' state."""
        assert k.slots is not None
        return self.sample_slots(k.kind, k.slots, len(k.seqs), k.rows, k.k_max, logits, k.host_slots)

    def sample_first(self, k: KindRows, logits: torch.Tensor) -> torch.Tensor:
        """The first tokens ``[n_prefill * rows]`` of the kind's admissions from their prefill ``logits``."""
        assert k.slots is not None
        slots, hosts = k.slots[: k.n_prefill], k.host_slots[: k.n_prefill]
        return self.sample_slots(k.kind, slots, k.n_prefill, k.rows, k.k_max, logits, hosts)

    def sample_slots(
        self,
        kind: str,
        slots: torch.Tensor,
        n: int,
        rows: int,
        k_max: int,
        logits: torch.Tensor,
        host_slots: list[int] | None = None,
        active: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Tokens ``[n * rows]`` of the ``n`` sequences in ``slots`` from their ``logits`` ``[n * rows, V]``,
        recorded into the slots' state. ``k_max`` >= every row's effective top_k (the vocabulary always
        is: the same k-th value, no host value in the shapes). ``host_slots``: the generator noise's
        slots. ``active`` ``[n]`` bool (the whole-step graph, ``engine.step_graph``): rows that are not
        active are sampled but leave their slot's state as it was."""
        st = self.slot_state

        def per_row(values: torch.Tensor) -> torch.Tensor:  # [n] per sequence -> [n * rows]
            return values[:, None].expand(n, rows).reshape(n * rows)

        generated = st.generated.index_select(0, slots)
        temperature = st.temperature.index_select(0, slots)[:, :rows].reshape(n * rows, 1)
        penalty = per_row(st.penalty.index_select(0, slots))[:, None]
        top_p = per_row(st.top_p.index_select(0, slots))[:, None]
        top_k = per_row(st.top_k.index_select(0, slots))
        block = per_row(generated < st.min_new_tokens.index_select(0, slots))
        history = st.history.index_select(0, slots)[:, :rows].reshape(n * rows, PENALTY_WINDOW)
        valid = st.window[None] < per_row(generated.clamp(max=PENALTY_WINDOW))[:, None]
        if active is not None:  # a row that is not active may hold a text id or a freed slot's ids
            history = history.masked_fill(~per_row(active)[:, None], 0)
        eos = AUDIO_EOS if kind == "code" else self.text_eos_id
        probs = batched_probs(
            logits,
            history,
            valid,
            temperature,
            penalty,
            top_p,
            top_k,
            k_max,
            block,
            eos,
            host_reads=not self.sync_free,
        )
        vocab = logits.shape[-1]
        if self.generator_noise is not None:
            assert host_slots is not None
            noise = self.generator_noise(host_slots, rows, vocab)
        else:
            noise = self.counter_noise(st.seed.index_select(0, slots), generated, rows, vocab)
        tokens = sample_with_noise(probs, noise)
        if active is None:
            st.record(slots, generated, tokens.view(n, rows))
        else:
            st.record_active(n, generated, tokens.view(n, rows), active)
        return tokens
