"""The OpenAI-compatible HTTP gateway: validates and tokenizes requests, puts them on the bus,
streams token events back. Never imports torch (checked by a test)."""
