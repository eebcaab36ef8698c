"""`find_host_syncs` names every operation that would stop a graph capture, with the line that made it; it finds
them on the CPU, where the same code would sync once its tensors live on a GPU."""

import inspect

import pytest
import torch

from tendril.graphs.syncs import DATA_DEPENDENT_SHAPE, HOST_COPY, VALUE_READ, find_host_syncs


def _line(marker: str) -> int:
    source, start = inspect.getsourcelines(_syncing)
    return start + next(i for i, text in enumerate(source) if marker in text)


def _syncing(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    if y.sum() > 0:  # value-read
        y = y + 1
    kept = y[y > 0]  # boolean-index
    torch.nonzero(y)  # nonzero
    y.tolist()  # tolist
    y.repeat_interleave(torch.tensor([1, 2, 1, 1]))  # repeat
    y.repeat_interleave(torch.tensor([1, 2, 1, 1]), output_size=5)
    y.unique()  # unique
    return kept


def test_each_kind_of_sync_is_named_with_its_line():
    report = find_host_syncs(_syncing, torch.randn(4))
    found = {(sync.op, sync.reason, sync.where.rsplit(":", 1)[-1].split(" ")[0]) for sync in report.syncs}
    expected = {
        ("_local_scalar_dense", VALUE_READ, "value-read"),
        ("index", DATA_DEPENDENT_SHAPE, "boolean-index"),
        ("nonzero", DATA_DEPENDENT_SHAPE, "nonzero"),
        ("Tensor.tolist", VALUE_READ, "tolist"),
        ("repeat_interleave", DATA_DEPENDENT_SHAPE, "repeat"),
        ("_unique2", DATA_DEPENDENT_SHAPE, "unique"),
    }
    lines = {marker: str(_line(f"# {marker}")) for _, _, marker in expected}
    assert {(op, reason, lines[marker]) for op, reason, marker in expected} == found
    assert all(sync.count == 1 and "test_syncs.py" in sync.where for sync in report.syncs)
    assert "6 place(s)" in str(report)


def test_a_capturable_function_has_none_and_backward_passes_are_watched():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    report = find_host_syncs(lambda x: model(x).square().mean().backward(), torch.randn(3, 4))
    assert not report and str(report) == "no host syncs"

    class ReadsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * float(grad.abs().max())

    x = torch.randn(3, requires_grad=True)
    report = find_host_syncs(lambda: ReadsInBackward.apply(x).sum().backward())
    assert [sync.op for sync in report.syncs] == ["_local_scalar_dense"]
    assert "backward" in report.syncs[0].where


def test_syncs_inside_pytorch_are_placed_at_the_calling_line_and_via_pytorchs_own():
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    model(torch.randn(3, 4)).sum().backward()
    (sync,) = find_host_syncs(optimizer.step).syncs
    assert sync.op == "_local_scalar_dense" and sync.count == 2  # a step counter read per parameter
    assert "torch/optim" in sync.via and "torch" not in sync.where.split(":")[0]


@pytest.mark.gpu
def test_copies_of_cuda_tensors_to_the_host_are_named():
    x = torch.randn(4, device="cuda")
    report = find_host_syncs(lambda: (x.cpu(), x.to("cpu"), torch.empty(4).copy_(x), x.to("cuda")))
    assert {sync.reason for sync in report.syncs} == {HOST_COPY}
    assert sum(sync.count for sync in report.syncs) == 3
