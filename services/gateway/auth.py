"""API keys and cache salts.

When keys are configured, every /v1 route (and a vLLM alias of one outside /v1, such as
/reset_prefix_cache) needs `Authorization: Bearer <key>`. Each key is its own tenant for prefix
caching: its cache salt is `key-` + the first 32 hex digits of sha256(key), so two keys never
share a KV block and the salt reveals nothing of the key.

The presented token is compared in constant time: its SHA-256 digest against every configured
key's digest with `hmac.compare_digest`, all of them whatever matched, so the time a check
takes depends neither on how much of a key the token got right, nor on its length, nor on
which key it is. The token is never used as a dict key or compared with `==`.

A client's own `cache_salt` (vLLM's request field) can only narrow its partition: with keys it
is accepted when the gateway allows it and is appended to the key's salt (`{key salt}.{salt}`),
so a client can never step into another tenant's blocks; without keys it is used as given.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from kvserve.services.gateway.errors import APIError, bad_request
from kvserve.shared.store.hashing import InvalidSaltError, validate_cache_salt


def key_salt(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:32]


def _digest(text: str) -> bytes:
    # surrogateescape: a header's undecodable bytes come back as they were sent.
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()


class ApiKeys:
    def __init__(self, keys: Iterable[str] = (), allow_client_salt: bool = False) -> None:
        # (sha256(key), the key's cache salt) per distinct key; the keys themselves are not kept.
        unique = dict.fromkeys(k for k in keys if k)
        self._keys = [(_digest(k), key_salt(k)) for k in unique]
        self.allow_client_salt = allow_client_salt

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def authenticate(self, authorization: str | None) -> str | None:
        """The key's cache salt (None when no keys are configured); 401 otherwise."""
        if not self.enabled:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        salt = self._match(token) if scheme.lower() == "bearer" and token else None
        if salt is not None:
            return salt
        raise APIError(
            401,
            "Invalid or missing API key: send `Authorization: Bearer <key>`.",
            "authentication_error",
            None,
            "invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )

    def _match(self, token: str) -> str | None:
        """The salt of the key `token` equals, or None: one constant-time comparison of
        equal-length digests per configured key, every key compared."""
        presented = _digest(token)
        found = None
        for digest, salt in self._keys:
            if hmac.compare_digest(digest, presented):
                found = salt
        return found

    def effective_salt(self, tenant_salt: str | None, client_salt: str | None) -> str | None:
        if client_salt is None:
            return tenant_salt
        if tenant_salt is not None and not self.allow_client_salt:
            raise bad_request(
                "'cache_salt' is set by the server from the API key", "cache_salt", "not_allowed"
            )
        salt = client_salt if tenant_salt is None else f"{tenant_salt}.{client_salt}"
        try:
            validate_cache_salt(client_salt)  # on its own too: "" would leave "{key salt}."
            return validate_cache_salt(salt)
        except InvalidSaltError as e:
            raise bad_request(str(e), "cache_salt") from e
