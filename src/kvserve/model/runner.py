"""ModelRunner: owns the weights and the KV memory, turns one scheduled step into one forward pass."""

import logging
from dataclasses import dataclass, field

import torch

from kvserve.config import COMPUTE_DTYPES, default_cache_dir
from kvserve.model.attention import AttentionMetadata, KVCache, PrefillSpan
from kvserve.model.loader import LoadedModel
from kvserve.model.native_attention import KernelUnavailableError, NativeDecodeAttention
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
    of every token of the chunk as well.
    """

    token_ids: list[int]
    start: int
    block_table: list[int]
    sample: bool
    all_logits: bool = False


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
        int16_decodes: bool = False,
    ):
        """`dtype` is the compute dtype, `kv_dtype` the KV cache's (default: `dtype`), `weight_dtype` the
        storage of the linear weights; `int16_decodes` gives the native products' decode and logits rows
        int16 activations (EngineConfig.decode_activations).

        `attention` picks the decode-attention backend: "native" (the C kernel, built into `cache_dir`,
        by default kvserve's cache folder; an error if it cannot run here), "torch" (portable), or
        "auto" (native where it can run).
        """
        self.device = torch.device(device)
        self.dtype = TORCH_DTYPES[dtype]
        self.kv_dtype = TORCH_DTYPES[kv_dtype or dtype]
        self.block_size = block_size
        c = model.config
        self.group = c.num_heads // c.num_kv_heads
        self.transformer = Transformer(
            c,
            model.weights,
            max_model_len,
            self.device,
            self.dtype,
            weight_dtype,
            model.quantized,
            cache_dir or default_cache_dir(),
            int16_decodes,
        )
        self.kv_cache = KVCache(
            c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, self.device, self.kv_dtype
        )
        self.native = self._native_attention(attention, cache_dir)
        if self.native is not None:
            try:
                self.transformer.attach_native_decoder(self.kv_cache)
            except KernelUnavailableError as e:
                log.info("decode steps run op by op: %s", e)

    def _native_attention(self, attention: str, cache_dir: str | None) -> NativeDecodeAttention | None:
        if attention == "torch":
            return None
        try:
            return NativeDecodeAttention.load(
                cache_dir or default_cache_dir(), self.device, self.dtype, self.kv_dtype
            )
        except KernelUnavailableError as e:
            if attention == "native":
                raise
            log.warning("decode attention falls back to the portable torch path: %s", e)
            return None

    def _slots(self, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return block_table[positions // self.block_size] * self.block_size + positions % self.block_size

    def _metadata(
        self, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        dev = self.device
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        decode_tables = decode_mask = decode_lens = None
        decode_len = 0
        if batch.decodes:
            lengths = [c.start + 1 for c in batch.decodes]
            decode_len = max(lengths)
            width = -(-decode_len // bs)
            rows = []
            for c in batch.decodes:
                ids.append(c.token_ids[0])
                positions.append(c.start)
                slots.append(c.block_table[c.start // bs] * bs + c.start % bs)
                # Padding points at block 0: it is read but masked out.
                rows.append(c.block_table[:width] + [0] * (width - len(c.block_table[:width])))
            decode_tables = torch.tensor(rows, dtype=torch.long, device=dev)
            if self.native is not None:
                decode_lens = torch.tensor(lengths, dtype=torch.long)
            elif min(lengths) != decode_len:
                valid = torch.arange(decode_len) < torch.tensor(lengths).unsqueeze(1)
                decode_mask = valid.view(len(lengths), 1, 1, decode_len).to(dev)
            sample_rows += [i for i, c in enumerate(batch.decodes) if c.sample]
        spans: list[PrefillSpan] = []
        offset = len(batch.decodes)
        for c in batch.prefills:
            n = len(c.token_ids)
            ids += c.token_ids
            positions += range(c.start, c.start + n)
            slots += [c.block_table[p // bs] * bs + p % bs for p in range(c.start, c.start + n)]
            span = PrefillSpan(offset, offset + n)
            total = c.start + n
            if self.native is not None:
                span.tables = torch.tensor(c.block_table[: -(-total // bs)], dtype=torch.long).expand(n, -1)
                span.lens = torch.arange(c.start + 1, total + 1, dtype=torch.long)
            elif c.start > 0:
                span.context_blocks = torch.tensor(
                    c.block_table[: -(-total // bs)], dtype=torch.long, device=dev
                )
                span.context_len = total
                causal = torch.arange(total).unsqueeze(0) <= torch.arange(c.start, total).unsqueeze(1)
                span.mask = causal.repeat_interleave(self.group, dim=0).to(dev)
            spans.append(span)
            offset += n
            if c.sample:
                sample_rows.append(offset - 1)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decodes=len(batch.decodes),
            decode_tables=decode_tables,
            decode_len=decode_len,
            decode_mask=decode_mask,
            prefills=spans,
            decode_lens=decode_lens,
            native=self.native,
        )
        return torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), meta, sample_rows

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> StepLogits:
        """Run one step: logits where chunks sample, and at every position of `all_logits` chunks."""
        for src, dst in batch.block_copies:
            self.kv_cache.copy_block(src, dst)
        input_ids, positions, meta, rows = self._metadata(batch)
        hidden = self.transformer.forward(input_ids, positions, meta, self.kv_cache)
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
        input_ids, positions, meta, _ = self._metadata(ForwardBatch(prefills=[chunk]))
        hidden = self.transformer.forward(input_ids, positions, meta, self.kv_cache)
        return self.transformer.logits(hidden).float().cpu()
