"""ModelRunner: owns the weights and the KV memory, turns one scheduled step into one forward pass."""

from dataclasses import dataclass, field

import torch

from kvserve.model.attention import AttentionMetadata, KVCache, PrefillSpan
from kvserve.model.loader import LoadedModel
from kvserve.model.transformer import Transformer

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class SequenceChunk:
    """Tokens of one request to run this step: `token_ids` sit at positions start, start+1, ...

    `block_table` must already cover every position up to start + len(token_ids). When `sample` is set,
    the logits of the last token are returned.
    """

    token_ids: list[int]
    start: int
    block_table: list[int]
    sample: bool


@dataclass
class ForwardBatch:
    decodes: list[SequenceChunk] = field(default_factory=list)
    prefills: list[SequenceChunk] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(len(c.token_ids) for c in self.prefills)


class ModelRunner:
    def __init__(self, model: LoadedModel, num_blocks: int, block_size: int, max_model_len: int, device: str, dtype: str):
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.block_size = block_size
        c = model.config
        self.transformer = Transformer(c, model.weights, max_model_len, self.device, self.dtype)
        self.kv_cache = KVCache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, self.device, self.dtype)

    def _slots(self, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return block_table[positions // self.block_size] * self.block_size + positions % self.block_size

    def _metadata(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        dev = self.device
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        sample_rows: list[int] = []
        decode_slots = decode_mask = None
        if batch.decodes:
            ids += [c.token_ids[0] for c in batch.decodes]
            lengths = torch.tensor([c.start + 1 for c in batch.decodes])
            max_blocks = max(len(c.block_table) for c in batch.decodes)
            tables = torch.zeros(len(batch.decodes), max_blocks, dtype=torch.long)
            for row, c in enumerate(batch.decodes):
                tables[row, : len(c.block_table)] = torch.tensor(c.block_table)
            longest = int(lengths.max())
            grid = (tables.unsqueeze(-1) * self.block_size + torch.arange(self.block_size)).view(len(tables), -1)
            decode_slots = grid[:, :longest].contiguous().to(dev)
            pos = lengths - 1
            positions.append(pos)
            slots.append(grid.gather(1, pos.unsqueeze(1)).squeeze(1))
            if int(lengths.min()) != longest:
                decode_mask = (torch.arange(longest) < lengths.unsqueeze(1)).view(len(tables), 1, 1, longest).to(dev)
            sample_rows += [i for i, c in enumerate(batch.decodes) if c.sample]
        spans: list[PrefillSpan] = []
        offset = len(batch.decodes)
        for c in batch.prefills:
            n = len(c.token_ids)
            ids += c.token_ids
            table = torch.tensor(c.block_table, dtype=torch.long)
            pos = torch.arange(c.start, c.start + n)
            positions.append(pos)
            slots.append(self._slots(table, pos))
            context = mask = None
            if c.start > 0:
                context = self._slots(table, torch.arange(c.start + n)).to(dev)
                mask = (torch.arange(c.start + n).unsqueeze(0) <= pos.unsqueeze(1)).to(dev)
            spans.append(PrefillSpan(offset, offset + n, context, mask))
            offset += n
            if c.sample:
                sample_rows.append(offset - 1)
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots).to(dev),
            num_decodes=len(batch.decodes),
            decode_slots=decode_slots,
            decode_mask=decode_mask,
            prefills=spans,
        )
        return torch.tensor(ids, device=dev), torch.cat(positions).to(dev), meta, sample_rows

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one step; returns float32 logits [num sampled chunks, vocab], decodes first, then prefills."""
        for src, dst in batch.block_copies:
            self.kv_cache.copy_block(src, dst)
        input_ids, positions, meta, rows = self._metadata(batch)
        hidden = self.transformer.forward(input_ids, positions, meta, self.kv_cache)
        if not rows:
            return torch.empty(0, self.transformer.config.vocab_size)
        return self.transformer.logits(hidden[rows]).float()
