"""Beam search (and beam sampling) as a device loop, with HF's semantics and no host decisions.

HF's `_beam_search` already keeps its bookkeeping in fixed-size tensors; what keeps it on the host is
`cur_len` as a Python int (column writes, length penalty), the stop test, and a cache it reorders by
reallocating. Here `cur_len` is a device tensor, columns are written by `scatter`, the length penalty is
computed on the device, the cache is reordered in place (through its row table when the decoder's cache has one,
which the fused step reads, by copying every layer's rows otherwise: `reorder_rows` inside the bookkeeping,
`bookkeep_and_reorder`, then `StaticKVCache.reorder_storage`), and
the stop test is a carried device flag. The finished hypotheses are HF's fixed-size scoreboard: the best
`num_beams` (sequence, score) pairs per batch item, merged with the newly finished candidates by a top-k
each step.

Carried state (B batch items, K beams, L = prompt + max_new_tokens, M = max_new_tokens):
  cur_len [] long; running_sequences [B,K,L] long; running_scores [B,K] float; sequences [B,K,L] long;
  scores [B,K] float; finished [B,K] bool; improvable [B,1] bool; running_beam_indices [B,K,M] int32;
  beam_indices [B,K,M] int32; done [] bool.

The body is also safe to evaluate on a finished state (predicated loops do that and discard the result):
column indices are clamped into range and the cache is not reordered once `done` is set (its rows keep their
places; through a row table, the slot such a step rewrote in every row points at the row itself again).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tendril.generation import kernels
from tendril.generation.cache import reorder_rows
from tendril.generation.compile_limit import WithinLimit
from tendril.generation.noise import gumbel
from tendril.generation.state import Decoder, is_eos

Carried = tuple[torch.Tensor, ...]
_NEG = -1.0e9


def _gather_beams(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """tensor [B, K, ...] -> [B, K', ...] picking beams `indices` [B, K'] per batch item (a `gather` on indices
    expanded over the trailing dims: `take_along_dim` would fix those sizes in a compiled graph)."""
    trailing = tensor.shape[2:]
    index = indices.reshape(*indices.shape, *([1] * len(trailing))).expand(*indices.shape, *trailing)
    return tensor.gather(1, index)


def _largest(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [B, k] of the k largest of each row of `scores` [B, n], largest first, as `kernels.beam_top_k` orders
    them: equal scores (-0.0 and +0.0 among them) in index order, NaN above every number. Eagerly, one stable sort;
    under `torch.compile`, `_ranked`, which Inductor fuses with the operations around it (a sort or `torch.topk`
    would stay a kernel of its own, and `topk` leaves the order of ties open)."""
    if torch.compiler.is_compiling():
        return _ranked(scores, k)
    return torch.sort(scores, dim=-1, descending=True, stable=True)[1][..., :k]


def _ranked(scores: torch.Tensor, k: int) -> torch.Tensor:
    """`_largest` by comparing every pair of a row ([B, n, n]: bookkeeping's rows hold a few beams' scores)."""
    positions = torch.arange(scores.shape[-1], device=scores.device)
    nan = scores.isnan()
    value = torch.where(nan, 0.0, scores)
    other_nan, own_nan = nan[..., None, :], nan[..., :, None]
    same_class = other_nan == own_nan
    greater = (other_nan & ~own_nan) | (same_class & (value[..., None, :] > value[..., :, None]))
    equal_before = same_class & (value[..., None, :] == value[..., :, None]) & (positions[None, :] < positions[:, None])
    rank = (greater | equal_before).sum(-1)  # [B, n]: the entries ahead of each, a permutation of 0..n-1
    chosen = rank[..., None, :] == torch.arange(k, device=scores.device)[:, None]  # [B, k, n], one entry a row
    return (chosen * positions).sum(-1)


def _write_column(tensor: torch.Tensor, column: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Copy of tensor [B, K, N] with column `column` (0-d) set to `values` [B, K]."""
    index = column.expand(*tensor.shape[:2], 1)
    return tensor.scatter(2, index, values[..., None].to(tensor.dtype))


@dataclass(frozen=True)
class BeamRules:
    """What beam bookkeeping needs besides tensors: constants of a model and a generation config (the lengths
    come from the tensors' sizes, so that one compiled `bookkeep` serves every prompt length)."""

    vocab: int
    length_penalty: float
    early_stopping: bool | str


def bookkeep(
    rules: BeamRules,
    top_log_probs: torch.Tensor,
    top_indices: torch.Tensor,
    eos: torch.Tensor,
    top_beam_mask: torch.Tensor,
    batch_offset: torch.Tensor,
    same_rows: torch.Tensor,
    lengths: torch.Tensor,
    cur_len: torch.Tensor,
    running_sequences: torch.Tensor,
    running_scores: torch.Tensor,
    sequences: torch.Tensor,
    scores: torch.Tensor,
    finished: torch.Tensor,
    improvable: torch.Tensor,
    running_beam_indices: torch.Tensor,
    beam_indices: torch.Tensor,
    done: torch.Tensor,
) -> tuple[Carried, torch.Tensor]:
    """Steps b-f of a beam step after the top-k: the next carried state, and the rows the cache takes (row `i`
    becomes old row `rows[i]`). A pure function of tensors and `rules`, so `torch.compile` can fuse its many small
    operations into a few kernels (`BeamSearch(compile_bookkeeping=True)`). `lengths` is [prompt length, max new
    tokens] (long): lengths as tensors, not sizes, keep one compile for every prompt length (a size used as a
    number would be specialised on)."""
    b, k = running_scores.shape
    vocab, prompt_len, max_new_tokens = rules.vocab, lengths[0], lengths[1]
    max_len = prompt_len + max_new_tokens
    column = torch.minimum(cur_len, max_len - 1)
    generated = torch.minimum(cur_len - prompt_len, max_new_tokens - 1)
    source_beams = top_indices // vocab
    top_tokens = top_indices % vocab
    top_sequences = _write_column(_gather_beams(running_sequences, source_beams), column, top_tokens)
    top_beam_indices = _write_column(
        _gather_beams(running_beam_indices, source_beams), generated, source_beams + batch_offset
    )

    # c. which continuations hit a stopping criterion (eos, or the length limit)
    hits = is_eos(top_tokens, eos) | (cur_len + 1 >= max_len)

    # d. the best `num_beams` unfinished continuations keep running
    top_running = top_log_probs + hits.to(torch.float32) * _NEG
    keep = _largest(top_running, k)
    running_sequences = _gather_beams(top_sequences, keep)
    running_scores = _gather_beams(top_running, keep)
    running_beam_indices = _gather_beams(top_beam_indices, keep)

    # e. merge newly finished hypotheses into the fixed-size scoreboard
    just_finished = hits & top_beam_mask[None, :]
    candidate = top_log_probs / _penalty(generated + 1, rules.length_penalty)
    if rules.early_stopping is True:
        candidate = candidate + finished.all(-1, keepdim=True).to(torch.float32) * _NEG
    candidate = candidate + (~improvable).to(torch.float32) * _NEG
    candidate = candidate + (~just_finished).to(torch.float32) * _NEG
    merged = _largest(torch.cat((scores, candidate), dim=1), k)
    sequences = _gather_beams(torch.cat((sequences, top_sequences), dim=1), merged)
    scores = _gather_beams(torch.cat((scores, candidate), dim=1), merged)
    beam_indices = _gather_beams(torch.cat((beam_indices, top_beam_indices), dim=1), merged)
    finished = _gather_beams(torch.cat((finished, just_finished), dim=1), merged)

    # f. the cache's rows for the surviving beams, then whether to go on
    source_rows = running_beam_indices.view(b * k, -1).gather(1, generated.expand(b * k, 1)).squeeze(1)
    rows = torch.where(done, same_rows, source_rows.long())
    cur_len = cur_len + 1
    generated_now = cur_len - prompt_len
    improvable = _still_improvable(rules, improvable, running_scores, scores, finished, generated_now, max_new_tokens)
    go_on = improvable.any() & ~hits.all()
    if rules.early_stopping is True:
        go_on = go_on & ~finished.all()
    carried = (cur_len, running_sequences, running_scores, sequences, scores, finished, improvable,
               running_beam_indices, beam_indices, ~go_on)  # fmt: skip
    return carried, rows


def bookkeep_and_reorder(
    rules: BeamRules,
    table: torch.Tensor | None,
    key_valid: torch.Tensor,
    slots: torch.Tensor,
    row_ids: torch.Tensor,
    *args: torch.Tensor,
) -> tuple[Carried, torch.Tensor]:
    """`bookkeep(rules, *args)`, then the cache's row table (None: it has none) and `key_valid` reordered in place
    by the rows it returns (`tendril.generation.cache.reorder_rows`; `slots` and `row_ids` are the cache's). One
    function, so that the compiled bookkeeping fuses the reorder's gathers and copies into its own kernels. Returns
    what `bookkeep` does; the cache's `reorder_storage` is the caller's."""
    state, rows = bookkeep(rules, *args)
    cur_len = args[7]  # `bookkeep`'s cur_len: the rows last wrote slot cur_len - 1
    reorder_rows(table, key_valid, slots, row_ids, rows, cur_len - 1)
    return state, rows


class BeamSearch:
    """cond/body/start of beam search (or beam sampling) over one `Decoder`; rows are batch-major, K per item.

    `compile_bookkeeping`: run `bookkeep_and_reorder` through `torch.compile` (Inductor), which fuses its several
    dozen small operations, each a kernel launch of its own otherwise, into a few; for the steps whose forward takes
    a few kernels per layer, where those launches would be much of a step. Its first call compiles, so it must not
    meet a capture first (the decode loop's eager warm-up call makes it)."""

    def __init__(
        self,
        decoder: Decoder,
        batch_size: int,
        num_beams: int,
        length_penalty: float,
        early_stopping: bool | str,
        fill_token_id: int,
        compile_bookkeeping: bool = False,
    ) -> None:
        if early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
        self.decoder = decoder
        self.batch_size = batch_size
        self.num_beams = num_beams
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.fill_token_id = fill_token_id
        self.beams_to_keep = max(2, 1 + decoder.eos.numel()) * num_beams
        device = decoder.eos.device
        self.top_beam_mask = torch.arange(self.beams_to_keep, device=device) < num_beams
        self.batch_offset = torch.arange(batch_size, device=device)[:, None] * num_beams
        self.same_rows = torch.arange(batch_size * num_beams, device=device)
        # [prompt length, max new tokens], made by kernels (a search is built inside a capture: no host copy)
        prompt_len, new_tokens = decoder.prompt_len, decoder.max_new_tokens
        self.lengths = torch.arange(2, device=device) * (new_tokens - prompt_len) + prompt_len
        self._bookkeep = compiled_bookkeep() if compile_bookkeeping else bookkeep_and_reorder

    def start(self, prefill_logits: torch.Tensor) -> Carried:
        """The state after the first beam step on the prompt's logits (the prompt is [B*K, P])."""
        d, b, k = self.decoder, self.batch_size, self.num_beams
        prompt, device = d.prompt, d.prompt.device
        running_sequences = torch.full((b, k, d.max_len), self.fill_token_id, dtype=torch.long, device=device)
        running_sequences[:, :, : d.prompt_len] = prompt.view(b, k, -1)
        running_scores = torch.zeros((b, k), dtype=torch.float32, device=device)
        running_scores[:, 1:] = _NEG
        running_beam_indices = torch.full((b, k, d.max_new_tokens), -1, dtype=torch.int32, device=device)
        carried = (
            torch.full((), d.prompt_len, dtype=torch.long, device=device),
            running_sequences,
            running_scores,
            running_sequences.clone(),
            torch.full((b, k), _NEG, dtype=torch.float32, device=device),
            torch.zeros((b, k), dtype=torch.bool, device=device),
            torch.ones((b, 1), dtype=torch.bool, device=device),
            running_beam_indices,
            running_beam_indices.clone(),
            torch.zeros((), dtype=torch.bool, device=device),
        )
        return self.choose(prefill_logits, *carried)

    def cond(self, *carried: torch.Tensor) -> torch.Tensor:
        return ~carried[-1]

    def body(self, *carried: torch.Tensor) -> Carried:
        cur_len, running_sequences = carried[0], carried[1]
        flat = running_sequences.view(-1, running_sequences.shape[-1])
        return self.choose(self.decoder.step_at(flat, cur_len, -1), *carried)  # the last token, at cur_len - 1

    def choose(self, logits: torch.Tensor, *carried: torch.Tensor) -> Carried:
        d, b, k = self.decoder, self.batch_size, self.num_beams
        cur_len, running_sequences, running_scores = carried[0], carried[1], carried[2]
        vocab = logits.shape[-1]

        # a. log-probabilities, processed, accumulated over each beam
        log_probs = F.log_softmax(logits, dim=-1)
        log_probs = d.process(log_probs, running_sequences.view(b * k, -1), cur_len)
        log_probs = (log_probs.view(b, k, vocab) + running_scores[:, :, None]).view(b, k * vocab)

        # b. the top `beams_to_keep` continuations over all beams (sampled without replacement if sampling):
        # `kernels.beam_top_k`: two kernels on CUDA, where `torch.topk` of so wide a row launches a chain of them
        if d.processing.do_sample:
            picked = kernels.beam_top_k(log_probs + gumbel(d.noise_key, cur_len, b, k * vocab), self.beams_to_keep)[1]
            top_log_probs, order = log_probs.gather(1, picked).sort(dim=-1, descending=True)
            top_indices = picked.gather(1, order)
        else:
            top_log_probs, top_indices = kernels.beam_top_k(log_probs, self.beams_to_keep)

        rules, cache = BeamRules(vocab, self.length_penalty, self.early_stopping), d.cache
        state, rows = self._bookkeep(
            rules, cache.source_rows, cache.key_valid, cache.slots, cache.row_ids, top_log_probs, top_indices, d.eos,
            self.top_beam_mask, self.batch_offset, self.same_rows, self.lengths, *carried,
        )  # fmt: skip
        cache.reorder_storage(rows)
        return state


@functools.cache
def compiled_bookkeep() -> Callable[..., tuple[Carried, torch.Tensor]]:
    """`bookkeep_and_reorder` through Inductor, made once per process: one compile serves every search of a model and
    config (sizes dynamic; the rules are constants, a new set of them compiles again, and past dynamo's recompile
    limit runs uncompiled, `compile_limit`). Its float32 divisions round as eager's do (Triton's `/` is approximate
    unless Inductor is told otherwise), so the scores, and the hypotheses chosen by comparing them, are eager's bit
    for bit."""
    compiled = torch.compile(bookkeep_and_reorder, fullgraph=True, dynamic=True, options=_eager_numerics())
    return WithinLimit(compiled, bookkeep_and_reorder, "beam search's bookkeeping", _rules_of)


def _rules_of(rules: BeamRules, table: torch.Tensor | None, *_: torch.Tensor) -> tuple[object, ...]:
    """What compiled bookkeeping is specialised on: its rules and whether the cache has a row table."""
    return (rules, "row table" if table is not None else "no row table")


def _eager_numerics() -> dict[str, str | int | bool | Callable[..., Any]]:
    """Inductor's options for eager's rounding where this torch has them (their names moved between releases)."""
    from torch._inductor import config

    options: dict[str, str | int | bool | Callable[..., Any]] = {}
    numerics = getattr(config, "eager_numerics", None)
    if hasattr(numerics, "division_rounding"):
        options["eager_numerics.division_rounding"] = True
    elif hasattr(config, "emulate_divison_rounding"):
        options["emulate_divison_rounding"] = True
    return options


def _penalty(length: torch.Tensor, length_penalty: float) -> torch.Tensor:
    """length ** length_penalty, computed in float64 as HF does in Python, then used in float32."""
    return (length.to(torch.float64) ** length_penalty).to(torch.float32)


def _still_improvable(
    rules: BeamRules,
    improvable: torch.Tensor,
    running_scores: torch.Tensor,
    scores: torch.Tensor,
    finished: torch.Tensor,
    generated: torch.Tensor,
    max_new_tokens: torch.Tensor,
) -> torch.Tensor:
    """HF's early-stop heuristic: can the best running beam still beat the worst finished one? (`generated`: the
    tokens generated so far, 0-d.)"""
    best_length = max_new_tokens if rules.early_stopping == "never" and rules.length_penalty > 0.0 else generated
    best_running = running_scores[:, :1] / _penalty(best_length, rules.length_penalty)
    worst_finished = torch.where(finished, scores.min(dim=1, keepdim=True)[0], _NEG)
    return improvable & (best_running > worst_finished).any(dim=-1, keepdim=True)


def beam_result(carried: Carried, batch_size: int, prompt_len: int, num_return_sequences: int) -> torch.Tensor:
    """The best `num_return_sequences` hypotheses per batch item, cropped as HF crops them.

    One host sync, after the loop (the crop length is data-dependent)."""
    sequences, beam_indices = carried[3], carried[8]
    r = num_return_sequences
    sequences = sequences[:, :r].reshape(batch_size * r, -1)
    # a host read, outside any capture: the loop has ended, and the crop's length decides the result's shape
    generated = int((beam_indices[:, :r] + 1).bool().sum(dim=-1).max().item())
    return sequences[:, : prompt_len + generated]
