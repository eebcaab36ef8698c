"""Bad inputs to tendril's other entry points: malformed sparse formats, invalid conversion, pruning and graph options,
and invalid `generate` arguments.

Malformed formats must be refused when they are constructed (ValueError or TypeError); `generate` must raise a
clear exception (or return what it returns for the equivalent valid call) and generate correctly afterwards.
Invalid token ids index an embedding: on CUDA that is a device-side assert which ends the CUDA context, so the
CUDA check runs in a child process and expects tendril to refuse the ids with ValueError before any kernel runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch

from tendril.sparse.activations import ActivationLayout, CompressedActivations
from tendril.sparse.format import ConvGeometry, SparseConvWeights, SparseLinearWeights
from tests.fuzz.bad_inputs import BadCase, Broken, SilentWrong

# -- sparse formats ----------------------------------------------------------------------------------------


def _conv(device: str) -> SparseConvWeights:
    geometry = ConvGeometry(2, 3, (3, 3), (2, 2), (1, 1), 1, (6, 6))
    dense = torch.randn(3, 2, 3, 3, generator=torch.Generator().manual_seed(0))
    return SparseConvWeights.from_dense(dense.masked_fill(dense.abs() < 0.5, 0).to(device), geometry)


def _linear(device: str) -> SparseLinearWeights:
    dense = torch.randn(5, 7, generator=torch.Generator().manual_seed(1))
    return SparseLinearWeights.from_dense(dense.masked_fill(dense.abs() < 0.5, 0).to(device))


def _int(values: list[int], device: str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def _shifted(tensor: torch.Tensor, index: int, value: int) -> torch.Tensor:
    out = tensor.clone()
    out[index] = value
    return out


MalformedBuild = Callable[[str], Any]

MALFORMED: dict[str, MalformedBuild] = {
    "conv_values_float64": lambda d: replace(_conv(d), values=_conv(d).values.double()),
    "conv_values_2d": lambda d: replace(_conv(d), values=_conv(d).values[None]),
    "conv_taps_int64": lambda d: replace(_conv(d), taps=_conv(d).taps.long()),
    "conv_taps_shorter_than_values": lambda d: replace(_conv(d), taps=_conv(d).taps[1:]),
    "conv_channel_ptr_too_short": lambda d: replace(_conv(d), channel_ptr=_conv(d).channel_ptr[:-1]),
    "conv_channel_ptr_decreasing": lambda d: replace(_conv(d), channel_ptr=_shifted(_conv(d).channel_ptr, 1, 10**6)),
    "conv_channel_ptr_not_from_zero": lambda d: replace(_conv(d), channel_ptr=_conv(d).channel_ptr + 1),
    "conv_tap_out_channel_out_of_range": lambda d: replace(_conv(d), taps=_shifted(_conv(d).taps, 0, 9 << 16)),
    "conv_tap_offset_out_of_range": lambda d: replace(_conv(d), taps=_shifted(_conv(d).taps, 0, 7 << 8)),
    "conv_tap_negative": lambda d: replace(_conv(d), taps=_shifted(_conv(d).taps, 0, -1)),
    "linear_values_int32": lambda d: replace(_linear(d), values=_linear(d).values.int()),
    "linear_rows_int64": lambda d: replace(_linear(d), rows=_linear(d).rows.long()),
    "linear_row_out_of_range": lambda d: replace(_linear(d), rows=_shifted(_linear(d).rows, 0, 5)),
    "linear_row_negative": lambda d: replace(_linear(d), rows=_shifted(_linear(d).rows, 0, -1)),
    "linear_col_ptr_too_long": lambda d: replace(_linear(d), col_ptr=torch.cat([_linear(d).col_ptr,
                                                                                 _int([_linear(d).nnz], d)])),
    "linear_col_ptr_decreasing": lambda d: replace(_linear(d), col_ptr=_shifted(_linear(d).col_ptr, 2, 10**6)),
    "linear_rows_and_values_differ": lambda d: replace(_linear(d), rows=_linear(d).rows[:-1]),
    "linear_in_features_mismatch": lambda d: replace(_linear(d), in_features=3),
    "geometry_zero_stride": lambda d: ConvGeometry(2, 3, (3, 3), (0, 1), (1, 1), 1, (6, 6)),
    "geometry_groups_not_dividing": lambda d: ConvGeometry(3, 4, (3, 3), (1, 1), (1, 1), 2, (6, 6)),
    "geometry_input_too_small": lambda d: ConvGeometry(2, 3, (5, 5), (1, 1), (0, 0), 1, (3, 3)),
    "layout_zero_capacity": lambda d: ActivationLayout(2, (6, 6), (1, 1), (1, 1), 0),
    "layout_capacity_above_plane": lambda d: ActivationLayout(2, (6, 6), (1, 1), (1, 1), 10**6),
    "layout_capacity_fraction_zero": lambda d: ActivationLayout.for_vector(16, capacity_fraction=0.0),
    "activations_wrong_buffer_shape": lambda d: replace(
        CompressedActivations.empty(ActivationLayout.for_vector(16), torch.device(d)),
        values=torch.empty(3, 3, device=d)),
}


def must_raise(build: Callable[[str], object], what: str) -> Callable[[str], None]:
    """A check that `build(device)` raises ValueError or TypeError (`what` names the call in a failure)."""

    def check(device: str) -> None:
        try:
            built = build(device)
        except (ValueError, TypeError):
            return
        raise SilentWrong(f"{what} did not raise ValueError or TypeError (gave {type(built).__name__})")

    return check


# -- conversion, pruning and graph options ---------------------------------------------------------------------


def _small_cnn(device: str) -> torch.nn.Module:
    torch.manual_seed(3)
    layers = [torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 1)]
    return torch.nn.Sequential(*layers).eval().to(device)


def _batch_norm_training(device: str) -> object:
    from tendril.sparse import convert

    model = _small_cnn(device)
    model[1].train()
    return convert(model, torch.randn(1, 3, 8, 8, device=device))


def _prune_later_density(device: str) -> object:
    from tendril.sparse import prune

    model = _small_cnn(device)
    before = [p.detach().clone() for p in model.parameters()]
    try:
        return prune(model, [0.5, 2.0])
    finally:
        if not all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True)):
            raise SilentWrong("prune changed layers before refusing a later layer's density")


def _graphed(**options: Any) -> Callable[[str], object]:
    def build(device: str) -> object:
        import tendril

        return tendril.graphed(lambda x: x * 2, **options)

    return build


def _loop_bound(device: str) -> object:
    import tendril

    start = torch.zeros((), dtype=torch.long, device=device)
    return tendril.while_loop(lambda i: i < 1, lambda i: i + 1, (start,), max_iterations=True)


def _bucket_sizes(device: str) -> object:
    import tendril

    return tendril.sequence_buckets((4.5, 8))


REFUSED: dict[str, Callable[[str], object]] = {
    # name: a call that must raise ValueError or TypeError, naming the argument
    "convert-batch_norm_in_training_mode": _batch_norm_training,
    "prune-density_of_a_later_layer": _prune_later_density,
    "graphed-max_graphs_float": _graphed(max_graphs=2.5),
    "graphed-warmup_float": _graphed(warmup=1.5),
    "graphed-clone_outputs_str": _graphed(clone_outputs="yes"),
    "while_loop-bound_bool": _loop_bound,
    "buckets-size_float": _bucket_sizes,
}


class _AddedToItself(torch.nn.Module):
    """A layer's output added to itself and functional ReLUs with `inplace` (each once failed at the first call)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.second(self.first(torch.nn.functional.relu(x)))
        return torch.nn.functional.relu(z + z, inplace=True)


def convert_matches_check(device: str) -> None:
    """A converted network of `_AddedToItself` equals the model (fp32: within rounding)."""
    from tendril.sparse import convert

    torch.manual_seed(4)
    model = _AddedToItself().eval().to(device)
    x = torch.randn(1, 3, 8, 8, device=device)
    try:
        got = convert(model, x)(x)
    except Exception as error:
        raise Broken(f"convert or its forward raised {type(error).__name__}: {error}") from error
    with torch.no_grad():
        expected = model(x)
    if not torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
        raise SilentWrong(f"converted output differs from the model's by {(got - expected).abs().max().item():.3g}")


# -- generate ----------------------------------------------------------------------------------------------


def _model_and_prompt(device: str) -> tuple[torch.nn.Module, torch.Tensor]:
    from tests.generation.models import tiny_model

    ids = torch.randint(4, 96, (2, 5), generator=torch.Generator().manual_seed(2)).to(device)
    return tiny_model("gpt2", device), ids


def _generates_correctly(model: torch.nn.Module, ids: torch.Tensor, what: str) -> None:
    from tendril.generation import generate

    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,  # type: ignore[operator]
                              eos_token_id=None, pad_token_id=0, do_sample=False)
    try:
        got = generate(model, ids, max_new_tokens=4, eos_token_id=[], pad_token_id=0)
    except Exception as error:
        raise Broken(f"{what}: generate stopped working: {type(error).__name__}: {error}") from error
    if not torch.equal(got, expected):
        raise Broken(f"{what}: generate afterwards differs from HF's: {got.tolist()} vs {expected.tolist()}")


GENERATE: dict[str, tuple[dict[str, Any], Callable[[torch.Tensor], torch.Tensor] | None]] = {
    # name: (options, how the prompt is spoilt); each must raise ValueError, TypeError or IndexError
    "max_new_tokens_zero": ({"max_new_tokens": 0}, None),
    "max_new_tokens_negative": ({"max_new_tokens": -3}, None),
    "max_new_tokens_float": ({"max_new_tokens": 3.5}, None),
    "length_penalty_nan": ({"num_beams": 2, "length_penalty": float("nan")}, None),
    "eos_not_an_int": ({"eos_token_id": "eos"}, None),
    "num_beams_zero": ({"num_beams": 0}, None),
    "return_sequences_above_beams": ({"num_beams": 2, "num_return_sequences": 3}, None),
    "unknown_option": ({"no_such_option": 1}, None),
    "early_stopping_invalid": ({"num_beams": 2, "early_stopping": "sometimes"}, None),
    "ids_float": ({}, lambda ids: ids.float()),
    "ids_1d": ({}, lambda ids: ids[0]),
    "ids_3d": ({}, lambda ids: ids[None]),
    "mask_wrong_shape": ({"attention_mask": "short"}, None),
    "mask_row_all_zero": ({"attention_mask": "empty_row"}, None),
    "mask_not_binary": ({"attention_mask": "twos"}, None),
    "ids_on_another_device": ({}, lambda ids: ids.to("meta" if ids.is_cpu else "cpu")),
    "num_beams_float": ({"num_beams": 2.0}, None),
    "num_beams_bool": ({"num_beams": True}, None),
    "top_k_float": ({"do_sample": True, "top_k": 2.5}, None),
    "seed_float": ({"do_sample": True, "seed": 1.5}, None),
    "seed_out_of_range": ({"do_sample": True, "seed": 2**64}, None),
    "length_penalty_str": ({"num_beams": 2, "length_penalty": "1"}, None),
    "eos_float_in_list": ({"eos_token_id": [3, 3.7]}, None),
    "pad_float": ({"pad_token_id": 1.5}, None),
}


def generate_check(name: str) -> Callable[[str], None]:
    def check(device: str) -> None:
        from tendril.generation import generate

        options, spoil = GENERATE[name]
        model, ids = _model_and_prompt(device)
        options = dict(options)
        masks = {
            "short": torch.ones(2, 3, dtype=torch.long, device=device),
            "empty_row": torch.ones_like(ids).index_fill(0, torch.tensor([1], device=device), 0),
            "twos": torch.full_like(ids, 2),
        }
        if options.get("attention_mask") in masks:
            options["attention_mask"] = masks[options["attention_mask"]]
        prompt = spoil(ids) if spoil is not None else ids
        try:
            generate(model, prompt, **{"max_new_tokens": 4, **options})
        except (ValueError, TypeError, IndexError):
            pass
        else:
            raise SilentWrong(f"generate with {name} did not raise")
        _generates_correctly(model, ids, f"after {name}")

    return check


def invalid_eos_check(eos: int) -> Callable[[str], None]:
    """An eos id no token can take (out of the vocabulary) either raises or never stops generation early."""

    def check(device: str) -> None:
        from tendril.generation import generate

        model, ids = _model_and_prompt(device)
        try:
            got = generate(model, ids, max_new_tokens=4, eos_token_id=eos, pad_token_id=0)
        except (ValueError, IndexError):
            pass
        else:
            expected = generate(model, ids, max_new_tokens=4, eos_token_id=[], pad_token_id=0)
            if not torch.equal(got, expected):
                raise SilentWrong(f"eos {eos} changed the generated tokens: {got.tolist()} vs {expected.tolist()}")
        _generates_correctly(model, ids, f"after eos {eos}")

    return check


_INVALID_IDS_CHILD = """
import torch
from tendril.generation import generate
from tests.generation.models import tiny_model
model = tiny_model("gpt2", "{device}")
ids = torch.full((1, 4), {token}, dtype=torch.long, device="{device}")
try:
    generate(model, ids, max_new_tokens=3, eos_token_id=[], pad_token_id=0)
except {expected} as error:
    print("refused:", type(error).__name__, error)
else:
    raise SystemExit("invalid token ids were accepted")
good = torch.randint(4, 96, (1, 4), device="{device}")
out = generate(model, good, max_new_tokens=3, eos_token_id=[], pad_token_id=0)
assert out.shape == (1, 7), out.shape
print("OK")
"""


def invalid_ids_check(token: int) -> Callable[[str], None]:
    """Token ids outside the vocabulary are refused; on CUDA in a child process (see the module docstring)."""

    def check(device: str) -> None:
        if device == "cpu":
            _invalid_ids_here(token)
            return
        code = _INVALID_IDS_CHILD.format(device=device, token=token, expected="ValueError")
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(["src", ".", os.environ.get("PYTHONPATH", "")])}
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                               env=environment, cwd=_repository_root())
        if child.returncode != 0 or "OK" not in child.stdout:
            tail = (child.stdout + child.stderr).strip().splitlines()[-3:]
            raise SilentWrong(f"token id {token}: exit status {child.returncode}: {' | '.join(tail)}")

    return check


def _invalid_ids_here(token: int) -> None:
    from tendril.generation import generate

    model, ids = _model_and_prompt("cpu")
    try:
        generate(model, torch.full_like(ids, token), max_new_tokens=3, eos_token_id=[], pad_token_id=0)
    except (ValueError, IndexError):
        pass
    else:
        raise SilentWrong(f"token id {token} was accepted")
    _generates_correctly(model, ids, f"after token id {token}")


def _repository_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def library_cases() -> Iterator[BadCase]:
    for name in MALFORMED:
        yield BadCase(f"sparse-{name}", must_raise(MALFORMED[name], f"constructing {name}"))
    for name in GENERATE:
        yield BadCase(f"generate-{name}", generate_check(name))
    for eos in (-7, 96, 10**6):
        yield BadCase(f"generate-eos_{eos}", invalid_eos_check(eos))
    for token in (96, -1):
        yield BadCase(f"generate-token_{token}", invalid_ids_check(token))
    for name in REFUSED:
        yield BadCase(name, must_raise(REFUSED[name], name))
    yield BadCase("convert-layer_output_added_to_itself", convert_matches_check)
