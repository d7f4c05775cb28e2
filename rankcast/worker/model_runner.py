"""Turns a `SchedulerOutput` into tensors, runs this rank's model slice and samples.

The runner keeps only what must persist across steps on a rank: the KV cache and, for each live
request, its sampling parameters, random generator and (structured outputs) grammar matcher.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import mmap
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from rankcast.lora.layers import LoRABatch, LoRAContext, LoRALinear, attach_lora
from rankcast.lora.peft_adapter import LoRAAdapter, SlotImage
from rankcast.model import kv_quant
from rankcast.model.attention import AttentionMetadata
from rankcast.model.llama import LlamaForCausalLM
from rankcast.model_files.arch import ArchConfig
from rankcast.protocol import ModelRunnerOutput, SchedulerOutput
from rankcast.sampling_params import SamplingParams
from rankcast.start_up_holds import hold_here
from rankcast.worker import prompt_logprobs, sampler, verification
from rankcast.worker.grammar import GrammarMatchers, TokenMask

logger = logging.getLogger(__name__)


def zeroed_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor in anonymous mmap memory, which the kernel zeroes page by page on
    first touch, so making it writes nothing (`torch.zeros` would write every byte, ~0.45 s per
    GiB on a 2-core Zen 3); `commit_pages` takes its memory when wanted. Huge pages are asked
    for where the kernel leaves it to the program (fewer TLB misses as attention walks the
    blocks). Other devices zero as usual."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    memory = mmap.mmap(-1, nbytes)  # anonymous and private: the tensor keeps it alive
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(memory, dtype=dtype).view(shape)


def commit_pages(tensor: torch.Tensor) -> None:
    """Write one byte of every page of a contiguous CPU tensor (zero where it is zero), which
    is what makes the kernel give the page to this process now rather than at first use: a
    machine that cannot hold it fails now, not under load, and the process's memory stays flat
    as the prefix cache cycles its blocks."""
    tensor.view(-1).view(torch.uint8)[:: mmap.PAGESIZE].zero_()


# The commit touches the cache in pieces of this many bytes, so that `close` stops it within
# one piece (~10-30 ms) rather than one layer's whole cache.
_COMMIT_CHUNK_BYTES = 64 * 2**20


@dataclass
class _RequestState:
    params: SamplingParams
    generator: torch.Generator | None
    matcher: Any = None  # llguidance's, made when a structured request first samples here


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        arch: ArchConfig,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        grammars: GrammarMatchers | None = None,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        # What the cache holds: the activations' dtype, or an 8-bit format (kv_quant.py).
        self.kv_cache_dtype = kv_cache_dtype or dtype
        self.grammars = grammars  # None: this runner refuses structured requests
        self.arch = arch
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.kv_caches: list[torch.Tensor] = []
        self._commit: threading.Thread | None = None  # the cache's commit, until it is done
        self._stop_commit = threading.Event()
        self.requests: dict[str, _RequestState] = {}
        self.lora_context: LoRAContext | None = None
        self.lora_layers: dict[int, list[LoRALinear]] = {}

    # ---- LoRA slots ----

    def enable_lora(self, max_loras: int, max_rank: int) -> None:
        """Give the projections `max_loras` adapter slots (done once, before serving)."""
        self.lora_context, self.lora_layers = attach_lora(self.model, max_loras, max_rank)
        self.model.fuse_layers()  # again: steps with adapters must leave the stack

    def set_lora(self, slot: int, adapter: LoRAAdapter) -> None:
        """Write `adapter` (whole; each layer cuts its own shard) into `slot` on this rank."""
        if self.lora_context is None:
            raise RuntimeError("LoRA is not enabled on this engine (enable_lora)")
        # Every layer's copies in one call: an activation is ~330 copies of a few KB for a
        # SmolLM2 adapter, and copying them one by one (with their slices) took ~3x as long as
        # the bytes alone, on the step's critical path.
        writes = [
            write
            for layer, projections in self.lora_layers.items()
            for projection in projections
            for write in projection.slot_writes(slot, adapter, layer)
        ]
        torch._foreach_copy_([place for place, _ in writes], [image for _, image in writes])

    def host_tier_form(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """The adapter as this rank keeps it in its host tier: every LoRA layer's slot image
        made now (on the thread that read it), the checkpoint's tensors dropped, so an
        activation is a few copies and the tier holds one form of each adapter, not two."""
        if self.lora_context is None:
            raise RuntimeError("LoRA is not enabled on this engine (enable_lora)")
        # Projections alike in every layer (same image key) are made together.
        alike: dict[Hashable, tuple[LoRALinear, list[int]]] = {}
        for layer, projections in self.lora_layers.items():
            for projection in projections:
                alike.setdefault(projection.image_key, (projection, []))[1].append(layer)
        images: dict[tuple[int, Hashable], SlotImage] = {}
        for key, (projection, layers) in alike.items():
            made = projection.slot_images(adapter, layers)
            images.update(((layer, key), image) for layer, image in zip(layers, made, strict=True))
        return dataclasses.replace(adapter, weights={}, slot_images=images)

    def clear_lora(self, slot: int) -> None:
        torch._foreach_zero_(
            [
                place
                for projections in self.lora_layers.values()
                for projection in projections
                for place in projection.slot_clears(slot)
            ]
        )

    # ---- KV cache ----

    def bytes_per_block(self, group: int = 0) -> int:
        """What one block of KV-cache group `group` costs on this rank: K and V of each of its
        layers here (0 where this rank has none of them)."""
        layers = [a for a in self.model.attention_layers() if a.kv_group == group]
        kv_heads = layers[0].num_kv_heads if layers else 0
        element = torch.tensor([], dtype=self.kv_cache_dtype).element_size()
        # A token's head: its values, and with an 8-bit cache their float32 scale.
        scale = 4 if kv_quant.is_8bit(self.kv_cache_dtype) else 0
        per_head = self.arch.head_dim * element + scale
        return 2 * len(layers) * self.block_size * kv_heads * per_head

    def initialize_cache(
        self, num_blocks: int, commit: bool = True, num_window_blocks: int | None = None
    ) -> int:
        """Allocate every layer's cache up front, so its size is fixed at start-up, and with
        `commit` take all its memory before the first step; returns the bytes committed (0 when
        pages are left to be taken as blocks are first written).

        The commit runs on a thread of its own (~0.3-1 s per GiB of page faults), overlapping
        the rest of the start (the engine's handshake, the API servers' imports); the first
        step waits for it (`wait_for_cache`), so no step writes a block the commit still
        touches, and every page is this process's before any request runs.

        Each layer's keys and values share one allocation, laid out as `attention.py` describes;
        an 8-bit cache's per-token scales share another ([2, blocks, Hkv, block_size] float32).
        A layer of the sliding-window KV-cache group (`kv_group` 1) has `num_window_blocks`
        blocks (by default as many as the others: a caller without the engine's scheduler then
        gives a sequence the same table in both groups), the others `num_blocks`.
        """
        self.kv_caches = []
        window_blocks = num_blocks if num_window_blocks is None else num_window_blocks
        for attn in self.model.attention_layers():
            blocks = window_blocks if attn.kv_group == 1 else num_blocks
            whole = (2, blocks, attn.num_kv_heads, self.block_size * attn.head_dim)
            cache = zeroed_tensor(whole, self.kv_cache_dtype, self.device)
            shape = (blocks, attn.num_kv_heads)
            attn.key_cache = cache[0].view(*shape, attn.head_dim, self.block_size)
            attn.value_cache = cache[1].view(*shape, self.block_size, attn.head_dim)
            self.kv_caches.append(cache)
            if kv_quant.is_8bit(self.kv_cache_dtype):
                scales = zeroed_tensor((2, *shape, self.block_size), torch.float32, self.device)
                attn.key_scale, attn.value_scale = scales[0], scales[1]
                self.kv_caches.append(scales)
        self.model.fuse_layers()
        if not commit or self.device.type != "cpu":
            # Other devices' caches are zeroed, so resident, as they are made.
            return sum(c.numel() * c.element_size() for c in self.kv_caches) if commit else 0
        self._commit = threading.Thread(target=self._commit_cache, name="kv-commit", daemon=True)
        self._commit.start()
        return sum(c.numel() * c.element_size() for c in self.kv_caches)

    def _commit_cache(self) -> None:
        hold_here("kv_commit")  # a fault test's moment: the engine is ready, its cache not yet
        start = time.perf_counter()
        for cache in self.kv_caches:
            flat = cache.view(-1).view(torch.uint8)
            for offset in range(0, flat.numel(), _COMMIT_CHUNK_BYTES):
                if self._stop_commit.is_set():
                    return
                commit_pages(flat[offset : offset + _COMMIT_CHUNK_BYTES])
        nbytes = sum(c.numel() * c.element_size() for c in self.kv_caches)
        logger.info(
            "KV cache committed: %.0f MiB in %.2f s", nbytes / 2**20, time.perf_counter() - start
        )

    def wait_for_cache(self) -> None:
        """Return once the cache's memory is committed (at once when it was, or is not to be)."""
        if self._commit is not None:
            self._commit.join()
            self._commit = None

    def close(self) -> None:
        """Stop a commit still under way and wait for its thread. An engine stopped before its
        first step (a script that only starts and stops an `LLM`) otherwise left the thread
        touching pages as the interpreter exited, which killed it inside torch and aborted the
        process (exit status 134, "terminate called without an active exception")."""
        self._stop_commit.set()
        self.wait_for_cache()

    # ---- one step ----

    def _update_states(self, batch: SchedulerOutput) -> None:
        for request_id in batch.finished_request_ids:
            self.requests.pop(request_id, None)
        for seq in batch.sequences:
            if seq.sampling_params is not None and seq.request_id not in self.requests:
                params = seq.sampling_params
                generator = None
                if params.seed is not None:
                    generator = torch.Generator(device=self.device)
                    generator.manual_seed(params.seed)
                self.requests[seq.request_id] = _RequestState(params, generator)

    def _prepare(self, batch: SchedulerOutput) -> tuple[torch.Tensor, AttentionMetadata]:
        """The step's token ids and attention metadata, built from plain lists in one pass."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        query_start = [0]
        width = max(
            max(len(seq.block_ids), len(seq.window_block_ids or ())) for seq in batch.sequences
        )
        tables: list[list[int]] = []
        # A sequence without a table of that group (a caller without the engine's scheduler)
        # uses its one table in both.
        windowed = self.arch.separate_window_group
        window_slots: list[int] = []
        window_tables: list[list[int]] = []
        for seq in batch.sequences:
            n = len(seq.token_ids)
            first = seq.start_position
            input_ids.extend(seq.token_ids)
            positions.extend(range(first, first + n))
            blocks = seq.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(first, first + n))
            query_lens.append(n)
            seq_lens.append(first + n)
            query_start.append(query_start[-1] + n)
            tables.append(blocks + [0] * (width - len(blocks)))
            if windowed:
                own = seq.window_block_ids if seq.window_block_ids is not None else blocks
                window_slots.extend(own[p // bs] * bs + p % bs for p in range(first, first + n))
                window_tables.append(own + [0] * (width - len(own)))
        dev = self.device
        meta = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_lens=query_lens,
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start=torch.tensor(query_start, dtype=torch.int32, device=dev),
            from_scratch=all(seq.start_position == 0 for seq in batch.sequences),
        )
        if windowed:
            meta.window_slot_mapping = torch.tensor(window_slots, dtype=torch.long, device=dev)
            meta.window_block_tables = torch.tensor(window_tables, dtype=torch.int32, device=dev)
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        context = self.lora_context
        if context is not None:
            token_slots = [s.lora_slot for s in batch.sequences for _ in s.token_ids]
            context.batch = LoRABatch.from_token_slots(token_slots, context)
        return ids, meta

    @torch.inference_mode()
    def compute_logits(self, batch: SchedulerOutput) -> torch.Tensor | None:
        """Logits [sampling rows, vocab] at the newest position of each sequence that samples
        this step (a prompt chunk that continues later has none), preceded, for a sequence with
        drafts, by a row at each position a draft is checked at (verification.py).

        Every pipeline stage builds the same inputs from the shared batch; a non-first stage
        receives the previous stage's (hidden, residual), a non-last one passes its own on and
        returns None.
        """
        logits = self._step_logits(batch)
        return None if logits is None else logits[0]

    def _step_logits(self, batch: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`compute_logits`'s rows, and then (prompt logprobs) the rows of the prompt positions
        the batch's sequences name targets for, in batch order: one projection for both, so a
        prompt row is computed as any sampling row is."""
        self.wait_for_cache()  # no block is written while the commit may still touch it
        ids, meta = self._prepare(batch)
        pp = self.model.pp
        intermediate = None
        if not pp.is_first:
            shape = (ids.shape[0], self.arch.hidden_size)
            hidden_in, residual_in = pp.receive(shape, self.dtype, self.device, 2)
            intermediate = (hidden_in, residual_in)
        hidden, residual = self.model(ids, meta, intermediate)
        if not pp.is_last:
            assert residual is not None
            pp.send((hidden, residual))
            return None
        scoring = any(s.prompt_logprob_targets for s in batch.sequences)
        sampled = len(batch.sequences)
        if scoring or hidden.shape[0] != sampled or not all(s.sample for s in batch.sequences):
            # Each sampling sequence's last token (the end of its slice of the step's tokens),
            # and with drafts the rows of the tokens before it that the drafts took.
            ends = list(itertools.accumulate(meta.query_lens))
            rows = [
                row
                for end, seq in zip(ends, batch.sequences, strict=True)
                if seq.sample
                for row in range(end - 1 - seq.num_draft_tokens, end)
            ]
            sampled = len(rows)
            # Then the rows that score prompt tokens: the first len(targets) of each asker's.
            rows += [
                end - len(seq.token_ids) + j
                for end, seq in zip(ends, batch.sequences, strict=True)
                for j in range(len(seq.prompt_logprob_targets or ()))
            ]
            if not rows:
                empty: torch.Tensor = hidden.new_empty((0, self.arch.vocab_size))
                return empty, empty
            hidden = hidden[rows]
        logits: torch.Tensor = self.model.compute_logits(hidden)
        return logits[:sampled], logits[sampled:]

    @torch.inference_mode()
    def execute_model(
        self, batch: SchedulerOutput, sample: bool = True
    ) -> ModelRunnerOutput | None:
        """Run one step; ranks that do not sample (all but the output rank) return None."""
        self._update_states(batch)
        if not batch.sequences:
            return None
        step_logits = self._step_logits(batch)
        if step_logits is None or not sample:
            return None
        logits, prompt_rows = step_logits
        scored = None
        if prompt_rows.shape[0]:
            tops = [
                self.requests[seq.request_id].params.prompt_logprobs or 0
                for seq in batch.sequences
                if seq.prompt_logprob_targets
            ]
            scored = prompt_logprobs.score_prompts(batch.sequences, prompt_rows, tops)
        sampling = [seq for seq in batch.sequences if seq.sample]
        if not sampling:
            return ModelRunnerOutput(request_ids=[], sampled_token_ids=[], prompt_logprobs=scored)
        states = [self.requests[seq.request_id] for seq in sampling]
        request_ids = [seq.request_id for seq in sampling]
        spans = verification.row_spans(sampling)
        # Each row samples with its sequence's parameters and generator (drafting sequences
        # have several rows, a structured one a mask for each: grammar.py).
        row_states = [
            state for state, span in zip(states, spans, strict=True) for _ in range(span.rows)
        ]
        allowed, structured = self._token_mask(request_ids, states, spans)
        generators = [s.generator for s in states]
        saved = verification.generator_states(spans, generators)
        tokens, logprobs = sampler.sample(
            logits, [s.params for s in row_states], [s.generator for s in row_states], allowed
        )
        kept_tokens, kept_logprobs, kept = verification.split_rows(tokens, logprobs, spans)
        if structured:
            assert self.grammars is not None
            for index in structured:  # the grammar moves by the tokens kept, no further
                for token in kept_tokens[index]:
                    self.grammars.advance(request_ids[index], states[index].matcher, token)
        for request, saved_state, span, count in zip(states, saved, spans, kept, strict=True):
            generator = request.generator
            if generator is None or saved_state is None or request.params.greedy:
                continue  # a greedy request's generator draws nothing that matters
            if count < span.rows:
                verification.rewind(generator, saved_state, count, logits.shape[1], logits.device)
        return ModelRunnerOutput(
            request_ids=request_ids,
            sampled_token_ids=kept_tokens,
            logprobs=kept_logprobs,
            prompt_logprobs=scored,
        )

    def _token_mask(
        self,
        request_ids: list[str],
        states: list[_RequestState],
        spans: list[verification.RowSpan],
    ) -> tuple[TokenMask | None, list[int]]:
        """The step's mask of the structured sequences' rows, and which sequences those are;
        (None, []) when none is structured (the usual step pays one attribute check per
        sequence)."""
        structured = [i for i, state in enumerate(states) if state.params.structured is not None]
        if not structured:
            return None, []
        if self.grammars is None:
            raise RuntimeError("this model runner has no tokenizer for structured outputs")
        for index in structured:
            state = states[index]
            if state.matcher is None:
                assert state.params.structured is not None
                state.matcher = self.grammars.matcher(request_ids[index], state.params.structured)
        mask = self.grammars.mask(
            [spans[i].first for i in structured],
            [states[i].matcher for i in structured],
            [spans[i].drafts for i in structured],
        )
        return mask, structured
