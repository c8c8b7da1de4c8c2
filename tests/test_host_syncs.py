"""The host-sync counter of ``tests/support/host_syncs.py`` sees what it claims to, in-place mask writes included."""

from __future__ import annotations

import torch

from tests.support.host_syncs import host_syncs


def test_a_boolean_mask_write_is_counted():
    x, mask = torch.zeros(4), torch.tensor([True, False, True, False])

    def write():
        x[mask] = 1.0  # aten.index_put_: a nonzero inside on CUDA

    _, counts = host_syncs(write)
    assert counts == {"index_put(bool mask)": 1}


def test_an_integer_index_write_is_not():
    x, idx = torch.zeros(4), torch.tensor([0, 2])

    def write():
        x[idx] = 1.0

    _, counts = host_syncs(write)
    assert not counts
