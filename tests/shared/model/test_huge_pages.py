"""Host memory on transparent huge pages: zero-filled mappings that start on a huge page's
boundary, gathered copies equal to their sources, and the model's linear weights read from
one such mapping (on huge pages where the kernel offers them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvserve.shared.model import huge_pages
from kvserve.shared.model.llama import LlamaModel
from kvserve.shared.model.loader import LoadedWeights

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_offered() -> bool:
    """Whether this kernel backs a region advised MADV_HUGEPAGE with huge pages."""
    if not THP_SETTING.exists():
        return False
    chosen = THP_SETTING.read_text().split("[")[1].split("]")[0]
    return chosen in ("always", "madvise")


def anon_huge_bytes(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_mapping_is_zero_filled_writable_and_starts_on_a_huge_page() -> None:
    m = huge_pages.mapping(3 * huge_pages.HUGE_PAGE + 5)
    assert (m.dtype, m.numel()) == (torch.uint8, 3 * huge_pages.HUGE_PAGE + 5)
    assert m.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert torch.count_nonzero(m) == 0
    m[-1] = 7
    assert int(m.sum()) == 7
    assert huge_pages.mapping(0).numel() == 0


@pytest.mark.skipif(not thp_offered(), reason="the kernel offers no transparent huge pages")
def test_a_written_mapping_lies_on_huge_pages() -> None:
    m = huge_pages.mapping(4 * huge_pages.HUGE_PAGE)
    m.fill_(1)
    assert anon_huge_bytes(m.data_ptr()) >= 2 * huge_pages.HUGE_PAGE


def test_gathered_copies_equal_their_sources_in_order_on_cache_lines() -> None:
    sources = [
        torch.randn(3, 5),
        torch.randint(0, 255, (7, 2, 9), dtype=torch.uint8),
        torch.randn(0),
        torch.randn(1000).to(torch.bfloat16),
    ]
    copies = huge_pages.gather(sources)
    for s, c in zip(sources, copies, strict=True):
        assert (c.shape, c.dtype, c.is_contiguous()) == (s.shape, s.dtype, True)
        assert torch.equal(c, s)
        assert c.data_ptr() != s.data_ptr() or s.numel() == 0
        assert c.data_ptr() % huge_pages.ALIGN == 0
    starts = [c.data_ptr() for c in copies if c.numel() > 0]  # an empty one has none
    assert starts == sorted(starts)
    copies[0].zero_()  # copies, not views of the sources
    assert torch.count_nonzero(sources[0]) > 0


def test_gather_refuses_a_strided_tensor() -> None:
    with pytest.raises(ValueError, match="contiguous CPU"):
        huge_pages.gather([torch.randn(4, 4).t()])


def test_the_models_linear_weights_lie_in_one_mapping_in_forward_order(
    weights: LoadedWeights,
) -> None:
    """One decode step reads them front to back (kernel tensors of the default model: the fp32
    panels, or the file's blocks where those are kept)."""
    model = LlamaModel(weights.config, weights.weights)
    tensors = [t for linear in model.linears() for t in linear.kernel_tensors()]
    tensors += model.lm_head.kernel_tensors()
    if not tensors:
        pytest.skip("no C++ kernels: the matmuls read oneDNN's or torch's copies")
    starts = [t.data_ptr() for t in tensors]
    assert starts == sorted(starts)
    end = tensors[-1].data_ptr() + tensors[-1].numel() * tensors[-1].element_size()
    assert end - starts[0] < sum(t.numel() * t.element_size() + 64 for t in tensors)
    if thp_offered():
        assert anon_huge_bytes(starts[0]) >= (end - starts[0]) // 2
