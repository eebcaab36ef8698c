"""`tendril.generate`: Hugging Face `generate` semantics, decoded by a device-side loop.

The prompt runs once through the architecture's graph-safe forward, filling tendril's static KV cache;
then token choice and, for beams, all bookkeeping run as `tendril.graphs.control.while_loop(cond, body,
carried)`, one iteration per new token, ending as soon as every sequence is done. Options follow HF's meaning and
defaults; options tendril does not implement are refused by name, never ignored.
"""

from __future__ import annotations

import copy
import functools
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tendril.generation import streaming
from tendril.generation.architectures import DecoderArchitecture, UnsupportedModelError, decoder_for
from tendril.generation.beam import beam_result
from tendril.generation.defaults import resolve, unsupported_settings
from tendril.generation.greedy import greedy_result
from tendril.generation.loop import DecodeLoop, Plan, Step, check_step
from tendril.generation.noise import draw_key
from tendril.generation.processors import LogitsProcessing
from tendril.generation.streaming import Streamer, TokenDelivery, TokenRing, check_streamable
from tendril.graphs.backend import Backend
from tendril.graphs.callable import GraphedCallable
from tendril.graphs.module_state import ModuleChangedWarning, ModuleState
from tendril.graphs.options import GraphOptions
from tendril.utils.checks import is_finite_number, is_integer

_SUPPORTED = (
    "attention_mask, max_new_tokens, eos_token_id, pad_token_id, do_sample, temperature, top_k, top_p, "
    "repetition_penalty, num_beams, length_penalty, early_stopping, num_return_sequences, seed, step, "
    "streamer, unsupported"
)


def _eos_ids(model: nn.Module, eos_token_id: int | Sequence[int] | None) -> list[int]:
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if eos_token_id is None:
            return []
    # a tensor or an array of ids, read on the host before any graph (an argument, not the loop's state)
    values = eos_token_id.tolist() if hasattr(eos_token_id, "tolist") else eos_token_id
    ids: list[Any] = list(values) if isinstance(values, (list, tuple)) else [values]
    if not all(map(is_integer, ids)):
        raise ValueError(f"eos_token_id must be a token id or a sequence of them (integers), got {eos_token_id!r}")
    return [int(t) for t in ids]


def _pad_id(model: nn.Module, pad_token_id: int | None, eos: list[int]) -> int | None:
    if pad_token_id is None:
        pad_token_id = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    if pad_token_id is None and eos:
        pad_token_id = eos[0]
    if pad_token_id is not None and not is_integer(pad_token_id):
        raise ValueError(f"pad_token_id must be a token id (an integer), got {pad_token_id!r}")
    return None if pad_token_id is None else int(pad_token_id)


def _check_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_new_tokens: int) -> None:
    if input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError(f"input_ids must be a [batch, length] int64 tensor, got {input_ids.dtype} "
                         f"{tuple(input_ids.shape)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} differs from input_ids "
                         f"{tuple(input_ids.shape)}")
    if not is_integer(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")


def _check_integers(**options: Any) -> None:
    """Each option must be an integer (not a bool): a float would be truncated, `True` taken for 1."""
    for name, value in options.items():
        if not is_integer(value):
            raise ValueError(f"{name} must be an integer, got {value!r}")


def _check_prompt(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, eos: list[int],
                  pad: int | None) -> None:
    """Token ids outside the vocabulary, and attention masks with values other than 0 and 1 or with a row that hides
    every token, are refused here, with one host sync per `generate` call: inside the loop an embedding lookup out of
    range is a device-side assert that ends the process's CUDA context, and such masks have no meaning to follow."""
    vocab = model.get_input_embeddings().num_embeddings  # type: ignore[operator]
    checks = [((input_ids >= 0) & (input_ids < vocab)).all()]
    if attention_mask is not None:
        checks.append(((attention_mask == 0) | (attention_mask == 1)).all().to(input_ids.device))
        checks.append((attention_mask != 0).any(-1).all().to(input_ids.device) if input_ids.shape[1] else checks[0])
    ids_valid, *mask_valid = torch.stack(checks).tolist()  # before the decode graph: the call's one sync up front
    if not ids_valid:
        low, high = int(input_ids.min()), int(input_ids.max())
        raise ValueError(f"input_ids must lie in [0, {vocab}) (the model's vocabulary), got values in [{low}, {high}]")
    if mask_valid and not mask_valid[0]:
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (a token to attend to)")
    if mask_valid and not mask_valid[1]:
        rows = (attention_mask != 0).any(-1).logical_not().nonzero().flatten().tolist()  # type: ignore[union-attr]
        raise ValueError(f"attention_mask hides every token of row(s) {rows}: each row needs at least one 1")
    named = {f"eos_token_id {token}": token for token in eos}
    if pad is not None:
        named["pad_token_id"] = pad
    outside = [f"{name} = {token}" if name == "pad_token_id" else name for name, token in named.items()
               if not 0 <= token < vocab]
    if outside:
        raise ValueError(f"{', '.join(outside)} outside the model's vocabulary [0, {vocab})")


def _hf_generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    eos: list[int],
    pad: int | None,
    seed: int | None,
    **options: Any,
) -> torch.Tensor:
    """HF's own `generate` with the same options (the `unsupported='hf'` path), eos/pad/seed as tendril reads them."""
    config: Any = copy.deepcopy(model.generation_config)
    config.eos_token_id = eos or None
    config.pad_token_id = pad
    devices = [input_ids.device] if input_ids.is_cuda else []
    with torch.random.fork_rng(devices=devices, enabled=seed is not None), torch.inference_mode():
        if seed is not None:
            torch.manual_seed(seed)
        return model.generate(input_ids, attention_mask=attention_mask, generation_config=config,  # type: ignore[operator]
                              **options)


def _default_mask(input_ids: torch.Tensor, pad: int | None, eos: list[int]) -> torch.Tensor:
    """HF's inferred mask: padding where the pad token occurs, unless the pad token is an eos token."""
    if pad is None or pad in eos:
        return torch.ones_like(input_ids)
    padding = input_ids == pad
    return torch.where(padding.any(), (~padding).long(), torch.ones_like(input_ids))


def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float | None = None,
    num_beams: int | None = None,
    length_penalty: float | None = None,
    early_stopping: bool | str | None = None,
    num_return_sequences: int | None = None,
    seed: int | None = None,
    step: Step = "eager",
    streamer: Streamer | None = None,
    unsupported: str = "raise",
    **other: Any,
) -> torch.Tensor:
    """Generate like `model.generate(...)` and return the same [batch * num_return_sequences, length] ids.

    Decoding options left None take the model's `generation_config`, else HF's defaults, as `model.generate` does
    (`tendril.generation.defaults`); a config that sets what tendril does not implement (`no_repeat_ngram_size`, ...)
    raises, or with `unsupported='hf'` runs HF's `generate`. `eos_token_id=None` takes the model's
    `generation_config` too; pass `[]` to disable stopping on eos. `seed` makes sampling reproducible (torch's
    default generator otherwise).
    `step` chooses how the one-token decode forward runs inside the loop graph: "eager" (the architecture's
    forward, captured as is), "compiled" (that forward through `torch.compile`/Inductor; the first call per
    shape pays the compilation, and a shape past torch._dynamo's recompile limit runs uncompiled, with a
    `CompileLimitWarning`) or "fused" (tendril's Triton decode kernels, five per layer, no compilation
    step, overlapped by programmatic dependent launch on Hopper; GPT-2, GPT-J and the Llama family; see
    `tendril.generation.kernels`). What "fused" guarantees: in fp32 the same tokens as HF (tested for greedy
    and beams on every family); in fp16/bf16 the same computation, rounded to the dtype wherever HF's eager
    forward rounds, but its matrix products sum in another order than cuBLAS, so logits differ in the last
    bits and tokens can differ from HF's where two candidates are (nearly) tied: numerically equivalent, not
    bit-identical. Use "eager" or "compiled" for HF-exact fp16 tokens. "fused" computes the eval-mode forward, so it
    refuses a model whose dropout layers are in training mode.
    `streamer` (HF's `TextStreamer`, `TextIteratorStreamer`, or anything with their `put`/`end`) receives
    the prompt, then each token as the device loop chooses it, then `end()`, as from HF's `generate`, with
    no host sync per token (see `tendril.generation.streaming`). As in HF it needs one sequence (batch size
    1, one returned sequence). With beam search the chosen sequence streams when the loop ends, since only
    then is the winning beam known; an exception in the streamer stops the stream with a `StreamerWarning` and the
    result is still returned.
    `unsupported='hf'` runs HF's own `generate` eagerly for models tendril has no decode path for.
    """
    if other:
        raise ValueError(f"tendril.generate does not support {', '.join(sorted(other))}; supported options: "
                         f"{_SUPPORTED}. Use model.generate for the others.")
    if unsupported not in ("raise", "hf"):
        raise ValueError(f"unsupported must be 'raise' or 'hf', got {unsupported!r}")
    given = dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                 repetition_penalty=repetition_penalty, num_beams=num_beams, length_penalty=length_penalty,
                 early_stopping=early_stopping, num_return_sequences=num_return_sequences)
    hf_options = {name: value for name, value in given.items() if value is not None}
    settings = unsupported_settings(model)
    if settings and unsupported != "hf":
        raise ValueError(f"the model's generation_config sets {settings}, which model.generate applies and "
                         "tendril.generate does not implement: unset them in model.generation_config, or pass "
                         "unsupported='hf' to run HF's generate")
    decoding = resolve(model, given)
    beams, returned = decoding["num_beams"], decoding["num_return_sequences"]
    _check_inputs(input_ids, attention_mask, max_new_tokens)
    _check_integers(num_beams=beams, num_return_sequences=returned, top_k=decoding["top_k"])
    if seed is not None and not (is_integer(seed) and -(2**63) <= seed < 2**64):
        raise ValueError(f"seed must be an integer in [-2**63, 2**64) (a torch.Generator seed), got {seed!r}")
    if beams < 1 or returned < 1:
        raise ValueError("num_beams and num_return_sequences must be >= 1")
    if beams == 1 and not decoding["do_sample"] and returned != 1:
        raise ValueError("greedy decoding returns one sequence per prompt; use do_sample=True or num_beams > 1 "
                         "for num_return_sequences > 1")
    if beams > 1 and returned > beams:
        raise ValueError(f"num_return_sequences ({returned}) must be <= num_beams ({beams})")
    check_step(step)
    if streamer is not None:
        check_streamable(input_ids.shape[0] * returned)
    eos = _eos_ids(model, eos_token_id)
    pad = _pad_id(model, pad_token_id, eos)
    try:
        arch = _architecture(model)
    except UnsupportedModelError:
        if unsupported != "hf":
            raise
        arch = None
    if arch is None or settings:
        return _hf_generate(model, input_ids, attention_mask, eos, pad, seed, streamer=streamer,
                            max_new_tokens=max_new_tokens, **hf_options)
    weight = next(model.parameters())
    if input_ids.device != weight.device:
        raise ValueError(f"input_ids are on {input_ids.device} but the model is on {weight.device}; move them with "
                         f".to({str(weight.device)!r})")
    _check_prompt(model, input_ids, attention_mask, eos, pad)
    training = _state(model).modules.training_layers() if step == "fused" else []
    if training:
        raise ValueError(f"step='fused' decodes as the model runs in eval mode, but {', '.join(training[:3])} "
                         f"{'is' if len(training) == 1 else 'are'} in training mode (dropout): call model.eval(), or "
                         "use step='eager' or 'compiled' to decode with the layers as they are")
    processing = LogitsProcessing(
        do_sample=decoding["do_sample"], temperature=float(decoding["temperature"]), top_k=int(decoding["top_k"]),
        top_p=float(decoding["top_p"]), repetition_penalty=float(decoding["repetition_penalty"]),
        min_tokens_to_keep=len(eos) + 1 if beams > 1 else 1,
    )
    early_stopping, length_penalty = decoding["early_stopping"], decoding["length_penalty"]
    if early_stopping not in (True, False, "never"):
        raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
    if not is_finite_number(length_penalty):
        raise ValueError(f"length_penalty must be a finite number, got {length_penalty!r}")
    plan = Plan.build(max_new_tokens=max_new_tokens, processing=processing, eos=eos, pad=pad, num_beams=beams,
                      length_penalty=float(length_penalty), early_stopping=early_stopping, step=step,
                      stream_slots=streaming.RING_SLOTS if streamer is not None and beams == 1 else 0)
    device = input_ids.device
    batch, prompt_len = input_ids.shape
    mask = _default_mask(input_ids, pad, eos) if attention_mask is None else attention_mask.to(device, torch.long)
    copies = beams if beams > 1 else returned
    prompt, mask = input_ids.repeat_interleave(copies, dim=0), mask.repeat_interleave(copies, dim=0)
    arch.check_length(prompt_len + max_new_tokens)
    state = _state(model)
    with torch.inference_mode(), state.turn:
        loop = state.loops.loop(model, plan)
        run = functools.partial(state.loops.run, plan)
        result = functools.partial(_result, num_beams=beams, batch=batch, prompt_len=prompt_len,
                                   num_return_sequences=returned)
        if streamer is not None:
            return _streamed(run, loop.ring, result, streamer, input_ids, prompt, mask, draw_key(device, seed))
        return result(run(prompt, mask, draw_key(device, seed)))


def _result(carried: tuple[torch.Tensor, ...], *, num_beams: int, batch: int, prompt_len: int,
            num_return_sequences: int) -> torch.Tensor:
    """The ids `generate` returns from the loop's final state (one host sync)."""
    if num_beams == 1:
        return greedy_result(carried, prompt_len).clone()
    return beam_result(carried, batch, prompt_len, num_return_sequences).clone()


def _streamed(
    run: Callable[..., tuple[torch.Tensor, ...]],
    ring: TokenRing | None,
    result: Callable[[tuple[torch.Tensor, ...]], torch.Tensor],
    streamer: Streamer,
    input_ids: torch.Tensor,
    prompt: torch.Tensor,
    mask: torch.Tensor,
    noise_key: torch.Tensor,
) -> torch.Tensor:
    """One launch whose tokens a host thread streams (see `streaming`): while it runs from the loop's ring
    (greedy, sampling), or all after it (beam search, whose loop has no ring)."""
    prompt_len = prompt.shape[1]
    with TokenDelivery(streamer, ring, input_ids) as delivery:
        carried = run(prompt, mask, noise_key)
        if prompt.is_cuda:  # wait with the GIL released, so the delivery thread runs while the graph does
            torch.cuda.current_stream(prompt.device).synchronize()
        out = result(carried)
        delivery.finish(out[0, prompt_len:].tolist())  # the launch has finished: this sync waits for nothing
    return out


class DecodeLoops:
    """A model's decode loops, one per plan, run through one function, `run(plan, prompt, mask, noise_key)`: on CUDA
    a `tendril.graphed` callable keyed by the plan and the input shapes, so the graphs of every plan share one memory
    pool (a new plan's graphs reuse the memory of the others' KV caches and activations, which they never run beside)
    and one graph budget (`graphed`'s `max_graphs`; past it calls run eagerly, warned), elsewhere the loops
    themselves, run eagerly."""

    def __init__(self, arch: DecoderArchitecture, graphs: bool, backend: Backend | None = None,
                 name: str = "generate") -> None:
        """`graphs`: run the loops through `tendril.graphed` (on `backend`; None: CUDA's), named `name` in its stats
        and warnings."""
        self.arch = arch
        self.by_plan: dict[Plan, DecodeLoop] = {}
        self.run: Callable[..., tuple[torch.Tensor, ...]] = (
            GraphedCallable(self._run, GraphOptions(), backend=backend, name=name) if graphs else self._run)

    def loop(self, model: nn.Module, plan: Plan) -> DecodeLoop:
        """The decode loop of `plan`, built if it is not yet (outside any graph: its buffers are the model's, not a
        graph's)."""
        found = self.by_plan.get(plan)
        if found is None:
            found = self.by_plan[plan] = DecodeLoop(model, self.arch, plan)
        return found

    def _run(self, plan: Plan, prompt: torch.Tensor, mask: torch.Tensor,
             noise_key: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.by_plan[plan](prompt, mask, noise_key)


@dataclass
class _ModelState:
    """What tendril keeps per model (in the model's `__dict__`, so it lives and dies with the model)."""

    arch: DecoderArchitecture
    """One decode path per model, so compiled steps and captured graphs see the same object every call."""
    loops: DecodeLoops
    modules: ModuleState
    """The model's tensors and modes when `arch` and `loops` were built: both read them as they were then."""
    turn: threading.Lock = field(default_factory=threading.Lock)
    """Held by each `generate` call: calls from several threads take turns, since they share the loops' graphs."""

    def __reduce__(self) -> tuple[Callable[[], None], tuple[()]]:
        """A copy or a pickle of the model (`copy.deepcopy`, `torch.save`) carries no state: it is a cache of
        decode paths and graphs over this model's tensors, which the copy builds again for its own."""
        return _no_state, ()


def _no_state() -> None:
    return None


_STATE_ATTRIBUTE = "_tendril_generation"


def _state(model: nn.Module) -> _ModelState:
    state = model.__dict__.get(_STATE_ATTRIBUTE)
    if state is None:
        arch = decoder_for(model)
        loops = DecodeLoops(arch, graphs=next(model.parameters()).is_cuda, name=f"generate({type(model).__name__})")
        state = model.__dict__[_STATE_ATTRIBUTE] = _ModelState(arch, loops, ModuleState([model]))
    return state


def _architecture(model: nn.Module) -> DecoderArchitecture:
    """The model's decode path, built again (with every decode loop and graph) if a tensor of the model was replaced or
    moved or a module's mode flipped since it was built (`tendril.graphs.module_state`): decode paths, fused kernels
    and graphs read the tensors that were the model's then, where they were, in the modes they were in."""
    state = model.__dict__.get(_STATE_ATTRIBUTE)
    change = state.modules.changed() if state is not None else None
    if change is not None:
        warnings.warn(f"tendril.generate({type(model).__name__}): {change} since its decode loops were built; they "
                      "are built again", ModuleChangedWarning, stacklevel=3)
        release_graphs(model)
    return _state(model).arch


def decode_loop(model: nn.Module, plan: Plan) -> DecodeLoop:
    """The decode loop `generate` runs for (model, plan), built if it is not yet (the loop itself, not its graphs)."""
    _architecture(model)
    return _state(model).loops.loop(model, plan)


def graphed_runners(model: nn.Module) -> list[GraphedCallable]:
    """The graphed function that runs `model`'s decode loops (`DecodeLoops.run`; its `.stats` count captures, replays
    and fallbacks of every plan), once `generate` ran the model on CUDA; an empty list otherwise."""
    state = model.__dict__.get(_STATE_ATTRIBUTE)
    run = state.loops.run if state is not None else None
    return [run] if isinstance(run, GraphedCallable) else []


def release_graphs(model: nn.Module) -> None:
    """Drop the decode loops (and their graphs and memory) tendril built for `model`."""
    model.__dict__.pop(_STATE_ATTRIBUTE, None)
