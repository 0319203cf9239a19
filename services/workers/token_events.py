"""TokenEmitter: turns one request's RequestOutputs into numbered token events on the bus."""

from __future__ import annotations

from kvserve.shared.bus import WorkerPort, error_event
from kvserve.shared.engine.outputs import RequestOutput
from kvserve.shared.protocol import ErrorInfo, TokenEvent


class TokenEmitter:
    """Owns the request's event numbering: events carry seq 0, 1, 2, ... in emission order;
    one event per completion delta that has tokens, text or a finish reason. Counts what it
    emitted (output tokens, the latest cached-token count) for the request's span."""

    def __init__(self, port: WorkerPort, request_id: str, num_prompt_tokens: int) -> None:
        self.port = port
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.seq = 0
        self.output_tokens = 0
        self.cached_tokens = 0

    async def deltas(self, output: RequestOutput) -> None:
        self.cached_tokens = output.num_cached_tokens
        for c in output.completions:
            if not (c.token_ids or c.text or c.finish_reason):
                continue
            self.output_tokens += len(c.token_ids)
            await self.port.emit(
                TokenEvent(
                    request_id=self.request_id,
                    seq=self.seq,
                    index=c.index,
                    token_ids=list(c.token_ids),
                    text=c.text,
                    logprobs=[float(x) for x in c.logprobs],
                    top_logprobs=[
                        [[int(t), float(v)] for t, v in top.items()] for top in c.top_logprobs
                    ],
                    finish_reason=c.finish_reason,
                    num_prompt_tokens=self.num_prompt_tokens,
                    num_cached_tokens=output.num_cached_tokens,
                )
            )
            self.seq += 1

    async def error(self, info: ErrorInfo) -> None:
        """The request's terminal event."""
        await self.port.emit(error_event(self.request_id, self.seq, info))
        self.seq += 1
