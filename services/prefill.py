"""`kvserve prefill`: a prefill worker of the disaggregated topology (services/disagg.py)."""

from __future__ import annotations

import argparse

from kvserve.services.disagg import register_worker


def register(sub: argparse._SubParsersAction) -> None:
    register_worker(sub, "prefill")
