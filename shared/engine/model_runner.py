"""ModelRunner: turns a Batch into tensors, runs the model over the paged cache, returns the
logits of the sequences that sample this step. The KVCache is the KVCacheManager's; the runner
makes the Batch's block copies in it and the model writes each step's K/V into it. The step's
integers (token ids, positions, slots, block tables, lengths) are built on the host; on a GPU they
reach the device in one copy that does not wait for it (`upload`), and the longest chunk and
sequence travel as Python ints, so the forward pass queues its work without a host sync."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from kvserve.kernels.backend import AttentionBackend
from kvserve.shared.engine.kv.cache import KVCache
from kvserve.shared.engine.scheduler import Batch, ScheduledSeq
from kvserve.shared.engine.sequence import Sequence
from kvserve.shared.engine.step_threads import threads
from kvserve.shared.model.attention import AttentionMetadata, OutputRows
from kvserve.shared.model.llama import LlamaModel, WholeStep


@dataclass(frozen=True)
class StepOutput:
    """Logits [rows, columns] (float32): one row per sequence of `sampling_seqs`, in order, or,
    for a sequence with draft tokens (`num_drafts[i]` > 0), 1 + num_drafts[i] rows: the
    logits after its last token and after each draft. Column j stands for token j, or for
    token `columns[j]` when `columns` is given (a simulated step's logits cover a few words
    only)."""

    sampling_seqs: list[Sequence]
    logits: torch.Tensor
    columns: tuple[int, ...] | None = None
    num_drafts: tuple[int, ...] | None = None  # None: no sequence has drafts
    # Each row's argmax and its logprob where the model call drew them (a run-ahead step of
    # greedy rows, `ModelRunner.run_ahead`): the sampler's greedy draw from `logits`, made.
    argmax: tuple[list[int], list[float]] | None = None

    def token_id(self, column: int) -> int:
        return column if self.columns is None else self.columns[column]

    def row_spans(self) -> list[tuple[int, int]]:
        """Each sampling sequence's [first, end) rows of `logits`."""
        spans = []
        at = 0
        for i in range(len(self.sampling_seqs)):
            n = 1 + (self.num_drafts[i] if self.num_drafts is not None else 0)
            spans.append((at, at + n))
            at += n
        return spans

    def without_finished(self) -> StepOutput:
        """The output less the rows of sequences that finished since the step was scheduled."""
        if not any(q.is_finished for q in self.sampling_seqs):
            return self
        keep = [i for i, q in enumerate(self.sampling_seqs) if not q.is_finished]
        spans = self.row_spans()
        rows = [r for i in keep for r in range(*spans[i])]
        drafts = self.num_drafts
        drawn = self.argmax
        return StepOutput(
            [self.sampling_seqs[i] for i in keep],
            self.logits[rows],
            self.columns,
            None if drafts is None else tuple(drafts[i] for i in keep),
            None if drawn is None else ([drawn[0][r] for r in rows], [drawn[1][r] for r in rows]),
        )

    def by_token_id(self) -> torch.Tensor:
        """The logits with column j standing for token j (-inf where `columns` has none)."""
        if self.columns is None:
            return self.logits
        width = max(self.columns) + 1
        out = torch.full((self.logits.shape[0], width), float("-inf"), dtype=self.logits.dtype)
        out[:, list(self.columns)] = self.logits
        return out


@dataclass(frozen=True)
class Prebuilt:
    """A run-ahead step's inputs made ahead (`ModelRunner.prebuild_ahead`), and what they hold
    for each sequence: itself, its row's position, its table's length and last block."""

    key: list[tuple[Sequence, int, int, int]]
    pos: torch.Tensor
    meta: AttentionMetadata
    whole: WholeStep | None  # the step as one C++ call (LlamaModel.whole_step), if it can be


def _ahead_key(decodes: list[ScheduledSeq]) -> list[tuple[Sequence, int, int, int]]:
    return [
        (s.seq, s.seq.num_computed_tokens + 1, len(s.seq.block_table), s.seq.block_table[-1])
        for s in decodes
    ]


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        backend: AttentionBackend,
        head_threads: int | None = None,
    ) -> None:
        """`head_threads`: the LM head's thread count whatever the step's (the CPU engine's
        every thread: a few rows of it read ~30 MB of weights, which one thread streams ~1.5x
        slower than two, where the layers of a one-token step may be faster on one)."""
        self.model = model
        self.cache = cache
        self.backend = backend
        self.head_threads = head_threads
        self._prebuilt: Prebuilt | None = None
        self.block_size = cache.block_size
        self.device = model.device

    def begin_step(self) -> None:
        """An engine step starts (a simulated runner times the whole step from here)."""

    def end_step(self) -> None:
        """The engine step's outputs are processed."""

    @torch.inference_mode()
    def run(self, batch: Batch, launched: Callable[[], None] | None = None) -> StepOutput:
        """Logits of the sequences that sample: the model computes its last layer only for
        their rows (the last token of each sampling chunk, every decode row). `launched` is
        called as the model's layers begin (LlamaModel.forward)."""
        prefills, decodes = self._split(batch)
        ordered = prefills + decodes
        sampling = [s for s in ordered if s.samples]
        if not sampling:
            self._run_model(batch, prefills, decodes, launched=launched)
            return StepOutput([], torch.empty((0, 0), device=self.device))
        hidden = self._run_model(batch, prefills, decodes, True, launched)
        drafts = tuple(s.num_drafts for s in sampling)
        return StepOutput(
            [s.seq for s in sampling],
            self._logits(hidden),
            num_drafts=drafts if any(drafts) else None,
        )

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head_threads is None:
            return self.model.compute_logits(hidden)
        with threads(self.head_threads):  # each logit by one thread: the same on any count
            return self.model.compute_logits(hidden)

    def run_ahead(
        self,
        batch: Batch,
        tokens: list[int],
        launched: Callable[[], None] | None = None,
        argmax: bool = False,
    ) -> StepOutput:
        """`run` for a step of single-token decodes made before the previous step's outputs:
        each sequence's row is `tokens[i]`, drawn but not yet appended, at the position after
        the previous step's row, which is not yet counted in `num_computed_tokens`. On the CPU
        the whole step is one C++ call where the model can make it (LlamaModel.decode_tokens),
        and with `argmax` (every row greedy) that call draws the rows' tokens as well; it
        makes no tensor autograd could track, so it runs outside inference mode (whose entry
        and exit cost ~30 us a step in caches the call has just swept)."""
        decodes = batch.scheduled
        seqs = [s.seq for s in decodes]
        prebuilt, self._prebuilt = self._prebuilt, None
        if prebuilt is None or prebuilt.key != _ahead_key(decodes):
            prebuilt = self._prebuild(decodes)
        if prebuilt.whole is not None:
            logits, drawn, logprobs = self.model.decode_tokens(
                tokens, prebuilt.whole, launched, self.head_threads, argmax
            )
            return StepOutput(seqs, logits, argmax=(drawn, logprobs) if argmax else None)
        with torch.inference_mode():
            (ids,) = upload([(tokens, torch.long)], self.device)
            hidden = self.model(
                ids, prebuilt.pos, prebuilt.meta, self.cache, self.backend, None, launched
            )
            return StepOutput(seqs, self._logits(hidden))

    def prebuild_ahead(self, batch: Batch) -> None:
        """The inputs of the next `run_ahead(batch, ...)` but its tokens, made while a model
        call runs (the emitter's work): used if the batch's sequences are then where they are
        now (the same positions and last blocks), dropped by any other step."""
        decodes = batch.scheduled
        bs = self.block_size
        if any((s.seq.num_computed_tokens + 1) // bs >= len(s.seq.block_table) for s in decodes):
            return  # a sequence needs a block first: not a step that runs ahead
        self._prebuilt = self._prebuild(decodes)

    def _prebuild(self, decodes: list[ScheduledSeq]) -> Prebuilt:
        pos, meta = self._ahead_inputs(decodes)
        whole = self.model.whole_step(pos, meta, self.cache, self.backend)
        return Prebuilt(_ahead_key(decodes), pos, meta, whole)

    def _ahead_inputs(self, decodes: list[ScheduledSeq]) -> tuple[torch.Tensor, AttentionMetadata]:
        """A run-ahead step's positions and attention metadata: one decode row a sequence, one
        position past its computed tokens."""
        bs = self.block_size
        pos = [s.seq.num_computed_tokens + 1 for s in decodes]
        slots = [
            s.seq.block_table[p // bs] * bs + p % bs for s, p in zip(decodes, pos, strict=True)
        ]
        tables = _tables(decodes)
        parts = [
            (pos, torch.long),
            (slots, torch.long),
            ([0], torch.int32),
            ([p + 1 for p in pos], torch.int32),
            (_flat(tables), torch.int32),
            ([], torch.int32),
        ]
        t_pos, t_slots, t_cu, t_ctx, t_tables, none = upload(parts, self.device)
        meta = AttentionMetadata(
            slot_mapping=t_slots,
            num_prefill_tokens=0,
            prefill_cu_query_lens=t_cu,
            prefill_context_lens=none,
            prefill_block_tables=none.view(0, 0),
            decode_context_lens=t_ctx,
            decode_block_tables=t_tables.view(len(tables), _width(tables)),
            prefill_max_query_len=0,
            max_seq_len=max(pos) + 1,
        )
        return t_pos, meta

    @torch.inference_mode()
    def forward(self, batch: Batch) -> tuple[list[ScheduledSeq], torch.Tensor]:
        """Run the model over the batch; returns the token order and hidden states [T, H]."""
        prefills, decodes = self._split(batch)
        return prefills + decodes, self._run_model(batch, prefills, decodes)

    @staticmethod
    def _split(batch: Batch) -> tuple[list[ScheduledSeq], list[ScheduledSeq]]:
        """Prefill chunks (more than one new token) first, then decodes: single tokens, and
        drafted decodes, whose last token and drafts are each a decode row at its own position
        (every row's K/V is written before any row attends, so row j sees rows 0..j: causal
        attention over the paged cache, as in a chunk, on the decode kernels)."""
        prefills = [s for s in batch.scheduled if s.num_new_tokens > 1 and not s.num_drafts]
        decodes = [s for s in batch.scheduled if s.num_new_tokens == 1 or s.num_drafts]
        return prefills, decodes

    def _run_model(
        self,
        batch: Batch,
        prefills: list[ScheduledSeq],
        decodes: list[ScheduledSeq],
        only_sampling: bool = False,
        launched: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        self._prebuilt = None  # a step not run ahead may change the tables
        for src, dst in batch.block_copies:
            self.cache.copy_block(src, dst)
        ids, pos, slots = self._flatten(prefills + decodes)
        cu = [0]
        for s in prefills:
            cu.append(cu[-1] + s.num_new_tokens)
        p_ctx, d_ctx = _context_lens(prefills), _decode_context_lens(decodes)
        p_tables, d_tables = _tables(prefills), _decode_tables(decodes)
        picked = self._output_rows(prefills, decodes) if only_sampling else None
        # Every integer the step needs, moved to the device together (one copy on a GPU).
        parts: dict[str, tuple[list[int], torch.dtype]] = {
            "ids": (ids, torch.long),
            "pos": (pos, torch.long),
            "slots": (slots, torch.long),
            "cu": (cu, torch.int32),
            "p_ctx": (p_ctx, torch.int32),
            "p_tables": (_flat(p_tables), torch.int32),
            "d_ctx": (d_ctx, torch.int32),
            "d_tables": (_flat(d_tables), torch.int32),
        }
        if picked is not None:  # the sampling rows' own metadata: their chunks, their decodes
            rows, chunks, keep = picked
            parts["rows"] = (rows, torch.long)
            parts["sub_p_ctx"] = ([p_ctx[i] for i in chunks], torch.int32)
            parts["sub_p_tables"] = (_flat([p_tables[i] for i in chunks]), torch.int32)
            parts["sub_d_ctx"] = ([d_ctx[j] for j in keep], torch.int32)
            parts["sub_d_tables"] = (_flat([d_tables[j] for j in keep]), torch.int32)
        t = dict(zip(parts, upload(list(parts.values()), self.device), strict=True))
        max_seq_len = max(p_ctx + d_ctx, default=0)
        meta = AttentionMetadata(
            slot_mapping=t["slots"],
            num_prefill_tokens=cu[-1],
            prefill_cu_query_lens=t["cu"],
            prefill_context_lens=t["p_ctx"],
            prefill_block_tables=t["p_tables"].view(len(p_tables), _width(p_tables)),
            decode_context_lens=t["d_ctx"],
            decode_block_tables=t["d_tables"].view(len(d_tables), _width(d_tables)),
            prefill_max_query_len=max((s.num_new_tokens for s in prefills), default=0),
            max_seq_len=max_seq_len,
        )
        out = None
        if picked is not None:
            _, chunks, keep = picked
            # Each sampling chunk as a one-token chunk (its last token) at its position.
            sub = AttentionMetadata(
                slot_mapping=meta.slot_mapping,  # unused: K/V are written for every token
                num_prefill_tokens=len(chunks),
                prefill_cu_query_lens=torch.arange(
                    len(chunks) + 1, dtype=torch.int32, device=self.device
                ),
                prefill_context_lens=t["sub_p_ctx"],
                prefill_block_tables=t["sub_p_tables"].view(len(chunks), _width(p_tables)),
                decode_context_lens=t["sub_d_ctx"],
                decode_block_tables=t["sub_d_tables"].view(len(keep), _width(d_tables)),
                prefill_max_query_len=1 if chunks else 0,
                max_seq_len=max_seq_len,
            )
            out = OutputRows(t["rows"], sub)
        return self.model(t["ids"], t["pos"], meta, self.cache, self.backend, out, launched)

    def _output_rows(
        self, prefills: list[ScheduledSeq], decodes: list[ScheduledSeq]
    ) -> tuple[list[int], list[int], list[int]] | None:
        """The sampling rows (each sampling chunk's last token, then the decode rows that
        sample), the prefill chunks they come from (indices into `prefills`) and the decode
        rows kept (indices into the step's decode rows). None when that is every row of the
        step (a step of decodes only, drafted or not)."""
        rows: list[int] = []
        chunks = []
        offset = 0
        for i, s in enumerate(prefills):
            offset += s.num_new_tokens
            if s.samples:
                rows.append(offset - 1)
                chunks.append(i)
        samples = [s.samples for s in decodes for _ in range(s.num_new_tokens)]
        keep = [j for j, sampled in enumerate(samples) if sampled]
        rows += [offset + j for j in keep]
        if len(rows) == offset + len(samples):
            return None
        return rows, chunks, keep

    def _flatten(self, ordered: list[ScheduledSeq]) -> tuple[list[int], list[int], list[int]]:
        """The step's token ids, positions and cache slots, token by token."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for s in ordered:
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            if s.num_drafts:  # the last token, then its drafts (never in token_ids)
                assert len(seq.draft_tokens) == s.num_drafts == end - seq.num_tokens
                ids.extend(seq.token_ids[start:])
                ids.extend(seq.draft_tokens)
            else:
                ids.extend(seq.token_ids[start:end])
            table = seq.block_table
            for p in range(start, end):
                pos.append(p)
                slots.append(table[p // bs] * bs + p % bs)
        return ids, pos, slots


def _context_lens(seqs: list[ScheduledSeq]) -> list[int]:
    """Tokens in the cache after this step, per sequence."""
    return [s.seq.num_computed_tokens + s.num_new_tokens for s in seqs]


def _decode_context_lens(decodes: list[ScheduledSeq]) -> list[int]:
    """Tokens in the cache up to each decode row: a drafted decode's rows see one more each."""
    return [s.seq.num_computed_tokens + r + 1 for s in decodes for r in range(s.num_new_tokens)]


def _decode_tables(decodes: list[ScheduledSeq]) -> list[list[int]]:
    """Each decode row's block table (a drafted decode's rows share their sequence's)."""
    return [
        t for s, t in zip(decodes, _tables(decodes), strict=True) for _ in range(s.num_new_tokens)
    ]


def _tables(seqs: list[ScheduledSeq]) -> list[list[int]]:
    """The block tables, each padded with block 0 to the longest."""
    width = max((len(s.seq.block_table) for s in seqs), default=0)
    return [s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in seqs]


def _width(rows: list[list[int]]) -> int:
    return len(rows[0]) if rows else 0


def _flat(rows: list[list[int]]) -> list[int]:
    return [x for row in rows for x in row]


ALIGN = 16  # bytes: where each tensor of an upload starts (Triton specialises on 16-byte alignment)


def upload(parts: list[tuple[list[int], torch.dtype]], device: torch.device) -> list[torch.Tensor]:
    """Integer lists as 1-D tensors of their dtypes on `device`. On the CPU each is a tensor of
    its own. Elsewhere they are laid out in one host buffer (pinned on CUDA), each part at a
    16-byte boundary, and moved in one copy that does not wait for the device (a copy from
    pageable memory, as `torch.tensor(values, device=...)` makes, waits for the device to
    finish its queue); each is a view of that one device buffer."""
    if device.type == "cpu":
        return [torch.tensor(values, dtype=dtype) for values, dtype in parts]
    host, spans = pack(parts, pin=device.type == "cuda")
    moved = host.to(device, non_blocking=True)
    return [moved[a:b].view(dtype) for (a, b), (_, dtype) in zip(spans, parts, strict=True)]


def pack(
    parts: list[tuple[list[int], torch.dtype]], pin: bool = False
) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The lists in one uint8 host buffer (pinned with `pin`), and each one's byte span in it:
    each part starts at a multiple of ALIGN bytes; parts of one dtype are written together."""
    flat: dict[torch.dtype, list[int]] = {}
    at: list[tuple[torch.dtype, int]] = []  # each part's dtype and first element in flat[dtype]
    for values, dtype in parts:
        buf = flat.setdefault(dtype, [])
        at.append((dtype, len(buf)))
        buf.extend(values)
        buf.extend([0] * (-len(buf) % (ALIGN // dtype.itemsize)))
    start: dict[torch.dtype, int] = {}
    total = 0
    for dtype, buf in flat.items():
        start[dtype] = total
        total += len(buf) * dtype.itemsize
    host = torch.empty(max(total, ALIGN), dtype=torch.uint8, pin_memory=pin)
    for dtype, buf in flat.items():
        if buf:
            a = start[dtype]
            region = host[a : a + len(buf) * dtype.itemsize]
            region.view(dtype).copy_(torch.tensor(buf, dtype=dtype))
    spans = []
    for (values, dtype), (_, first) in zip(parts, at, strict=True):
        a = start[dtype] + first * dtype.itemsize
        spans.append((a, a + len(values) * dtype.itemsize))
    return host, spans
