"""The decode loop of one `generate` plan: prompt pass, first token choice, then `while_loop` over the rest.

`Plan` is everything about a call that is not a tensor (one graph per input shape per plan); `DecodeLoop` maps
(prompt, mask, noise key) to the loop's final state. How the one-token forward runs inside the loop is the
plan's `step`, one of `STEPS`:

- "eager": the architecture's own forward, captured as is (PyTorch's kernels);
- "compiled": that forward through `torch.compile` (Inductor), one graph with no breaks; the first call per
  shape pays the compilation (`compiled_step`);
- "fused": tendril's Triton decode kernels (`tendril.generation.kernels`), no compilation of the forward; they
  also run prompts of up to `FUSED_PROMPT_TOKENS` tokens (all rows counted), longer ones the model's own forward.

With "compiled" or "fused" on CUDA, beam search also runs its per-step bookkeeping through Inductor
(`BeamSearch(compile_bookkeeping=True)`): there the forward is a few kernels per layer and the bookkeeping's several
dozen small operations would otherwise be as many launches again. One compile per process serves every search.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, get_args

import torch
from torch import nn

from tendril.generation.architectures import DecoderArchitecture
from tendril.generation.beam import BeamSearch
from tendril.generation.cache import StaticKVCache
from tendril.generation.compile_limit import WithinLimit
from tendril.generation.greedy import TokenSearch
from tendril.generation.processors import LogitsProcessing
from tendril.generation.state import Decoder, StepForward
from tendril.generation.streaming import TokenRing
from tendril.graphs.capture import capturing
from tendril.graphs.control import while_loop

Step = Literal["eager", "compiled", "fused"]
STEPS: tuple[Step, ...] = get_args(Step)
"""How the one-token forward runs inside the loop (see the module docstring)."""


FUSED_PROMPT_TOKENS = 64
"""The longest prompt (tokens of all rows together) that `step="fused"` runs through its kernels. Their projections
read the weights once for every 16 tokens (one tensor-core row block, `kernels.launch`), where the model's own
forward reads them once in cuBLAS's matrix products: past four row blocks the own forward's fewer weight reads
outweigh the fused kernels' fewer launches."""


def check_step(step: object) -> Step:
    """`step` if it names one of `STEPS`; a ValueError listing them otherwise."""
    if step not in STEPS:
        raise ValueError(
            f"step must be one of {', '.join(map(repr, STEPS))}, got {step!r}: 'eager' captures the model's own "
            "forward, 'compiled' runs it through torch.compile (Inductor), 'fused' uses tendril's Triton decode kernels"
        )
    return step


@dataclass(frozen=True)
class Plan:
    """Everything about a `generate` call that is not a tensor: one graph (per input shape) per plan."""

    max_new_tokens: int
    processing: LogitsProcessing
    eos: tuple[int, ...]
    pad_token_id: int
    beam_fill_token_id: int
    num_beams: int
    length_penalty: float
    early_stopping: bool | str
    step: Step = "eager"
    """How the one-token forward runs: one of `STEPS`."""
    stream_slots: int = 0
    """Slots of the token ring the loop publishes each token into (`streaming.TokenRing`); 0: no streaming."""

    @classmethod
    def build(
        cls,
        *,
        max_new_tokens: int,
        processing: LogitsProcessing,
        eos: Sequence[int],
        pad: int | None,
        num_beams: int = 1,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        step: Step = "eager",
        stream_slots: int = 0,
    ) -> Plan:
        """The plan of a call with these options, each at HF's default when not given (eos and pad already resolved)."""
        return cls(
            max_new_tokens=max_new_tokens, processing=processing, eos=tuple(eos),
            pad_token_id=pad if pad is not None else 0,
            # HF's fill value for beam outputs is `pad_token_id or eos_token_id[0]`: a pad id of 0 falls through
            beam_fill_token_id=pad if pad else (eos[0] if eos else -1),
            num_beams=num_beams, length_penalty=float(length_penalty), early_stopping=early_stopping,
            step=check_step(step), stream_slots=stream_slots,
        )


class DecodeLoop:
    """(prompt, mask, noise_key) -> final loop state: prefill, first choice, then the device loop."""

    def __init__(self, model: nn.Module, arch: DecoderArchitecture, plan: Plan) -> None:
        self.arch = arch
        self.plan = plan
        weight = next(model.parameters())
        self.cache_dtype = weight.dtype
        self.eos = torch.tensor(plan.eos, dtype=torch.long, device=weight.device)
        self.step_forward = step_forward(arch, plan.step)
        self.ring = TokenRing(plan.stream_slots, weight.device) if plan.stream_slots else None
        """Where each chosen token is published for a streamer (greedy and sampling only), if streaming."""
        self.__qualname__ = f"generate[{type(model).__name__}]"

    def __call__(self, prompt: torch.Tensor, mask: torch.Tensor, noise_key: torch.Tensor) -> tuple[torch.Tensor, ...]:
        search = self.search(prompt, mask, noise_key)
        carried = search.start(search.decoder.prefill())
        if self.step_forward is not None and not capturing():
            _warm_step(search.decoder)
        return while_loop(search.cond, search.body, carried, max_iterations=self.plan.max_new_tokens,
                          name=f"generate ({type(search).__name__})")

    def search(self, prompt: torch.Tensor, mask: torch.Tensor, noise_key: torch.Tensor) -> TokenSearch | BeamSearch:
        """The search (cond/body/start over a new decoder and cache) for these inputs."""
        plan = self.plan
        # beam search reorders the cache through a row table when the fused kernels read it (a gather of a
        # small int32 table instead of every layer's keys and values); PyTorch's attention needs the copy
        row_table = plan.num_beams > 1 and plan.step == "fused" and self.arch.fused_step_reads_row_table
        fused_prompt = plan.step == "fused" and prompt.numel() <= FUSED_PROMPT_TOKENS
        decoder = Decoder.build(self.arch, prompt, mask, plan.max_new_tokens, plan.processing, self.eos, noise_key,
                                self.cache_dtype, self.step_forward, row_table,
                                self.step_forward if fused_prompt else None)
        if plan.num_beams == 1:
            return TokenSearch(decoder, plan.pad_token_id, self.ring)
        return BeamSearch(decoder, prompt.shape[0] // plan.num_beams, plan.num_beams, plan.length_penalty,
                          plan.early_stopping, plan.beam_fill_token_id,
                          compile_bookkeeping=plan.step != "eager" and prompt.is_cuda)


def _warm_step(decoder: Decoder) -> None:
    """Run the step once for these shapes as the loop calls it (`Decoder.step_at`), so it is never compiled while a
    graph is being captured (a loop that stops at once would otherwise first call it during capture). It writes the
    last cache slot, which no step reads: queries only see earlier slots, and the last token is never forwarded."""
    rows, device = decoder.prompt.shape[0], decoder.prompt.device
    last_slot = torch.full((), decoder.max_len - 1, dtype=torch.long, device=device)
    decoder.step_at(torch.zeros(rows, decoder.max_len, dtype=torch.long, device=device), last_slot, 0)


COMPILE_BACKEND = "inductor"
"""`torch.compile` backend of `step="compiled"` (tests use "eager" to check tracing without code generation)."""


def compiled_step(arch: DecoderArchitecture) -> StepForward:
    """`arch.forward` compiled for one-token steps: static shapes, one graph (no breaks, so no host code), every new
    shape (rows, cache layout) compiled anew; past dynamo's recompile limit a shape runs `arch.forward` uncompiled
    (`compile_limit`)."""
    compiled = torch.compile(arch.forward, backend=COMPILE_BACKEND, fullgraph=True, dynamic=False)
    return WithinLimit(compiled, arch.forward, "step='compiled': the one-token forward", _shape)


class _Shape(NamedTuple):
    """What a compiled step's graph is specialised on."""

    rows: int
    cache_slots: int
    dtype: torch.dtype
    row_table: bool


def _shape(tokens: torch.Tensor, positions: torch.Tensor, query_slots: torch.Tensor, cache: StaticKVCache) -> _Shape:
    return _Shape(tokens.shape[0], cache.max_len, cache.storage.dtype, cache.source_rows is not None)


def step_forward(arch: DecoderArchitecture, step: Step) -> StepForward | None:
    """What runs the one-token forward for `step` (None: `arch.forward` itself)."""
    if step == "compiled":
        return compiled_step(arch)
    if step == "fused":
        return arch.fused_step()
    return None
