"""The bus between the gateway and the engine workers: the interface (base.py), the in-process
implementation (memory.py) and the Redis Streams one (redis.py, redis_port.py, redis_layout.py)."""
