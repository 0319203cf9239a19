"""CostProfile: what a simulated engine's steps and store transfers cost, in a few terms a person
can read.

A step's time is linear in the batch's shape (the form BLIS and Vidur fit, with the attention
terms split by kind):

    seconds = base_s
            + per_token_s          * new tokens (every row through the linear layers)
            + per_prefill_pair_s   * (query, key) pairs of the prompt chunks' attention
            + per_decode_context_s * context tokens the decode rows read
            + per_sampled_row_s    * rows whose logits are computed and sampled
            + mixed_step_s         * (1 if the step holds a prompt chunk, else 0)

A store transfer costs `rtt_s` per call plus `load_s_per_block` (get, verify, decode, write into
the cache) or `write_s_per_block` (encode, put) per block of the modelled model's true size.

A profile is JSON (`CostProfile.from_json`); every field is required, and a file that does not
parse, or lacks or mistypes a field, is a ProfileError whose one-line message names the field.
Shipped profiles live beside this module (`gpu`); `cpu` is the last `kvserve bench calibrate`
of this machine (`<cache dir>/profiles/cpu.json`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from kvserve.shared.config import cache_dir

PROFILE_VERSION = 1
SHIPPED = {"gpu": "gpu-llama3-8b-h100.json"}
CPU_PROFILE = "cpu"  # the last `kvserve bench calibrate` of this machine
SOURCES = ("measured", "published")
KV_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "fp8": 1}


class ProfileError(ValueError):
    """A profile that cannot be used; the message is one line naming the file and the field."""


@dataclass(frozen=True)
class StepShape:
    """The features of one step's batch that its modelled time depends on."""

    tokens: int = 0  # new tokens, every row
    prefill_pairs: int = 0  # (query, key) pairs of the prompt chunks (more than one new token)
    decode_context: int = 0  # context tokens the single-token rows attend to
    sampled_rows: int = 0  # rows whose logits are computed
    prefill_chunks: int = 0  # rows with more than one new token
    decode_rows: int = 0  # rows with one new token

    @classmethod
    def of_rows(cls, rows: list[tuple[int, int, bool]]) -> StepShape:
        """From (new tokens, tokens already computed, samples) per scheduled sequence."""
        tokens = pairs = context = sampled = chunks = decodes = 0
        for new, done, samples in rows:
            tokens += new
            sampled += samples
            if new > 1:
                chunks += 1
                # query i of the chunk sees the `done` earlier tokens and the chunk up to itself
                pairs += new * done + new * (new + 1) // 2
            else:
                decodes += 1
                context += done + new
        return cls(tokens, pairs, context, sampled, chunks, decodes)


@dataclass(frozen=True)
class StepCost:
    """Seconds per unit of each feature of a step (see the module docstring)."""

    base_s: float
    per_token_s: float
    per_prefill_pair_s: float
    per_decode_context_s: float
    per_sampled_row_s: float
    mixed_step_s: float

    def seconds(self, shape: StepShape) -> float:
        return (
            self.base_s
            + self.per_token_s * shape.tokens
            + self.per_prefill_pair_s * shape.prefill_pairs
            + self.per_decode_context_s * shape.decode_context
            + self.per_sampled_row_s * shape.sampled_rows
            + (self.mixed_step_s if shape.prefill_chunks else 0.0)
        )

    def terms(self, shape: StepShape) -> list[float]:
        """The feature vector the coefficients multiply (for fitting), in field order."""
        return [
            1.0,
            float(shape.tokens),
            float(shape.prefill_pairs),
            float(shape.decode_context),
            float(shape.sampled_rows),
            1.0 if shape.prefill_chunks else 0.0,
        ]


@dataclass(frozen=True)
class StoreCost:
    """A store transfer of blocks of the modelled model's true size."""

    rtt_s: float  # one round trip (a presence probe, a get or put call)
    load_s_per_block: float  # get, verify, decode and write into the cache
    write_s_per_block: float  # encode and put
    frame_bytes_per_token: float  # an encoded frame's bytes per token in the store


@dataclass(frozen=True)
class ModelledModel:
    """The model whose cost the profile gives: its KV geometry and context window."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str  # one of KV_DTYPE_BYTES
    max_model_len: int

    @property
    def kv_bytes_per_token(self) -> int:
        per_layer = 2 * self.num_kv_heads * self.head_dim * KV_DTYPE_BYTES[self.kv_dtype]
        return self.num_layers * per_layer


@dataclass(frozen=True)
class EngineShape:
    """The modelled engine's KV capacity and scheduler limits (a simulated worker runs the
    real scheduler with these)."""

    num_blocks: int
    block_size: int
    host_tier_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_prefill_chunk: int


@dataclass(frozen=True)
class CostProfile:
    """`source`: "measured" (fitted by `kvserve bench calibrate` on `machine`) or "published"
    (taken from the figures `reference` names, not measured here)."""

    name: str
    source: str
    machine: str
    reference: str
    model: ModelledModel
    engine: EngineShape
    step: StepCost
    store: StoreCost

    def step_seconds(self, shape: StepShape) -> float:
        return max(0.0, self.step.seconds(shape))

    def to_json(self, extra: dict[str, Any] | None = None) -> str:
        """The profile as JSON (`extra`: more top-level keys, such as the fit's points; a key
        that names a field of the profile is a ValueError, never a silent replacement)."""
        body = {"version": PROFILE_VERSION, **asdict(self)}
        clash = set(body) & set(extra or {})
        if clash:
            raise ValueError(f"extra keys would replace the profile's own: {sorted(clash)}")
        return json.dumps({**body, **(extra or {})}, indent=2)

    @classmethod
    def from_json(cls, text: str, origin: str = "profile") -> CostProfile:
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ProfileError(f"{origin}: not JSON ({e})") from None
        return _Reader(origin).profile(raw)

    @classmethod
    def load(cls, name_or_path: str) -> CostProfile:
        """A shipped profile by name (`gpu`), `cpu` (this machine's calibration), or a file."""
        path = profile_path(name_or_path)
        try:
            text = path.read_text()
        except OSError as e:
            hint = " (run `kvserve bench calibrate` first)" if name_or_path == CPU_PROFILE else ""
            why = f"profile {name_or_path}: cannot read {path}: {e.strerror}{hint}"
            raise ProfileError(why) from None
        return cls.from_json(text, str(path))


def profile_path(name_or_path: str) -> Path:
    if name_or_path in SHIPPED:
        return Path(__file__).parent / "profiles" / SHIPPED[name_or_path]
    if name_or_path == CPU_PROFILE:
        return calibrated_path()
    return Path(name_or_path)


def calibrated_path() -> Path:
    """Where `kvserve bench calibrate` keeps this machine's latest profile (`cpu`)."""
    return cache_dir() / "profiles" / "cpu.json"


T = TypeVar("T")


class _Reader:
    """Reads a profile's JSON, naming the field of the first problem it meets."""

    def __init__(self, origin: str) -> None:
        self.origin = origin

    def fail(self, path: str, why: str) -> ProfileError:
        return ProfileError(f"{self.origin}: field '{path}' {why}")

    def profile(self, raw: Any) -> CostProfile:
        if not isinstance(raw, dict):
            raise ProfileError(f"{self.origin}: a profile is a JSON object")
        version = raw.get("version")
        if version != PROFILE_VERSION:
            raise self.fail("version", f"must be {PROFILE_VERSION}, got {version!r}")
        prof = CostProfile(
            name=self.text(raw, "name"),
            source=self.text(raw, "source"),
            machine=self.text(raw, "machine"),
            reference=self.text(raw, "reference"),
            model=self.section(raw, "model", ModelledModel),
            engine=self.section(raw, "engine", EngineShape),
            step=self.section(raw, "step", StepCost),
            store=self.section(raw, "store", StoreCost),
        )
        if prof.source not in SOURCES:
            raise self.fail("source", f"must be one of {SOURCES}, got {prof.source!r}")
        if prof.model.kv_dtype not in KV_DTYPE_BYTES:
            raise self.fail("model.kv_dtype", f"must be one of {tuple(KV_DTYPE_BYTES)}")
        return prof

    def text(self, raw: dict[str, Any], key: str, path: str = "") -> str:
        name = path + key
        if key not in raw:
            raise self.fail(name, "is missing")
        if not isinstance(raw[key], str):
            raise self.fail(name, "must be a string")
        return str(raw[key])

    def section(self, raw: dict[str, Any], key: str, kind: type[T]) -> T:
        body = raw.get(key)
        if not isinstance(body, dict):
            raise self.fail(key, "is missing" if body is None else "must be an object")
        values: dict[str, Any] = {}
        for f in fields(kind):  # type: ignore[arg-type]
            name = f"{key}.{f.name}"
            if f.type == "str":
                values[f.name] = self.text(body, f.name, f"{key}.")
            elif f.type == "int":
                values[f.name] = self.count(body, f.name, name)
            else:
                values[f.name] = self.number(body, f.name, name)
        return kind(**values)

    def count(self, body: dict[str, Any], key: str, name: str) -> int:
        v = body.get(key)
        if v is None:
            raise self.fail(name, "is missing")
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise self.fail(name, f"must be an integer >= 1, got {v!r}")
        return v

    def number(self, body: dict[str, Any], key: str, name: str) -> float:
        v = body.get(key)
        if v is None:
            raise self.fail(name, "is missing")
        ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        if not ok or v < 0:
            raise self.fail(name, f"must be a finite number >= 0, got {v!r}")
        return float(v)
