"""On the GPU: graphs read module tensors where they were at capture, in the modes the modules were in, so after a
replacement or a move (whose old memory is freed and reused) or a mode flip a graphed module and `tendril.generate`
capture again and give eager's answer."""

import pytest
import torch
from torch import nn

from tendril.generation import generate
from tendril.generation.api import graphed_runners
from tendril.graphs.callable import graphed
from tendril.graphs.module_state import ModuleChangedWarning
from tests.fuzz.bad_inputs import fill_freed_memory
from tests.generation.models import left_padded, tiny_model

pytestmark = pytest.mark.gpu


def test_a_graphed_module_gives_eager_answers_after_its_weights_are_replaced_and_moved():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).cuda()
    fast = graphed(model)
    x = torch.randn(4, 64, device="cuda")
    with torch.inference_mode():
        fast(x)
        fast(x)
        model.load_state_dict(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).state_dict(), assign=True)
        model.cuda()
        filler = fill_freed_memory("cuda")
        with pytest.warns(ModuleChangedWarning, match="replaced|moved"):
            torch.testing.assert_close(fast(x), model(x))
        del filler
        model.cpu()
        # NaN tensors of the weights' sizes take their freed blocks: the weights come back elsewhere (a real move), and
        # a graph reading the old addresses would read NaN
        filler = [torch.full(p.shape, float("nan"), device="cuda") for p in model.parameters()]
        model.cuda()
        with pytest.warns(ModuleChangedWarning, match="moved"):
            torch.testing.assert_close(fast(x), model(x))
        torch.testing.assert_close(fast(x), model(x))
    assert fast.stats.module_changes == 2 and fast.stats.eager_calls == 0, fast.stats.table()
    del filler


@pytest.mark.parametrize("step", ["eager", "fused"])
def test_generate_gives_the_new_weights_tokens_after_an_assigning_load(step):
    model, source = tiny_model("gpt2", device="cuda"), tiny_model("gpt2", seed=1, device="cuda")
    ids, mask = left_padded([5, 3], device="cuda")
    options = dict(max_new_tokens=8, step=step, eos_token_id=[], pad_token_id=0)
    generate(model, ids, mask, **options)
    model.load_state_dict(source.state_dict(), assign=True)
    filler = fill_freed_memory("cuda")
    with pytest.warns(ModuleChangedWarning, match="was replaced"):
        got = generate(model, ids, mask, **options)
    assert torch.equal(got, generate(source, ids, mask, **options))
    assert sum(len(r.stats.graphs) for r in graphed_runners(model)) == 1
    del filler


def test_monte_carlo_dropout_after_eval_calls_draws_new_masks():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5)).cuda().eval()
    fast = graphed(model)
    x = torch.randn(4, 64, device="cuda")
    with torch.inference_mode():
        fast(x)
        torch.testing.assert_close(fast(x), model(x))
        model[1].train()
        with pytest.warns(ModuleChangedWarning, match="switched to training mode"):
            first = fast(x).clone()
        second = fast(x).clone()
    assert (first == 0).any() and not torch.equal(first, second)
    assert fast.stats.module_changes == 1 and fast.stats.eager_calls == 0, fast.stats.table()
