"""The OpenAPI document the gateway serves, as built for a configuration: valid OpenAPI that
schemathesis loads (path parameters declared), the success status each route answers,
security and 401 only with API keys, the served model's names, the cache-salt policy, and
request schemas that say what the validation says."""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from kvserve.services.gateway.app import Gateway, GatewayConfig
from kvserve.services.gateway.schema import ModelInfo
from kvserve.shared.bus.memory import InProcessBus
from kvserve.shared.model.tokenizer import KVTokenizer


def document(tokenizer: KVTokenizer, **config: Any) -> dict[str, Any]:
    info = ModelInfo("m", tokenizer, 8192, 49152, aliases=("m-alias",))
    return Gateway(GatewayConfig(**config), InProcessBus(), info).openapi


def body_schema(doc: dict[str, Any], method: str, path: str) -> dict[str, Any]:
    op = doc["paths"][path][method]
    return dict(op["requestBody"]["content"]["application/json"]["schema"])


@pytest.mark.parametrize(
    "config",
    [{}, {"api_keys": ("k",)}, {"api_keys": ("k",), "allow_client_cache_salt": True}],
)
def test_every_operation_loads_in_schemathesis(
    tokenizer: KVTokenizer, config: dict[str, Any]
) -> None:
    schema = schemathesis.openapi.from_dict(document(tokenizer, **config))
    operations = [result.ok() for result in schema.get_all_operations()]  # raises when invalid
    assert len(operations) == 16


def test_statuses_path_parameters_and_models(tokenizer: KVTokenizer) -> None:
    doc = document(tokenizer)
    assert set(doc["paths"]["/v1/cache/warmup"]["post"]["responses"]) == {
        "202", "400", "413", "429", "503"
    }  # fmt: skip
    for path, name in (("/v1/models/{model}", "model"), ("/v1/cache/warmup/{id}", "id")):
        (param,) = doc["paths"][path]["get"]["parameters"]
        assert param["name"] == name and param["in"] == "path" and param["required"] is True
    model = doc["paths"]["/v1/models/{model}"]["get"]["parameters"][0]["schema"]
    assert model["enum"] == ["m", "m-alias"]
    ready = doc["paths"]["/ready"]["get"]["responses"]["503"]["content"]["application/json"]
    assert ready["schema"]["properties"]["status"]["enum"] == [
        "starting", "draining", "bus_unavailable"
    ]  # fmt: skip


def test_security_and_401_only_with_api_keys(tokenizer: KVTokenizer) -> None:
    open_doc = document(tokenizer)
    keyed = document(tokenizer, api_keys=("k",))
    stats = "/v1/cache/stats"
    assert "security" not in open_doc["paths"][stats]["get"]
    assert "401" not in open_doc["paths"][stats]["get"]["responses"]
    assert "securitySchemes" not in open_doc["components"]
    assert keyed["paths"][stats]["get"]["security"] == [{"bearer": []}]
    assert "401" in keyed["paths"][stats]["get"]["responses"]
    assert "security" not in keyed["paths"]["/tokenize"]["post"]
    assert keyed["paths"]["/reset_prefix_cache"]["post"]["security"] == [{"bearer": []}]


def test_cache_salt_follows_the_key_policy(tokenizer: KVTokenizer) -> None:
    def salt(**config: Any) -> dict[str, Any]:
        props = body_schema(document(tokenizer, **config), "post", "/v1/completions")
        return dict(props["properties"]["cache_salt"])

    assert salt()["anyOf"][0]["maxLength"] == 128
    # "key-" + 32 hex digits + "." leave 91 of the 128 characters to the client.
    assert salt(api_keys=("k",), allow_client_cache_salt=True)["anyOf"][0]["maxLength"] == 91
    assert salt(api_keys=("k",))["type"] == "null"


def test_request_schemas_state_the_validation(tokenizer: KVTokenizer) -> None:
    doc = document(tokenizer)
    tokenize = body_schema(doc, "post", "/tokenize")
    assert tokenize["oneOf"] == [{"required": ["prompt"]}, {"required": ["messages"]}]
    chat = body_schema(doc, "post", "/v1/chat/completions")
    assert chat["properties"]["messages"]["minItems"] == 1
    assert set(chat["dependentSchemas"]) == {"stream_options", "top_logprobs"}
    prompt = body_schema(doc, "post", "/v1/completions")["properties"]["prompt"]["oneOf"]
    assert prompt[0] == {"type": "string"}  # "" too: the document-start token
    assert prompt[1]["items"] == {"type": "string"}
    assert prompt[2]["items"] == {"type": "integer", "minimum": 0, "maximum": 49151}
    warmup = body_schema(doc, "post", "/v1/cache/warmup")["properties"]["prefixes"]
    message = warmup["items"]["properties"]["messages"]["items"]
    assert message["required"] == ["role", "content"]
