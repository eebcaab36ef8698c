"""On GPUs: a one-rank shard runs the graphs of the model it came from; two ranks over NCCL (their
collectives captured in the loop graphs) decode the tokens of one GPU."""

from __future__ import annotations

import pytest
import torch

from tendril.distributed import shard_llama
from tendril.generation.api import graphed_runners
from tests.distributed.ranks import RUNS, decode, run_ranks
from tests.generation.models import tiny_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(RUNS))
def test_a_one_rank_shard_decodes_as_the_model_on_the_gpu(name, dtype):
    family, options = RUNS[name]
    model = tiny_model(family, device="cuda", dtype=dtype)
    shard = shard_llama(tiny_model(family, device="cuda", dtype=dtype), 0, 1)
    assert torch.equal(decode(shard, options, "cuda"), decode(model, options, "cuda"))
    assert torch.equal(decode(shard, options, "cuda"), decode(model, options, "cuda"))  # replayed
    for runners in (graphed_runners(shard), graphed_runners(model)):
        assert sum(r.stats.replays for r in runners) == 2 and sum(r.stats.eager_calls for r in runners) == 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_decode_the_tokens_of_one(tmp_path):
    ranks = run_ranks(2, "nccl", tmp_path)
    for name, (family, options) in RUNS.items():
        single = decode(tiny_model(family, device="cuda"), options, "cuda")
        assert torch.equal(ranks[0][name], ranks[1][name]), name
        assert torch.equal(ranks[0][name], single), name
