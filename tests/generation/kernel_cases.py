"""Checks of the fused decode kernels against their references, shared by the interpreter run (CPU) and the
GPU tests: every option of each kernel, on odd sizes, into outputs poisoned with NaN."""

from __future__ import annotations

import torch

from tendril.generation.kernels import (
    argmax_kernel,
    attention,
    layers,
    linear,
    prompt_kernel,
    reference,
    step_inputs_kernel,
)
from tendril.generation.kernels.layers import Norm, Projection


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    # fp16/bf16: the kernels round where the reference does, but sum in another order (a last-bit difference
    # before a rounding point can move a result by an ulp: 2**-10 in fp16, 2**-7 in bf16; allow a few)
    tolerance = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    return dict(rtol=tolerance, atol=tolerance)


def _weight(out_f: int, in_f: int, dtype: torch.dtype, device: str, conv1d: bool) -> torch.Tensor:
    w = torch.randn(out_f, in_f, device=device, dtype=torch.float32).mul_(in_f**-0.5).to(dtype)
    return w.t().contiguous().t() if conv1d else w


def linear_cases(dtype: torch.dtype, device: str) -> list[dict]:
    """(projection, norm, activation, gated, addends) cases over sizes that do not divide the block sizes."""
    torch.manual_seed(0)
    k = 72

    def vec(n: int) -> torch.Tensor:
        return torch.randn(n, device=device, dtype=torch.float32).to(dtype)

    layer = Norm("layer", vec(k), vec(k), 1e-5)
    rms = Norm("rms", vec(k), None, 1e-6)
    w = [_weight(n, k, dtype, device, conv1d=i == 0) for i, n in enumerate((40, 24, 24))]
    long = 1100  # a norm over more inputs than one statistics block of a 4-row program (1024)
    return [
        dict(projection=Projection((_weight(16, long, dtype, device, True),), (vec(16),)),
             norm=Norm("layer", vec(long), vec(long), 1e-5)),
        dict(projection=Projection((w[0],), (vec(40),)), norm=layer, activation="gelu_tanh"),
        dict(projection=Projection((w[0],), (vec(40),)), norm=layer, activation="gelu"),
        dict(projection=Projection((w[1], w[2]), (None, None)), norm=rms, activation="silu", gated=True),
        dict(projection=Projection((_weight(40, k, dtype, device, False), w[1], w[2]), (vec(40), vec(24), vec(24))),
             norm=rms),
        dict(projection=Projection((w[1],), (None,)), activation="relu", addends=2),
        dict(projection=Projection((w[0],), (vec(40),)), addends=1),
    ]


LAUNCHES = ((None, None, None), (16, 16, 1), (32, 64, 1), (16, 16, 3), (8, 32, 2, False))
"""(BLOCK_N, BLOCK_K, SPLIT_K[, dot]) of the linear kernel checked (None: its default, which splits K at these
sizes; for several fp16/bf16 rows the tensor-core path, except where dot is False)."""


def check_linear(dtype: torch.dtype, device: str, rows: int = 3, launches=LAUNCHES, pdl: bool | None = None,
                 picked: tuple[int, ...] | None = None) -> int:
    """Every linear case (or those at `picked` indices) at the `launches` configurations (and, in fp16/bf16, the
    default launch into a float32 output); returns the number of comparisons."""
    checked = 0
    cases = linear_cases(dtype, device)
    for case in cases if picked is None else [cases[i] for i in picked]:
        projection = case["projection"]
        out_f = projection.out_sizes[0] if case.get("gated") else projection.out_features
        x = torch.randn(rows, projection.in_features, device=device).to(dtype)
        addends = tuple(torch.randn(rows, out_f, device=device).to(dtype) for _ in range(case.get("addends", 0)))
        options = dict(norm=case.get("norm"), activation=case.get("activation", "none"),
                       gated=case.get("gated", False), addends=addends)
        expected = reference.fused_linear(x, projection, **options)
        for block_n, block_k, split_k, *path in launches:
            for _ in range(1 if split_k == 1 else 2):  # a split launch leaves its counters at zero for the next
                out = torch.full((rows, out_f), float("nan"), device=device, dtype=dtype)
                got = linear.fused_linear(x, projection, out=out, block_n=block_n, block_k=block_k, split_k=split_k,
                                          dot=path[0] if path else None, pdl=pdl, **options)
                assert got.data_ptr() == out.data_ptr() and not got.isnan().any()
                torch.testing.assert_close(got, expected, **_tolerance(dtype))
                assert not projection.split_k_counters.any()
            checked += 1
        if dtype != torch.float32:  # widened on store: the same values, as .float() of the rounded result
            wide = torch.full((rows, out_f), float("nan"), device=device)
            got = linear.fused_linear(x, projection, out=wide, pdl=pdl, **options)
            torch.testing.assert_close(got, expected.float(), **_tolerance(dtype))
            assert torch.equal(got, got.to(dtype).float())
            assert torch.equal(linear.fused_linear(x, projection, out_dtype=torch.float32, pdl=pdl, **options), got)
            checked += 1
    return checked


def check_weight_copies(dtype: torch.dtype, device: str) -> int:
    """A Conv1D-layout projection with copies (`Projection.with_copies`): launches of up to `copy_rows` rows (4 for
    this small 16-bit projection, 1 in float32) read the copies (poisoned with NaN, only those come out NaN),
    launches of more rows the model's weights, and `refresh` writes the copies again, after a change through `.data`
    too. Returns the number of comparisons."""
    torch.manual_seed(3)
    k, n = 72, 40
    weight = _weight(n, k, dtype, device, conv1d=True)
    projection = Projection((weight,), (torch.randn(n, device=device).to(dtype),)).with_copies()
    copy = projection.copies[0]
    assert copy.stride(1) == 1 and torch.equal(copy, weight)
    assert projection.copy_rows == (1 if dtype == torch.float32 else layers.FEW_ROWS)
    checked = 0
    for rows in sorted({1, 2, 3, projection.copy_rows, projection.copy_rows + 1}):
        x = torch.randn(rows, k, device=device).to(dtype)
        torch.testing.assert_close(linear.fused_linear(x, projection), reference.fused_linear(x, projection),
                                   **_tolerance(dtype))
        checked += 1
    copy.fill_(float("nan"))
    for rows in (1, projection.copy_rows, projection.copy_rows + 1):
        got = linear.fused_linear(torch.randn(rows, k, device=device).to(dtype), projection)
        assert got.isnan().all() if rows <= projection.copy_rows else not got.isnan().any(), rows
    projection.refresh(rows=projection.copy_rows + 1)  # launches of that many rows read the model's weights
    assert copy.isnan().all()
    projection.refresh(rows=1)
    assert torch.equal(copy, weight)
    weight.data.mul_(2)  # moves no version counter
    projection.refresh(rows=1)
    assert torch.equal(copy, weight)
    x = torch.randn(1, k, device=device).to(dtype)
    torch.testing.assert_close(linear.fused_linear(x, projection), reference.fused_linear(x, projection),
                               **_tolerance(dtype))
    return checked + 1


def check_argmax(device: str) -> int:
    """The tokens `argmax_kernel.greedy_choice` picks equal `torch.argmax` on rows with ties, -inf rows, a NaN, one
    element, and rows of one chunk and of many (the interpreter checks short rows, also cut into chunks of 16; the
    GPU also a GPT-2 and a 150k vocabulary)."""
    torch.manual_seed(2)
    sizes = (1, 7, 1000) + ((50257, argmax_kernel.CHUNK + 3, 151_936) if device != "cpu" else ())
    step = torch.zeros((), dtype=torch.long, device=device)
    sequences = torch.zeros(3, 4, dtype=torch.long, device=device)
    unfinished = torch.ones(3, dtype=torch.bool, device=device)
    no_eos = torch.zeros(0, dtype=torch.long, device=device)

    def tokens(scores: torch.Tensor, chunk: int | None) -> torch.Tensor:
        return argmax_kernel.greedy_choice(scores, step, sequences, unfinished, no_eos, 0, 1, 8, chunk=chunk)[3]

    checked = 0
    for columns in sizes:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for chunk in (None, 16):
                scores = torch.randn(3, columns, device=device).to(dtype)
                scores[1] = scores[1].round()  # many ties, in several chunks: the first index wins
                scores[2, : columns // 2] = float("-inf")  # whole chunks of -inf
                if columns > 1:
                    scores[0, columns // 3] = float("nan")
                assert torch.equal(tokens(scores, chunk), scores.argmax(-1)), (columns, dtype, chunk)
                assert torch.equal(tokens(torch.full_like(scores, float("-inf")), chunk),
                                   torch.zeros(3, dtype=torch.long, device=device))
                checked += 1
    return checked


def check_greedy_choice(device: str) -> int:
    """`argmax_kernel.greedy_choice` equals `reference.greedy_choice` exactly (new step, sequences, unfinished,
    tokens, the loop's condition), without eos ids and with two, on rows that finish, rows already finished, a row
    whose first largest score is tied, steps with steps left and without, and a step whose column clamps to the
    last; its inputs stay as they were."""
    torch.manual_seed(3)
    checked = 0
    vocab, width, prompt_len = 37, 12, 5
    for rows in (1, 3):
        for eos_ids in ((), (4, 9)):
            for step_value in (0, 3, width):  # the last clamps to column width - 1
                scores = torch.randn(rows, vocab, device=device)
                scores[0, 4] = scores[0].max() + 1  # row 0 chooses eos id 4
                if rows > 1:
                    scores[1] = scores[1].round()  # ties: the first index wins
                sequences = torch.randint(0, vocab, (rows, width), device=device)
                unfinished = torch.tensor([True, False, True][:rows], device=device)
                eos = torch.tensor(eos_ids, dtype=torch.long, device=device)
                step = torch.tensor(step_value, device=device)
                inputs = [t.clone() for t in (scores, step, sequences, unfinished)]
                got = argmax_kernel.greedy_choice(scores, step, sequences, unfinished, eos, 2, prompt_len, 4)
                want = reference.greedy_choice(scores, step, sequences, unfinished, eos, 2, prompt_len, 4)
                for have, expected in zip(got, want, strict=True):
                    assert have.dtype == expected.dtype and torch.equal(have, expected), (rows, eos_ids, step_value)
                for before, now in zip(inputs, (scores, step, sequences, unfinished), strict=True):
                    assert torch.equal(before, now)
                checked += 1
    return checked


def check_step_inputs(dtype: torch.dtype, device: str, learned_positions: bool = True) -> int:
    """`step_inputs_kernel.step_inputs` equals `reference.step_inputs` exactly: token embeddings alone, with learned
    positions (unless not `learned_positions`) and with a rotary table; sequences read in place and through a
    transposed view; counters and offsets whose slot, tokens or positions fall outside their tables (clamped).
    The outputs are filled with NaN first, so an element left unwritten shows."""
    torch.manual_seed(4)
    rows, width, vocab, hidden_size, positions_held, rotary_width = 3, 9, 11, 40, 7, 6
    tokens = torch.randn(vocab, hidden_size, device=device).to(dtype)
    positions = torch.randn(positions_held, hidden_size, device=device).to(dtype)
    rotary = torch.randn(positions_held + 2, 2, rotary_width, device=device).to(dtype)
    checked = 0
    for position_table, rotary_table in ((None, None), (positions, None), (None, rotary), (positions, rotary)):
        if position_table is not None and not learned_positions:
            continue
        for transposed in (False, True):
            for counter_value, offset in ((0, 4), (3, -1), (2, 20), (0, -5)):  # in range; past the end; before
                sequences = torch.randint(-2, vocab + 3, (rows, width), device=device)  # some ids out of range
                if transposed:
                    sequences = sequences.t().contiguous().t()
                counter = torch.tensor(counter_value, device=device)
                base = torch.tensor([-3, 0, 2], device=device)
                tables = (tokens, position_table, rotary_table)
                out = (torch.full((rows, hidden_size), float("nan"), device=device, dtype=dtype),
                       None if rotary_table is None else torch.full((rows, 2, rotary_width), float("nan"),
                                                                    device=device, dtype=dtype))
                got = step_inputs_kernel.step_inputs(sequences, counter, offset, base, *tables, out=out)
                assert all(a is b for a, b in zip(got, out, strict=True))
                want = reference.step_inputs(sequences, counter, offset, base, *tables)
                for have, expected in zip(got, want, strict=True):
                    assert (have is None) == (expected is None)
                    if have is not None:
                        assert have.dtype == expected.dtype and torch.equal(have, expected), (counter_value, offset)
                checked += 1
    return checked


def _rotary(kind: str | None, tokens: int, dims: int, dtype: torch.dtype,
            device: str) -> tuple[str, torch.Tensor, torch.Tensor] | None:
    """Random rotary tables of `kind` ([tokens, dims] cos and sin, angles in [0, 6)); None without a kind."""
    if kind is None:
        return None
    angles = torch.rand(tokens, dims // 2, device=device) * 6
    return kind, angles.cos().repeat(1, 2).to(dtype), angles.sin().repeat(1, 2).to(dtype)


def _assert_cache_matches(cache: torch.Tensor, expected: torch.Tensor, exact: bool) -> None:
    """The kernel's cache entries equal the reference's bit for bit, or (not `exact`) within two ulps of its dtype."""
    if exact:
        assert torch.equal(cache, expected)
    else:
        ulps = 2 * torch.finfo(cache.dtype).eps
        torch.testing.assert_close(cache.float(), expected.float(), rtol=ulps, atol=ulps)


SLOTS = (0, 5, 20)
"""Query slots of the attention checks: the first, inside the first block of 8, the last (past two blocks)."""


def check_attention(dtype: torch.dtype, device: str, slots=SLOTS, exact_cache: bool = True) -> int:
    """MHA and GQA, no/half/interleaved rotary, slots at 0, inside and past a block (given as a tensor and an
    offset, as decode loops give them), with the default tail block, a shorter one and none; cache writes exact
    (bit for bit, as HF's eager ops write them: in float32 that needs the kernel's products and sums of the
    rotary embedding left uncontracted, which only the GPU run can check; the interpreter does not fuse).
    `exact_cache=False` allows a cache value two ulps off: Triton's interpreter rounds float32 to bfloat16
    toward zero where the GPU (and PyTorch) round to nearest even, so each of the two roundings of an
    interpreted bf16 rotary (the products, then their sum) can lose an ulp."""
    torch.manual_seed(1)
    rows, max_len, head_dim = 2, 21, 16
    checked = 0
    for heads, kv_heads in ((4, 4), (4, 2)):
        for kind, dims in ((None, 0), ("half", head_dim), ("interleaved", 8)):
            for slot_value in slots:
                keys = torch.randn(rows, kv_heads, max_len, head_dim, device=device).to(dtype)
                values = torch.randn(rows, kv_heads, max_len, head_dim, device=device).to(dtype)
                key_valid = torch.rand(rows, max_len, device=device) > 0.3
                q = torch.randn(rows, heads * head_dim, device=device).to(dtype)
                k = torch.randn(rows, kv_heads * head_dim, device=device).to(dtype)
                v = torch.randn(rows, kv_heads * head_dim, device=device).to(dtype)
                rotary = _rotary(kind, rows, dims, dtype, device)
                slot = torch.tensor([slot_value], device=device)
                ref_keys, ref_values = keys.clone(), values.clone()
                expected = reference.decode_attention(q, k, v, ref_keys, ref_values, key_valid, slot, 0.25, rotary)
                # slots that are not valid may hold anything: the kernel's copy holds NaN there
                unused = (~key_valid[:, None, :, None]) & (torch.arange(max_len, device=device) != slot_value)[
                    None, None, :, None]
                keys, values = keys.masked_fill(unused, float("nan")), values.masked_fill(unused, float("nan"))
                out = torch.full_like(expected, float("nan"))
                offset = slot_value % 3  # the slot as a decode loop passes it: its step counter and an offset
                tail_s = (None, 4, 0)[(checked // 3) % 3]  # the default tail (16 slots here), a short one, none
                got = attention.decode_attention(q, k, v, keys, values, key_valid, slot - offset, 0.25, rotary,
                                                 out=out, block_s=8, tail_s=tail_s, slot_offset=offset)
                assert not got.isnan().any()
                torch.testing.assert_close(got, expected, **_tolerance(dtype))
                for cache, ref_cache in ((keys, ref_keys), (values, ref_values)):
                    _assert_cache_matches(cache.masked_fill(unused, 0), ref_cache.masked_fill(unused, 0), exact_cache)
                checked += 1
    return checked


def check_attention_through_rows(dtype: torch.dtype, device: str, slots=(0, 5, 20)) -> int:
    """The kernel reading earlier slots through a row table (beam search's reorder by indirection) against
    the reference over an explicitly gathered cache; MHA and GQA, with and without rotary. Every cache entry
    no visible (row, slot) reads through the table is NaN, so a read of the wrong row shows."""
    torch.manual_seed(2)
    rows, max_len, head_dim = 3, 21, 16
    checked = 0
    for heads, kv_heads, kind in ((4, 4, None), (4, 2, "half")):
        for slot_value in slots:
            keys = torch.randn(rows, kv_heads, max_len, head_dim, device=device).to(dtype)
            values = torch.randn(rows, kv_heads, max_len, head_dim, device=device).to(dtype)
            key_valid = torch.rand(rows, max_len, device=device) > 0.2
            source_rows = torch.randint(0, rows, (rows, max_len), device=device, dtype=torch.int32)
            q = torch.randn(rows, heads * head_dim, device=device).to(dtype)
            k = torch.randn(rows, kv_heads * head_dim, device=device).to(dtype)
            v = torch.randn(rows, kv_heads * head_dim, device=device).to(dtype)
            rotary = _rotary(kind, rows, head_dim, dtype, device)
            slot = torch.tensor([slot_value], device=device)
            read = torch.zeros(rows, max_len, dtype=torch.bool, device=device)
            seen = key_valid & (torch.arange(max_len, device=device) < slot_value)
            read[source_rows.long()[seen], torch.nonzero(seen)[:, 1]] = True
            ref_keys, ref_values = keys.clone(), values.clone()
            expected = reference.decode_attention(q, k, v, ref_keys, ref_values, key_valid, slot, 0.25, rotary,
                                                  source_rows=source_rows)
            gathered = [reference._read_rows(c, source_rows, slot) for c in (ref_keys, ref_values)]
            explicit = reference.decode_attention(q, k, v, *gathered, key_valid, slot, 0.25, rotary)
            torch.testing.assert_close(expected, explicit, rtol=0, atol=0)
            unread = ~read[:, None, :, None]
            keys, values = keys.masked_fill(unread, float("nan")), values.masked_fill(unread, float("nan"))
            out = torch.full_like(expected, float("nan"))
            got = attention.decode_attention(q, k, v, keys, values, key_valid, slot, 0.25, rotary,
                                             source_rows=source_rows, out=out, block_s=8)
            assert not got.isnan().any()
            torch.testing.assert_close(got, expected, **_tolerance(dtype))
            own = (slice(None), slice(None), slot_value)  # each row wrote its own key and value at the slot
            assert torch.equal(keys[own], ref_keys[own]) and torch.equal(values[own], ref_values[own])
            checked += 1
    return checked


PROMPT_TOKENS = (1, 5, 11)
"""Prompt lengths of the prompt attention checks: one token, one block of 8, past two blocks of 4."""


def check_prompt_attention(dtype: torch.dtype, device: str, tokens=PROMPT_TOKENS, exact_cache: bool = True) -> int:
    """A prompt of a few tokens per row into an empty cache: MHA and GQA, no/half/interleaved rotary, one token,
    one block and several, tokens invalid at random (padding). The kernel's cache starts NaN: the prompt's slots
    must be written as the reference writes them (exactly, or within two ulps as `check_attention` allows with
    `exact_cache=False`) and every other slot left alone."""
    torch.manual_seed(3)
    rows, max_len, head_dim = 2, 21, 16
    checked = 0
    for heads, kv_heads in ((4, 4), (4, 2)):
        for kind, dims in ((None, 0), ("half", head_dim), ("interleaved", 8)):
            for length in tokens:
                queries = rows * length
                key_valid = torch.rand(rows, max_len, device=device) > 0.3
                q = torch.randn(queries, heads * head_dim, device=device).to(dtype)
                k = torch.randn(queries, kv_heads * head_dim, device=device).to(dtype)
                v = torch.randn(queries, kv_heads * head_dim, device=device).to(dtype)
                rotary = _rotary(kind, queries, dims, dtype, device)
                ref_keys = torch.zeros(rows, kv_heads, max_len, head_dim, device=device, dtype=dtype)
                ref_values = torch.zeros_like(ref_keys)
                expected = reference.prompt_attention(q, k, v, ref_keys, ref_values, key_valid, 0.25, rotary)
                keys, values = torch.full_like(ref_keys, float("nan")), torch.full_like(ref_values, float("nan"))
                out = torch.full_like(expected, float("nan"))
                block_s = 4 if length > 8 else None
                got = prompt_kernel.prompt_attention(q, k, v, keys, values, key_valid, 0.25, rotary, out=out,
                                                     block_s=block_s)
                assert not got.isnan().any()
                torch.testing.assert_close(got, expected, **_tolerance(dtype))
                for cache, ref_cache in ((keys, ref_keys), (values, ref_values)):
                    assert cache[:, :, length:].isnan().all()
                    _assert_cache_matches(cache[:, :, :length], ref_cache[:, :, :length], exact_cache)
                checked += 1
    return checked
