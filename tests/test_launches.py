"""``measure.launches.count_launches``: what it counts as a kernel, a sync and a call site, on the CPU.

The interpreter test (``test_kernel_path.py``) counts Triton launches; here the ATen side: ops that compute
count once each, views and allocations never, host reads of a tensor are syncs, and the patching of Triton's
launchers is undone on the way out (also when the block raises).
"""

from __future__ import annotations

import pytest
import torch

from dflash_lab.layers import RMSNorm
from dflash_lab.measure.launches import count_launches


def test_compute_ops_count_views_and_allocations_do_not():
    x = torch.randn(4, 6)
    with count_launches() as seen:
        y = x + 1                      # add
        z = y.view(-1).t().unsqueeze(0)  # views
        torch.empty(3)                 # an allocation
        s = (z * 2).sum()              # mul, sum
    assert dict(seen.counts) == {"add": 1, "mul": 1, "sum": 1}
    assert seen.total == 3 and not seen.syncs
    assert s.item() == pytest.approx(float(((x + 1) * 2).sum()))


def test_host_reads_are_syncs_and_sites_name_the_labs_line():
    norm = RMSNorm(8, 1e-6)
    x = torch.randn(2, 8)
    with count_launches(where=True) as seen:
        y = norm(x)
        y.sum().item()
        y.tolist()
    assert sum(seen.syncs.values()) >= 1
    assert any(site.startswith("layers.py:") for site, _ in seen.sites), seen.sites
    assert sum(seen.sites.values()) == sum(seen.counts.values())


def test_host_free_drops_ops_whose_tensors_are_all_on_the_host():
    with count_launches(host_free=True) as seen:
        torch.randn(5).exp()
    assert seen.total == 0


def test_triton_launchers_are_restored_even_when_the_block_raises():
    jit = pytest.importorskip("triton.runtime.jit")
    interp = pytest.importorskip("triton.runtime.interpreter")
    before = (jit.JITFunction.run, interp.InterpretedFunction.run)
    with pytest.raises(RuntimeError, match="inside"):
        with count_launches():
            assert jit.JITFunction.run is not before[0]
            raise RuntimeError("inside")
    assert (jit.JITFunction.run, interp.InterpretedFunction.run) == before
