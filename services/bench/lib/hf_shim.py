"""A minimal OpenAI-compatible server around Hugging Face transformers: the baseline a user would
write in an afternoon, for `kvserve bench compare`.

    python -m kvserve.services.bench.lib.hf_shim --model GGUF --port P [--threads 2] [--max-batch 8]

Loads the GGUF with `AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=float32)` and
serves `POST /v1/completions` (streaming or not; `prompt` a string or a list of token ids, one
prompt per request; `max_tokens`; `ignore_eos`; greedy only; `stream_options.include_usage`),
`GET /v1/models` and `GET /health` with aiohttp.

Requests queue up; one worker thread takes what is queued (up to `--max-batch`, all with the same
`ignore_eos`) and runs it through one `model.generate` call as a static, left-padded batch for the
longest `max_tokens` among them; a request arriving meanwhile waits for the next batch. Each
generated token is streamed as it is made (a `BaseStreamer` hands the tokens to the event loop).
Stream chunks carry, beside OpenAI's `text`, a `token_ids` list (as vLLM's `return_token_ids`).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

DONE = object()  # end of a request's token stream


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    emitted: int = 0
    finished: bool = False
    finish_reason: str = "length"

    def send(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class BadRequest(ValueError):
    pass


class Generator:
    """The model, the tokenizer and the worker thread that batches queued jobs."""

    def __init__(self, model_path: Path, threads: int, max_batch: int) -> None:
        import torch
        import transformers

        torch.set_num_threads(threads)
        where, gguf = str(model_path.parent), model_path.name
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            where, gguf_file=gguf, dtype=torch.float32
        ).eval()
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(where, gguf_file=gguf)
        gen = self.model.generation_config
        eos = gen.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        pad = gen.pad_token_id if gen.pad_token_id is not None else next(iter(self.eos_ids), 0)
        self.pad_id = int(pad)
        self.vocab_size = int(self.model.config.vocab_size)
        self.context = int(getattr(self.model.config, "max_position_embeddings", 2048))
        self.max_batch = max_batch
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.thread = threading.Thread(target=self._work, name="hf-generate", daemon=True)
        self.thread.start()

    def _take_batch(self) -> list[Job]:
        first = self.jobs.get()
        batch: list[Job] = [first]
        later: list[Job] = []
        while len(batch) < self.max_batch:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            (batch if job.ignore_eos == first.ignore_eos else later).append(job)
        for job in later:  # a different ignore_eos waits for the next batch
            self.jobs.put(job)
        return batch

    def _work(self) -> None:
        while True:
            batch = self._take_batch()
            try:
                self._generate(batch)
            except Exception as exc:
                for job in batch:
                    if not job.finished:
                        job.send(exc)
            finally:
                for job in batch:
                    if not job.finished:
                        job.finished = True
                        job.send(DONE)

    def _generate(self, batch: list[Job]) -> None:
        """One greedy generate() over the batch (left-padded), each row's tokens streamed
        to its job."""
        torch = self.torch
        width = max(len(j.prompt) for j in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, job in enumerate(batch):
            ids[i, width - len(job.prompt) :] = torch.tensor(job.prompt, dtype=torch.long)
            mask[i, width - len(job.prompt) :] = 1
        config = copy.deepcopy(self.model.generation_config)
        if batch[0].ignore_eos:  # EOS may be generated, it just does not stop the row
            config.eos_token_id = None
        config.do_sample, config.temperature, config.top_p, config.top_k = False, None, None, None
        with torch.inference_mode():
            self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=config,
                max_new_tokens=max(j.max_tokens for j in batch),
                pad_token_id=self.pad_id,
                streamer=_streamer(batch, self.eos_ids),
            )

    def parse(self, body: dict[str, Any]) -> tuple[list[int], int, bool]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            ids = list(self.tokenizer(prompt)["input_ids"])
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            ids = list(prompt)
        elif isinstance(prompt, list) and len(prompt) == 1:
            return self.parse({**body, "prompt": prompt[0]})
        else:
            raise BadRequest("prompt must be a string or a non-empty list of token ids")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise BadRequest(f"token ids must be in [0, {self.vocab_size})")
        max_tokens = body.get("max_tokens", 16)
        if type(max_tokens) is not int or max_tokens < 1:
            raise BadRequest("max_tokens must be a positive integer")
        if len(ids) + max_tokens > self.context:
            raise BadRequest(f"prompt + max_tokens exceeds the context ({self.context})")
        temperature = body.get("temperature")
        if temperature not in (None, 0, 0.0):
            raise BadRequest("this shim is greedy only: temperature must be 0")
        if body.get("n", 1) != 1:
            raise BadRequest("n must be 1")
        return ids, max_tokens, bool(body.get("ignore_eos", False))


def _streamer(batch: list[Job], eos_ids: set[int]) -> Any:
    """A transformers streamer that hands each row's new token to its job and finishes a job
    at its max_tokens or (unless it ignores EOS) at an EOS token."""
    from transformers.generation.streamers import BaseStreamer

    class Streamer(BaseStreamer):
        prompt_seen = False

        def put(self, value: Any) -> None:
            if not self.prompt_seen:  # generate() first hands over the prompt
                self.prompt_seen = True
                return
            for job, tok in zip(batch, value.reshape(-1).tolist(), strict=True):
                if job.finished:
                    continue
                job.emitted += 1
                job.send(int(tok))
                if not job.ignore_eos and int(tok) in eos_ids:
                    job.finish_reason = "stop"
                if job.emitted >= job.max_tokens or job.finish_reason == "stop":
                    job.finished = True
                    job.send(DONE)

        def end(self) -> None:
            pass

    return Streamer()


def _chunk(rid: str, created: int, model: str, choices: list[Any]) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class _Completion:
    """One completion request's job and what has been sent of it: the tokens so far and the
    text they decode to (held back while it ends in an incomplete UTF-8 sequence)."""

    def __init__(self, gen: Generator, body: dict[str, Any], model_name: str) -> None:
        prompt, self.max_tokens, self.ignore_eos = gen.parse(body)
        self.gen = gen
        self.prompt = prompt
        self.job = Job(prompt, self.max_tokens, self.ignore_eos, asyncio.get_running_loop())
        self.rid, self.created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        self.model = str(body.get("model") or model_name)
        self.include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.tokens: list[int] = []
        self.sent_text = ""

    async def next_piece(self) -> tuple[list[int], str] | None:
        """The next token and the text it adds; None at the end."""
        item = await self.job.out.get()
        if item is DONE:
            return None
        if isinstance(item, Exception):
            raise item
        self.tokens.append(item)
        text = str(self.gen.tokenizer.decode(self.tokens, skip_special_tokens=False))
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the rest
            return [item], ""
        piece, self.sent_text = text[len(self.sent_text) :], text
        return [item], piece

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": len(self.prompt),
            "completion_tokens": len(self.tokens),
            "total_tokens": len(self.prompt) + len(self.tokens),
        }

    def chunk(self, choices: list[Any]) -> dict[str, Any]:
        return _chunk(self.rid, self.created, self.model, choices)

    async def reply(self) -> web.Response:
        while await self.next_piece() is not None:
            pass
        choice = {
            "index": 0,
            "text": self.sent_text,
            "token_ids": self.tokens,
            "logprobs": None,
            "finish_reason": self.job.finish_reason,
        }
        return web.json_response(self.chunk([choice]) | {"usage": self.usage()})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        resp.headers["Cache-Control"] = "no-cache"
        await resp.prepare(request)
        while (got := await self.next_piece()) is not None:
            ids, piece = got
            stop = not self.ignore_eos and ids[0] in self.gen.eos_ids
            last = stop or len(self.tokens) >= self.max_tokens
            choice = {
                "index": 0,
                "text": piece,
                "token_ids": ids,
                "logprobs": None,
                "finish_reason": ("stop" if stop else "length") if last else None,
            }
            chunk = self.chunk([choice])
            if self.include_usage:
                chunk["usage"] = None
            await resp.write(_sse(chunk))
        if self.include_usage:
            await resp.write(_sse(self.chunk([]) | {"usage": self.usage()}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def make_app(gen: Generator, model_name: str) -> web.Application:
    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(_: web.Request) -> web.Response:
        card = {
            "id": model_name,
            "object": "model",
            "created": 0,
            "owned_by": "hf-shim",
            "vocab_size": gen.vocab_size,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def completions(request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            completion = _Completion(gen, body, model_name)
        except (BadRequest, json.JSONDecodeError) as exc:
            err = {"message": str(exc), "type": "invalid_request_error", "code": 400}
            return web.json_response({"error": err}, status=400)
        gen.jobs.put(completion.job)
        return await (completion.stream(request) if body.get("stream") else completion.reply())

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return app


def build_parser() -> argparse.ArgumentParser:
    from kvserve.shared.config import default_model_path

    p = argparse.ArgumentParser(prog="python -m kvserve.services.bench.lib.hf_shim")
    p.add_argument("--model", type=Path, default=default_model_path(), help="GGUF file")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8002)
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--max-batch", type=int, default=8, help="requests per generate() call")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    gen = Generator(args.model, args.threads, args.max_batch)
    print(f"hf_shim: {args.model.name} on http://{args.host}:{args.port}", flush=True)
    web.run_app(make_app(gen, args.model.name), host=args.host, port=args.port, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
