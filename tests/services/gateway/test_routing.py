"""RoutingService's choice of role in the disaggregated topology: a request whose predicted
uncached part is shorter than --pd-threshold goes to a decode worker (the one holding its
blocks), the prefill worker's decision withdrawn as if never made; longer ones, or any without
a decode worker, go to prefill."""

from __future__ import annotations

from typing import Any

import pytest
from kvserve.services.gateway.router import Router
from kvserve.services.gateway.routing import RoutingService
from prometheus_client import CollectorRegistry

from tests.services.gateway.test_router import hashes, info, stored


def service(threshold: int, *roles: tuple[str, str]) -> RoutingService:
    router = Router()
    router.set_workers({name: info(name, role=role) for name, role in roles}, {})
    return RoutingService(Any, router, CollectorRegistry(), pd_threshold=threshold)  # type: ignore[arg-type]


PD = (("P", "prefill"), ("D1", "decode"), ("D2", "decode"))


def test_a_short_uncached_part_skips_the_prefill_worker() -> None:
    routing = service(8, *PD)
    prompt = list(range(1, 30))  # 28 tokens matchable: 7 blocks of 4
    routing.router.apply([stored("P", 0, hashes(prompt[:24])), stored("D2", 0, hashes(prompt[:8]))])
    decision = routing.route(prompt, None)  # prefill would compute 29 - 24 = 5 tokens < 8
    assert decision is not None and (decision.worker, decision.role) == ("D2", "decode")
    assert decision.reason == "short-prefill"
    stats = routing.router.stats()
    assert stats["decisions"] == {"short-prefill": 1}  # the prefill decision withdrawn
    assert stats["workers"]["P"]["in_flight"] == 0 and stats["workers"]["D2"]["in_flight"] == 1


def test_a_long_uncached_part_is_prefilled_by_a_prefill_worker() -> None:
    routing = service(8, *PD)
    decision = routing.route(list(range(1, 30)), None)  # nothing cached: 29 tokens to compute
    assert decision is not None and (decision.worker, decision.role) == ("P", "prefill")
    assert routing.router.stats()["workers"]["D1"]["in_flight"] == 0


def test_without_a_threshold_or_a_decode_worker_every_request_is_prefilled() -> None:
    for routing in (service(0, *PD), service(64, PD[0])):
        decision = routing.route(list(range(1, 6)), None)
        assert decision is not None and decision.role == "prefill"


def test_router_store_cost_flag_is_auto_or_a_fraction() -> None:
    import argparse

    from kvserve.services.gateway.main import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["gateway", "--bus", "redis://h:1/0"])
    assert args.router_store_cost == 0.2
    assert (
        parser.parse_args(
            ["gateway", "--bus", "b", "--router-store-cost", "auto"]
        ).router_store_cost
        is None
    )
    assert (
        parser.parse_args(["gateway", "--bus", "b", "--router-store-cost", "0.5"]).router_store_cost
        == 0.5
    )
    for bad in ("1.5", "-0.1", "nan", "cheap"):
        with pytest.raises(SystemExit):
            parser.parse_args(["gateway", "--bus", "b", "--router-store-cost", bad])
