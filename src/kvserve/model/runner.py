"""ModelRunner: owns the weights and the KV memory, turns one scheduled step into one forward pass."""

import logging
from dataclasses import dataclass, field, replace

import torch

from kvserve.config import COMPUTE_DTYPES, default_cache_dir
from kvserve.errors import ModelLoadError
from kvserve.model import kv_quant
from kvserve.model.attention import AttentionBackend, AttentionMetadata, KVCache
from kvserve.model.loader import LoadedModel
from kvserve.model.native_attention import KernelUnavailableError, NativeAttention, PagedAttentionKernel
from kvserve.model.recurrent import (
    SCRATCH_SLOT,
    ZERO,
    RecurrentState,
    SequenceRows,
    StateSpec,
    sequence_rows,
    state_specs,
)
from kvserve.model.torch_attention import TorchAttention
from kvserve.model.transformer import Transformer

# float64 is for reference runs: rounding differences between batch shapes are then far too small to
# flip a greedy token, which lets differential tests compare scheduling paths token for token.
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in COMPUTE_DTYPES}

log = logging.getLogger(__name__)


@dataclass
class SequenceChunk:
    """Tokens of one request to run this step: `token_ids` sit at positions start, start+1, ...

    `block_table` must already cover every position up to start + len(token_ids). When `sample` is set,
    the logits of the last token are returned; when `all_logits` is set (prompt logprobs), the logits
    of every token of the chunk as well. `sliding_table` is the same positions' blocks in the sliding
    layers' group (None: `block_table`, one id space); an entry before every window may be any block,
    as it is never read (block 0 where the sequence released it).
    """

    token_ids: list[int]
    start: int
    block_table: list[int]
    sample: bool
    all_logits: bool = False
    sliding_table: list[int] | None = None
    # A hybrid model's recurrent-state slot of the sequence (the cache's StatePool); a decode and its
    # draft rows share it and lie side by side. SCRATCH_SLOT: rows of no sequence (the startup probe).
    state_slot: int = SCRATCH_SLOT


@dataclass
class StepLogits:
    """Float32 CPU logits of one step: `sampled` [sampling chunks, vocab], decodes first, then prefills;
    `chunks` [len(chunk), vocab] for each prefill chunk with `all_logits`, in batch order."""

    sampled: torch.Tensor
    chunks: list[torch.Tensor] = field(default_factory=list)


@dataclass
class ForwardBatch:
    decodes: list[SequenceChunk] = field(default_factory=list)
    prefills: list[SequenceChunk] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Copies on write in the sliding group, where its ids are its own.
    sliding_copies: list[tuple[int, int]] = field(default_factory=list)
    # A hybrid model's state copies (src, dst; src ZERO zeroes dst), run in order before the step.
    state_copies: list[tuple[int, int]] = field(default_factory=list)


def attention_backend(
    choice: str,
    block_size: int,
    group: int,
    device: torch.device,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    cache_dir: str,
) -> AttentionBackend:
    """The backend that `choice` (one of config.ATTENTION_BACKENDS, checked there) names: "native" (the
    C kernel, built into `cache_dir`; an error if it cannot run here), "torch" (portable), or "auto"
    (native where it can run, else torch, saying why)."""
    if choice != "torch":
        try:
            kernel = PagedAttentionKernel.load(cache_dir, device, dtype, kv_dtype)
            return NativeAttention(kernel, block_size)
        except KernelUnavailableError as e:
            if choice == "native":
                raise
            log.warning("attention falls back to the portable torch path: %s", e)
    return TorchAttention(block_size, group, device)


def _sliding(chunk: SequenceChunk) -> SequenceChunk:
    """The chunk as the sliding layers see it: over its sliding table."""
    return chunk if chunk.sliding_table is None else replace(chunk, block_table=chunk.sliding_table)


class ModelRunner:
    def __init__(
        self,
        model: LoadedModel,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        device: str,
        dtype: str,
        weight_dtype: str,
        attention: str = "auto",
        cache_dir: str | None = None,
        kv_dtype: str | None = None,
        int16_activations: bool = False,
        num_sliding_blocks: int | None = None,
        num_state_slots: int = 1,
    ):
        """`dtype` is the compute dtype, `kv_dtype` the KV cache's (default: `dtype`), `weight_dtype` the
        storage of the linear weights; `int16_activations` gives the native products' rows int16
        activations (EngineConfig.activations). `num_sliding_blocks` sizes the sliding
        layers' group (default `num_blocks`, sharing the global group's ids).

        A hybrid model's recurrent layers keep `num_state_slots` states (slot 0 scratch, the others the
        cache's StatePool's: live sequences and checkpoints).

        `attention` picks the attention backend for decode rows and prefill rows (`attention_backend`);
        native kernels are built into `cache_dir`, by default kvserve's cache folder.
        """
        self.device = torch.device(device)
        self.dtype = TORCH_DTYPES[dtype]
        kv_format = kv_dtype or dtype
        self.kv_dtype = kv_quant.storage_dtype(kv_format)
        self.block_size = block_size
        cache_dir = cache_dir or default_cache_dir()
        c = model.config
        self.attention = attention_backend(
            attention,
            block_size,
            c.num_heads // c.num_kv_heads,
            self.device,
            self.dtype,
            self.kv_dtype,
            cache_dir,
        )
        self.transformer = Transformer(
            c,
            model.weights,
            max_model_len,
            self.device,
            self.dtype,
            weight_dtype,
            self.attention,
            model.quantized,
            cache_dir,
            int16_activations,
            model.norms_hold_offset,
            # No sequence outgrows the global pool: the rope tables hold no position past it.
            min(max_model_len, num_blocks * block_size),
        )
        attending = c.attention_layers
        self.kv_cache = KVCache(
            len(attending),
            num_blocks,
            block_size,
            c.num_kv_heads,
            kv_quant.row_width(kv_format, c.head_dim),
            self.device,
            self.kv_dtype,
            [c.window(i) for i in attending] if c.windows else (),
            num_sliding_blocks,
        )
        self.state = RecurrentState(self._specs(), num_state_slots, self.device) if c.hybrid else None
        try:
            self.transformer.attach_native_decoder(self.kv_cache, self.state)
        except KernelUnavailableError as e:
            log.info("decode steps run op by op: %s", e)

    def _specs(self) -> list[StateSpec | None]:
        """The layers' state specs as the config makes them; a mixer whose own disagrees is refused."""
        specs = state_specs(self.transformer.config, self.dtype)
        for i, (made, mixer) in enumerate(zip(specs, self.transformer.state_specs(), strict=True)):
            if made != mixer:
                raise ModelLoadError(
                    f"model.layers.{i}",
                    f"the layer's recurrent state {mixer} disagrees with its config's {made}",
                )
        return specs

    @staticmethod
    def _rows(batch: ForwardBatch) -> SequenceRows:
        """The step's rows by sequence: a decode and the draft rows after it (one slot) are one sequence,
        each prefill chunk another."""
        lengths: list[int] = []
        slots: list[int] = []
        for c in batch.decodes:
            if slots and lengths and c.state_slot == slots[-1] and c.state_slot != SCRATCH_SLOT:
                lengths[-1] += 1
            else:
                lengths.append(1)
                slots.append(c.state_slot)
        for c in batch.prefills:
            lengths.append(len(c.token_ids))
            slots.append(c.state_slot)
        return sequence_rows(lengths, slots, len(batch.decodes))

    def _inputs(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """The step's token ids and positions (decodes first, then the prefill chunks), the backend's
        metadata, and the rows whose logits are sampled."""
        ids = [c.token_ids[0] for c in batch.decodes]
        positions = [c.start for c in batch.decodes]
        sample_rows = [i for i, c in enumerate(batch.decodes) if c.sample]
        offset = len(batch.decodes)
        for c in batch.prefills:
            ids += c.token_ids
            positions += range(c.start, c.start + len(c.token_ids))
            offset += len(c.token_ids)
            if c.sample:
                sample_rows.append(offset - 1)
        meta = self.attention.prepare(batch.decodes, batch.prefills)
        # With one id space the sliding layers' tables and slots are the global ones: the step's one
        # metadata serves both groups (`AttentionMetadata.group`).
        if self.kv_cache.num_sliding_layers and not self.kv_cache.shared_ids:
            meta.sliding = self.attention.prepare(
                [_sliding(c) for c in batch.decodes], [_sliding(c) for c in batch.prefills]
            )
        dev = self.device
        return torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), meta, sample_rows

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> StepLogits:
        """Run one step: logits where chunks sample, and at every position of `all_logits` chunks."""
        for src, dst in batch.block_copies:
            self.kv_cache.copy_block(src, dst)
        for src, dst in batch.sliding_copies:
            self.kv_cache.copy_block(src, dst, sliding=True)
        if self.state is not None:
            self.state.apply(batch.state_copies)
        input_ids, positions, meta, rows = self._inputs(batch)
        hidden = self._forward(batch, input_ids, positions, meta)
        # Sampling runs on the CPU with each request's own generator, whatever the model's device.
        sampled = (
            self.transformer.logits(hidden[rows]).float().cpu()
            if rows
            else torch.empty(0, self.transformer.config.vocab_size)
        )
        chunks: list[torch.Tensor] = []
        start = len(batch.decodes)
        for c in batch.prefills:
            end = start + len(c.token_ids)
            if c.all_logits:
                chunks.append(self.transformer.logits(hidden[start:end]).float().cpu())
            start = end
        return StepLogits(sampled, chunks)

    @torch.inference_mode()
    def prefill_logits(self, chunk: SequenceChunk) -> torch.Tensor:
        """Float32 CPU logits [len(chunk.token_ids), vocab] at every position of one prefill chunk.

        For evaluation (perplexity, agreement between weight precisions); serving samples through
        `execute`, which computes logits only where a request samples. Writes the chunk's KV like `execute`.
        """
        batch = ForwardBatch(prefills=[chunk])
        input_ids, positions, meta, _ = self._inputs(batch)
        hidden = self._forward(batch, input_ids, positions, meta)
        return self.transformer.logits(hidden).float().cpu()

    def _forward(
        self, batch: ForwardBatch, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        rows = None
        if self.state is not None:
            rows = self._rows(batch)
            # Rows of no sequence start from zeros, whatever the scratch slot held before.
            if bool((rows.slots == SCRATCH_SLOT).any()):
                self.state.apply([(ZERO, SCRATCH_SLOT)])
        return self.transformer.forward(input_ids, positions, meta, self.kv_cache, rows, self.state)
