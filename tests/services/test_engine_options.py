"""The speculative decoding options (`--speculative ngram`, `--num-speculative-tokens`,
`--prompt-lookup-max`, `--prompt-lookup-min`): the SpeculativeConfig they make for `serve` and
the workers, the stack passing them to its workers, and one-line errors for bad values or
combinations."""

from __future__ import annotations

import pytest
from kvserve.services import engine_options, stack
from kvserve.services.cli import build_parser
from kvserve.shared.config import SpeculativeConfig

from tests.services.bench.cli_output import one_line_error

REDIS = "redis://127.0.0.1:6379/3"
WORKER = ["worker", "--bus", REDIS, "--store", REDIS]


def _config(argv: list[str]) -> SpeculativeConfig | None:
    args = build_parser(argv).parse_args(argv)
    engine_options.check_engine_arguments(args)
    speculative: SpeculativeConfig | None = engine_options.engine_config(args).speculative
    return speculative


def test_off_by_default_and_defaults_when_on() -> None:
    assert _config(["serve"]) is None
    assert _config(["serve", "--speculative", "ngram"]) == SpeculativeConfig(
        "ngram", num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=3
    )
    # the default shortest n-gram comes down to a shorter longest one
    assert _config(["serve", "--speculative", "ngram", "--prompt-lookup-max", "2"]) == (
        SpeculativeConfig(prompt_lookup_max=2, prompt_lookup_min=2)
    )


def test_serve_and_the_workers_take_them() -> None:
    flags = ["--speculative", "ngram", "--num-speculative-tokens", "6", "--prompt-lookup-max", "3"]
    want = SpeculativeConfig(num_speculative_tokens=6, prompt_lookup_max=3)
    assert _config(["serve", *flags]) == want
    for role in ("worker", "prefill", "decode"):
        assert _config([role, *WORKER[1:], *flags]) == want


def test_the_stack_gives_them_to_every_worker_only() -> None:
    argv = ["stack", "--redis", REDIS, "--workers", "2", "--speculative", "ngram",
            "--num-speculative-tokens", "3", "--prompt-lookup-min", "2"]  # fmt: skip
    gateway, *workers = stack.commands(build_parser(argv).parse_args(argv))
    assert "--speculative" not in gateway
    for w in workers:
        at = w.index("--speculative")
        assert w[at : at + 6] == [
            "--speculative", "ngram", "--num-speculative-tokens", "3", "--prompt-lookup-min", "2"
        ]  # fmt: skip
        args = build_parser(w[4:]).parse_args(w[4:])
        assert engine_options.speculative_config(args) == SpeculativeConfig(
            num_speculative_tokens=3, prompt_lookup_min=2
        )
    plain = ["stack", "--redis", REDIS]
    assert all(
        "--speculative" not in c for c in stack.commands(build_parser(plain).parse_args(plain))
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--num-speculative-tokens", "4"],
         "--num-speculative-tokens needs --speculative"),
        (["serve", "--prompt-lookup-max", "4"], "--prompt-lookup-max needs --speculative"),
        (["serve", "--speculative", "ngram", "--num-speculative-tokens", "0"],
         "--num-speculative-tokens must be in 1..16, got 0"),
        (["serve", "--speculative", "ngram", "--num-speculative-tokens", "17"],
         "--num-speculative-tokens must be in 1..16, got 17"),
        (["serve", "--speculative", "ngram", "--prompt-lookup-min", "0"],
         "--prompt-lookup-min must be >= 1"),
        (["serve", "--speculative", "ngram", "--prompt-lookup-min", "5"],
         "--prompt-lookup-min (5) must be <= --prompt-lookup-max (4)"),
        (["serve", "--speculative", "ngram", "--prompt-lookup-max", "2", "--prompt-lookup-min",
          "3"], "--prompt-lookup-min (3) must be <= --prompt-lookup-max (2)"),
        ([*WORKER, "--speculative", "ngram", "--simulate", "gpu"],
         "--speculative needs the real model"),
        ([*WORKER, "--prompt-lookup-min", "2"], "--prompt-lookup-min needs --speculative"),
        (["stack", "--redis", REDIS, "--speculative", "ngram", "--simulate", "gpu"],
         "--speculative needs the real model"),
        (["stack", "--redis", REDIS, "--num-speculative-tokens", "2"],
         "--num-speculative-tokens needs --speculative"),
        (["generate", "hello", "--num-speculative-tokens", "2"],
         "--num-speculative-tokens needs --speculative"),
    ],
)  # fmt: skip
def test_bad_values_one_line_error(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert message in one_line_error(argv, capsys)


def test_the_engine_config_refuses_a_simulated_engine_with_drafts() -> None:
    from kvserve.shared.config import EngineConfig, SimConfig

    with pytest.raises(ValueError, match="speculative decoding needs the real model"):
        EngineConfig(simulate=SimConfig("gpu"), speculative=SpeculativeConfig())
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be in 1\.\.16"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="min <= max"):
        SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2)


def test_async_scheduling_on_by_default_and_off_when_asked() -> None:
    for argv in (["serve"], WORKER):
        args = build_parser(argv).parse_args(argv)
        assert engine_options.engine_config(args).async_scheduling
        off = build_parser([*argv, "--no-async-scheduling"]).parse_args(
            [*argv, "--no-async-scheduling"]
        )
        assert not engine_options.engine_config(off).async_scheduling
