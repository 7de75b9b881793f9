"""`pdserve.pinned.to_device_many`: several int lists through one buffer, each view holding its
list exactly and starting on a 16-byte boundary (what separate tensors give Triton kernels);
`pinned`: a CPU tensor's copy in pinned memory (on CUDA machines)."""

from __future__ import annotations

import pytest
import torch

from pdserve.pinned import host_tensor, pinned, to_device, to_device_many

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_views_hold_each_list_aligned(device: str, dtype: torch.dtype) -> None:
    lists = [[1, 2, 3], [], [7], list(range(10, 19)), [-5, 2**30]]
    views = to_device_many(lists, dtype, device)
    assert [v.tolist() for v in views] == lists
    for v in views:
        assert v.dtype == dtype and v.device.type == device and v.is_contiguous()
        assert v.data_ptr() % 16 == 0
    views[0][0] = 99  # a view writes only its own list
    assert [v.tolist() for v in views[1:]] == lists[1:]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32])
def test_host_tensor_is_torch_tensor_of_the_list(dtype: torch.dtype) -> None:
    for values in ([], [3], [-(2**31), 0, 2**31 - 1, 12, -7]):
        got, want = host_tensor(values, dtype), torch.tensor(values, dtype=dtype)
        assert got.dtype == want.dtype and torch.equal(got, want)
    with pytest.raises(OverflowError):
        host_tensor([2**63], torch.int64)


@pytest.mark.parametrize("device", DEVICES)
def test_to_device_takes_nested_lists(device: str) -> None:
    pairs = [(0, 9), (1, 0)]  # the sampler's blocked (row, token) pairs
    assert to_device(pairs, torch.int64, device).tolist() == [[0, 9], [1, 0]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_copies_into_pinned_memory() -> None:
    host = torch.arange(10, dtype=torch.int64)[::2]  # strided: copied contiguous
    out = pinned(host)
    assert out.is_pinned() and out.is_contiguous() and out.tolist() == host.tolist()
    assert to_device(host, torch.int32, "cuda").tolist() == host.tolist()
