"""The served model's routes: GET /v1/models and /v1/models/{model} (its card), POST /tokenize
and /detokenize (its tokenizer, as vLLM offers them). None of them touches the bus."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web
from kvserve.services.gateway.context import GatewayContext
from kvserve.services.gateway.schema import check_model, parse_detokenize, parse_tokenize


class ModelRoutes:
    """`started_at`: the card's `created`, the time the gateway was built."""

    def __init__(self, ctx: GatewayContext) -> None:
        self.ctx = ctx
        self.started_at = int(time.time())

    def _model_card(self) -> dict[str, Any]:
        model = self.ctx.model
        return {
            "id": model.name,
            "object": "model",
            "created": self.started_at,
            "owned_by": "kvserve",
            "root": model.path,
            "parent": None,
            "max_model_len": model.max_model_len,
        }

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def get_model(self, request: web.Request) -> web.Response:
        check_model({"model": request.match_info["model"]}, self.ctx.model)
        return web.json_response(self._model_card())

    async def tokenize(self, request: web.Request) -> web.Response:
        model = self.ctx.model
        ids, token_strs = parse_tokenize(await self.ctx.json_body(request), model)
        out: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": model.max_model_len,
            "tokens": ids,
        }
        if token_strs:
            out["token_strs"] = [model.tokenizer.id_to_token(t) for t in ids]
        return web.json_response(out)

    async def detokenize(self, request: web.Request) -> web.Response:
        ids = parse_detokenize(await self.ctx.json_body(request), self.ctx.model)
        return web.json_response({"prompt": self.ctx.model.tokenizer.decode(ids)})
