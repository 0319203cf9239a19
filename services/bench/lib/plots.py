"""What every benchmark plot does the same way: matplotlib without a display (imported only
when a plot is asked for), and a figure laid out, written as PNG and closed."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path | str, dpi: int = 110) -> None:
    """Lay `fig` out, write it to `path` (its folder made if needed) and close it."""
    path = Path(path)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
