"""Real models, unchanged, graphed against eager over >= 50 random shape sequences each (GPU)."""

import pytest
import torch
from torch import nn

from tendril.graphs.buckets import sequence_buckets
from tests.graphs.gpu_models import fast, fp16_logits, gpt2, gptj, run_sequence, tight, wav2vec2

pytestmark = pytest.mark.gpu


def token_call(max_len: int, vocab: int = 1000):
    def make(rng):
        return (torch.randint(0, vocab, (1, rng.randint(1, max_len)), device="cuda"),), {}

    return make


def test_gpt2_fp32_matches_eager_at_random_lengths():
    model = gpt2()
    graphed_model = fast(model)
    run_sequence(graphed_model, model, token_call(40), tight, calls=60)
    assert graphed_model.stats.eager_calls == 0 and graphed_model.stats.replays == 60


def test_gpt2_fp16_close_logits_and_same_argmax():
    model = gpt2(torch.float16)
    run_sequence(fast(model), model, token_call(40), fp16_logits, calls=60, seed=1)


def test_gptj_fp32_and_fp16():
    for dtype, compare in ((torch.float32, tight), (torch.float16, fp16_logits)):
        model = gptj(dtype)
        graphed_model = fast(model)
        run_sequence(graphed_model, model, token_call(32), compare, calls=50, seed=2)
        assert graphed_model.stats.eager_calls == 0


def test_wav2vec2_at_random_audio_lengths():
    model = wav2vec2()
    graphed_model = fast(model)

    def make(rng):
        return (torch.randn(1, 400 * rng.randint(1, 10), device="cuda"),), {}

    run_sequence(graphed_model, model, make, tight, calls=50, seed=3)
    assert graphed_model.stats.eager_calls == 0


def test_torchvision_cnn_at_random_image_sizes():
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet18(weights=None).cuda().eval()
    graphed_model = fast(model)

    def make(rng):
        side = 32 * rng.randint(1, 5)
        return (torch.randn(1, 3, side, side + 32 * rng.randint(0, 1), device="cuda"),), {}

    run_sequence(graphed_model, model, make, tight, calls=50, seed=4)
    assert graphed_model.stats.eager_calls == 0


def test_plain_module_and_function_with_nested_outputs():
    mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8)).cuda().eval()

    def fn(x, bias, scale=1.0):
        y = mlp(x) * scale
        return {"y": y, "parts": (y.softmax(-1), (x + bias).sum(0))}

    graphed_fn = fast(fn)

    def make(rng):
        rows = rng.randint(1, 16)
        return (torch.randn(rows, 32, device="cuda"), torch.randn(32, device="cuda")), {"scale": rng.choice([1.0, 2.0])}

    run_sequence(graphed_fn, fn, make, tight, calls=50, seed=5)
    assert graphed_fn.stats.eager_calls == 0


def test_gpt2_with_sequence_buckets_matches_unpadded_eager():
    model = gpt2()
    graphed_model = fast(model, buckets=sequence_buckets((16, 32, 64)))
    run_sequence(graphed_model, model, token_call(64), tight, calls=50, seed=6)
    assert graphed_model.stats.captures == 3 and graphed_model.stats.padded_calls == 50
