"""The CPU-runnable part of the `generation-streaming` case: finding the ring its streaming loop publishes into."""

from __future__ import annotations

import pytest

from benchmarks.cases.generation_streaming import _ring
from tendril.generation import generate
from tests.generation.models import left_padded, tiny_model


class _Collector:
    def put(self, value: object) -> None:
        pass

    def end(self) -> None:
        pass


def test_the_case_finds_the_ring_of_the_models_one_streaming_loop():
    model = tiny_model("gpt2")
    ids, _ = left_padded([4])
    with pytest.raises(RuntimeError, match="expected one streaming loop, found 0"):
        generate(model, ids, max_new_tokens=3, eos_token_id=[])
        _ring(model)
    out = generate(model, ids, max_new_tokens=3, eos_token_id=[], streamer=_Collector())
    assert [_ring(model).read(count)[1] for count in (1, 2, 3)] == out[0, ids.shape[1] :].tolist()
