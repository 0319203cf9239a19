"""ModelRunner: turns a Batch into tensors, runs the model over the paged cache, returns the
logits of the sequences that sample this step. The KVCache is the KVCacheManager's; the runner
makes the Batch's block copies in it and the model writes each step's K/V into it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvserve.kernels.backend import AttentionBackend
from kvserve.shared.engine.kv.cache import KVCache
from kvserve.shared.engine.scheduler import Batch, ScheduledSeq
from kvserve.shared.engine.sequence import Sequence
from kvserve.shared.model.attention import AttentionMetadata, OutputRows
from kvserve.shared.model.llama import LlamaModel


@dataclass(frozen=True)
class StepOutput:
    """Logits [len(sampling_seqs), columns] (float32), row i for sampling_seqs[i]. Column j
    stands for token j, or for token `columns[j]` when `columns` is given (a simulated step's
    logits cover a few words only)."""

    sampling_seqs: list[Sequence]
    logits: torch.Tensor
    columns: tuple[int, ...] | None = None

    def token_id(self, column: int) -> int:
        return column if self.columns is None else self.columns[column]

    def by_token_id(self) -> torch.Tensor:
        """The logits with column j standing for token j (-inf where `columns` has none)."""
        if self.columns is None:
            return self.logits
        width = max(self.columns) + 1
        out = torch.full((self.logits.shape[0], width), float("-inf"), dtype=self.logits.dtype)
        out[:, list(self.columns)] = self.logits
        return out


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: KVCache, backend: AttentionBackend) -> None:
        self.model = model
        self.cache = cache
        self.backend = backend
        self.block_size = cache.block_size
        self.device = model.device

    def begin_step(self) -> None:
        """An engine step starts (a simulated runner times the whole step from here)."""

    def end_step(self) -> None:
        """The engine step's outputs are processed."""

    @torch.inference_mode()
    def run(self, batch: Batch) -> StepOutput:
        """Logits of the sequences that sample: the model computes its last layer only for
        their rows (the last token of each sampling chunk, every decode)."""
        prefills, decodes = self._split(batch)
        ordered = prefills + decodes
        sampling = [s.seq for s in ordered if s.samples]
        if not sampling:
            self._run_model(batch, prefills, decodes)
            return StepOutput([], torch.empty((0, 0), device=self.device))
        hidden = self._run_model(batch, prefills, decodes, only_sampling=True)
        return StepOutput(sampling, self.model.compute_logits(hidden))

    @torch.inference_mode()
    def forward(self, batch: Batch) -> tuple[list[ScheduledSeq], torch.Tensor]:
        """Run the model over the batch; returns the token order and hidden states [T, H]."""
        prefills, decodes = self._split(batch)
        return prefills + decodes, self._run_model(batch, prefills, decodes)

    @staticmethod
    def _split(batch: Batch) -> tuple[list[ScheduledSeq], list[ScheduledSeq]]:
        """Prefill chunks (more than one new token) first, then single-token decodes."""
        prefills = [s for s in batch.scheduled if s.num_new_tokens > 1]
        decodes = [s for s in batch.scheduled if s.num_new_tokens == 1]
        return prefills, decodes

    def _run_model(
        self,
        batch: Batch,
        prefills: list[ScheduledSeq],
        decodes: list[ScheduledSeq],
        only_sampling: bool = False,
    ) -> torch.Tensor:
        for src, dst in batch.block_copies:
            self.cache.copy_block(src, dst)
        input_ids, positions, slots = self._flatten(prefills + decodes)
        meta = self._metadata(prefills, decodes, slots)
        out = self._output_rows(prefills, decodes, meta) if only_sampling else None
        return self.model(input_ids, positions, meta, self.cache, self.backend, out)

    def _output_rows(
        self, prefills: list[ScheduledSeq], decodes: list[ScheduledSeq], meta: AttentionMetadata
    ) -> OutputRows | None:
        """The sampling rows (each sampling chunk's last token, then the decodes that sample)
        and attention metadata for them alone: each such chunk as a one-token chunk. None
        when that is every row of the step (a pure decode step)."""
        rows: list[int] = []
        chunks = []
        offset = 0
        for i, s in enumerate(prefills):
            offset += s.num_new_tokens
            if s.samples:
                rows.append(offset - 1)
                chunks.append(i)
        keep = [j for j, s in enumerate(decodes) if s.samples]
        rows += [offset + j for j in keep]
        if len(rows) == offset + len(decodes):
            return None
        dev = self.device
        pick = torch.tensor(chunks, dtype=torch.long, device=dev)
        dpick = torch.tensor(keep, dtype=torch.long, device=dev)
        sub = AttentionMetadata(
            slot_mapping=meta.slot_mapping,  # unused: K/V are written for every token
            num_prefill_tokens=len(chunks),
            prefill_cu_query_lens=torch.arange(len(chunks) + 1, dtype=torch.int32, device=dev),
            prefill_context_lens=meta.prefill_context_lens[pick],
            prefill_block_tables=meta.prefill_block_tables[pick],
            decode_context_lens=meta.decode_context_lens[dpick],
            decode_block_tables=meta.decode_block_tables[dpick],
        )
        return OutputRows(torch.tensor(rows, dtype=torch.long, device=dev), sub)

    def _flatten(
        self, ordered: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for s in ordered:
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            ids.extend(seq.token_ids[start:end])
            table = seq.block_table
            for p in range(start, end):
                pos.append(p)
                slots.append(table[p // bs] * bs + p % bs)
        dev = self.device
        return (
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
            torch.tensor(slots, dtype=torch.long, device=dev),
        )

    def _tables(self, seqs: list[ScheduledSeq]) -> torch.Tensor:
        width = max((len(s.seq.block_table) for s in seqs), default=0)
        rows = [s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in seqs]
        return torch.tensor(rows, dtype=torch.int32, device=self.device).reshape(len(seqs), width)

    def _metadata(
        self, prefills: list[ScheduledSeq], decodes: list[ScheduledSeq], slots: torch.Tensor
    ) -> AttentionMetadata:
        dev = self.device
        cu = [0]
        for s in prefills:
            cu.append(cu[-1] + s.num_new_tokens)

        def ctx(seqs: list[ScheduledSeq]) -> torch.Tensor:
            lens = [s.seq.num_computed_tokens + s.num_new_tokens for s in seqs]
            return torch.tensor(lens, dtype=torch.int32, device=dev)

        return AttentionMetadata(
            slot_mapping=slots,
            num_prefill_tokens=cu[-1],
            prefill_cu_query_lens=torch.tensor(cu, dtype=torch.int32, device=dev),
            prefill_context_lens=ctx(prefills),
            prefill_block_tables=self._tables(prefills),
            decode_context_lens=ctx(decodes),
            decode_block_tables=self._tables(decodes),
        )
