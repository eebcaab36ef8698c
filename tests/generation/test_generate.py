"""`tendril.generate` against HF's `model.generate`, token for token (fp32, CPU eager path)."""

from __future__ import annotations

import pytest
import torch

from tendril.generation import UnsupportedModelError, generate
from tests.generation.models import hf_generate, left_padded, tiny_model

NEW = 12


def _eos_hit_by(model, ids, mask, row: int = 0, step: int = 3) -> int:
    """A token that greedy decoding of `row` produces at `step`: using it as eos forces an early stop."""
    out = hf_generate(model, ids, mask, None, max_new_tokens=NEW)
    return int(out[row, ids.shape[1] + step])


def _check(model, ids, mask, eos, **options):
    expected = hf_generate(model, ids, mask, eos, max_new_tokens=NEW, **options)
    got = generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=eos if eos is not None else [], pad_token_id=0,
                   **options)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert torch.equal(got, expected), (got, expected)
    return got


@pytest.mark.parametrize("family", ["gpt2", "gptj", "llama"])
def test_greedy_matches_hf_with_left_padding_and_ragged_eos(family):
    model = tiny_model(family)
    ids, mask = left_padded([6, 3, 5])
    _check(model, ids, mask, None)
    eos = _eos_hit_by(model, ids, mask, row=1, step=2)
    out = _check(model, ids, mask, eos)
    assert (out[1, ids.shape[1] + 3 :] == 0).all()  # row 1 stopped early and was padded, like HF


def test_greedy_stops_when_every_row_hit_eos(gpt2):
    ids, mask = left_padded([4])
    eos = _eos_hit_by(gpt2, ids, mask, step=0)
    out = _check(gpt2, ids, mask, eos)
    assert out.shape[1] == ids.shape[1] + 1


@pytest.mark.parametrize("family", ["gpt2", "gptj", "llama"])
def test_beam_search_matches_hf(family):
    model = tiny_model(family)
    ids, mask = left_padded([5, 2])
    _check(model, ids, mask, None, num_beams=3)
    _check(model, ids, mask, _eos_hit_by(model, ids, mask, row=0, step=1), num_beams=3, num_return_sequences=2)


@pytest.mark.parametrize(
    "options",
    [
        dict(num_beams=4, length_penalty=0.5),
        dict(num_beams=4, length_penalty=2.0, early_stopping=True),
        dict(num_beams=2, early_stopping="never", length_penalty=1.5),
        dict(num_beams=4, num_return_sequences=4, early_stopping=True),
    ],
)
def test_beam_options_match_hf_with_early_eos(gpt2, options):
    ids, mask = left_padded([4, 6, 3], seed=1)
    for row in range(3):
        _check(gpt2, ids, mask, _eos_hit_by(gpt2, ids, mask, row=row, step=row + 1), **options)


def test_repetition_penalty_matches_hf(gpt2):
    ids, mask = left_padded([6, 2], seed=2)
    _check(gpt2, ids, mask, None, repetition_penalty=1.5)
    _check(gpt2, ids, mask, None, repetition_penalty=0.7)
    _check(gpt2, ids[:1], mask[:1], None, repetition_penalty=1.5, num_beams=3)


def test_sampling_is_reproducible_with_seed_and_varies_without(gpt2):
    ids, mask = left_padded([5, 3])
    sample = dict(max_new_tokens=NEW, eos_token_id=[], do_sample=True, top_k=0)
    a = generate(gpt2, ids, mask, seed=11, **sample)
    assert torch.equal(a, generate(gpt2, ids, mask, seed=11, **sample))
    assert not torch.equal(a, generate(gpt2, ids, mask, seed=12, **sample))
    torch.manual_seed(5)
    b = generate(gpt2, ids, mask, **sample)
    torch.manual_seed(5)
    assert torch.equal(b, generate(gpt2, ids, mask, **sample))
    beams = generate(gpt2, ids, mask, seed=3, num_beams=3, num_return_sequences=2, **sample)
    assert beams.shape == (4, ids.shape[1] + NEW)
    assert torch.equal(beams, generate(gpt2, ids, mask, seed=3, num_beams=3, num_return_sequences=2, **sample))


@pytest.mark.parametrize("options", [dict(top_k=0), dict(temperature=0.6, top_k=8, top_p=0.9, repetition_penalty=1.3)])
def test_sampling_draws_from_hfs_processed_distribution(gpt2, options):
    """First sampled token of many rows against the probabilities HF's processors give (chi-square)."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    ids, mask = left_padded([5])
    rows = 6000
    out = generate(gpt2, ids.expand(rows, -1), mask.expand(rows, -1), max_new_tokens=1, eos_token_id=[],
                   do_sample=True, seed=0, **options)
    counts = torch.bincount(out[:, -1], minlength=gpt2.config.vocab_size).double()
    chain = LogitsProcessorList()
    if options.get("repetition_penalty", 1.0) != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(options["repetition_penalty"]))
    if options.get("temperature", 1.0) != 1.0:
        chain.append(TemperatureLogitsWarper(options["temperature"]))
    if options.get("top_k"):
        chain.append(TopKLogitsWarper(options["top_k"]))
    if options.get("top_p", 1.0) < 1.0:
        chain.append(TopPLogitsWarper(options["top_p"]))
    with torch.no_grad():
        logits = gpt2(ids, attention_mask=mask).logits[:, -1].float()
    probs = chain(ids, logits).softmax(-1)[0].double()
    assert counts[probs == 0].sum() == 0
    expected = probs * rows
    bins = expected >= 5
    chi2 = (((counts - expected) ** 2 / expected.clamp(min=1e-12))[bins]).sum().item()
    dof = int(bins.sum()) - 1
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, (chi2, dof)


def test_missing_attention_mask_is_inferred_from_the_pad_token_as_hf_does(gpt2):
    ids, mask = left_padded([6, 3], seed=4)  # padding id 0
    expected = hf_generate(gpt2, ids, mask, None, max_new_tokens=NEW)
    assert torch.equal(generate(gpt2, ids, max_new_tokens=NEW, eos_token_id=[], pad_token_id=0), expected)
    full, _ = left_padded([6, 6], seed=4)
    expected = hf_generate(gpt2, full, torch.ones_like(full), None, max_new_tokens=4)
    assert torch.equal(generate(gpt2, full, max_new_tokens=4, eos_token_id=[], pad_token_id=0), expected)


def test_options_outside_the_supported_set_are_refused(gpt2):
    ids, mask = left_padded([3])
    with pytest.raises(ValueError, match="does not support no_repeat_ngram_size"):
        generate(gpt2, ids, mask, max_new_tokens=2, no_repeat_ngram_size=2)
    with pytest.raises(ValueError, match="num_return_sequences"):
        generate(gpt2, ids, mask, max_new_tokens=2, num_return_sequences=2)
    with pytest.raises(ValueError, match="must be <= num_beams"):
        generate(gpt2, ids, mask, max_new_tokens=2, num_beams=2, num_return_sequences=3)
    with pytest.raises(ValueError, match="early_stopping"):
        generate(gpt2, ids, mask, max_new_tokens=2, num_beams=2, early_stopping="sometimes")
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(gpt2, ids, mask, max_new_tokens=0)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (dict(num_beams=2.0), "num_beams must be an integer"),
        (dict(num_beams=True), "num_beams must be an integer"),
        (dict(do_sample=True, num_return_sequences=2.0), "num_return_sequences must be an integer"),
        (dict(do_sample=True, top_k=2.5), "top_k must be an integer"),
        (dict(do_sample=True, seed=1.5), "seed must be an integer"),
        (dict(do_sample=True, seed=2**64), "seed must be an integer"),
        (dict(num_beams=2, length_penalty="1"), "length_penalty must be a finite number"),
        (dict(eos_token_id=(3, 3.7)), "eos_token_id must be a token id or a sequence of them"),
        (dict(eos_token_id=[True]), "eos_token_id must be a token id or a sequence of them"),
        (dict(pad_token_id=1.5), "pad_token_id must be a token id"),
    ],
)
def test_options_that_must_be_whole_or_real_numbers_are_refused_not_truncated(gpt2, options, named):
    ids, mask = left_padded([3])
    with pytest.raises(ValueError, match=named):
        generate(gpt2, ids, mask, max_new_tokens=2, **options)


def test_eos_ids_may_come_as_a_tensor():
    model = tiny_model("gpt2")
    ids, mask = left_padded([4])
    expected = generate(model, ids, mask, max_new_tokens=4, eos_token_id=[3, 5], pad_token_id=0)
    for eos in (torch.tensor([3, 5]), (3, 5)):
        assert torch.equal(generate(model, ids, mask, max_new_tokens=4, eos_token_id=eos, pad_token_id=0), expected)


def test_token_ids_outside_the_vocabulary_are_refused_before_anything_runs(gpt2):
    ids, mask = left_padded([3])
    vocab = gpt2.get_input_embeddings().num_embeddings
    for bad in (vocab, -1):
        with pytest.raises(ValueError, match=r"input_ids must lie in \[0, "):
            generate(gpt2, torch.full_like(ids, bad), mask, max_new_tokens=2, eos_token_id=[], pad_token_id=0)
    with pytest.raises(ValueError, match=f"eos_token_id {vocab} outside"):
        generate(gpt2, ids, mask, max_new_tokens=2, eos_token_id=[1, vocab], pad_token_id=0)
    with pytest.raises(ValueError, match="pad_token_id = -3 outside"):
        generate(gpt2, ids, mask, max_new_tokens=2, eos_token_id=[1], pad_token_id=-3)
    assert generate(gpt2, ids, mask, max_new_tokens=2, eos_token_id=[], pad_token_id=0).shape[1] == ids.shape[1] + 2


def test_unsupported_models_raise_or_fall_back_to_hf_on_request():
    import transformers

    model = transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=1, ffn_dim=64, num_attention_heads=2,
        word_embed_proj_dim=32, eos_token_id=3, pad_token_id=0)).eval()
    ids, mask = left_padded([4])
    with pytest.raises(UnsupportedModelError):
        generate(model, ids, mask, max_new_tokens=3)
    out = generate(model, ids, mask, max_new_tokens=3, eos_token_id=[], unsupported="hf")
    assert torch.equal(out, hf_generate(model, ids, mask, None, max_new_tokens=3))
    eos = int(out[0, ids.shape[1]])  # stops at the first new token when it is the eos
    stopped = generate(model, ids, mask, max_new_tokens=3, eos_token_id=eos, unsupported="hf")
    assert stopped.shape[1] == ids.shape[1] + 1
    assert model.generation_config.eos_token_id == 3  # the model's own config is left alone
    sampled = [generate(model, ids, mask, max_new_tokens=3, do_sample=True, seed=4, unsupported="hf") for _ in "ab"]
    assert torch.equal(sampled[0], sampled[1])


def test_inputs_on_another_device_than_the_model_are_refused():
    ids, _ = left_padded([3])
    with pytest.raises(ValueError, match="input_ids are on cpu but the model is on meta"):
        generate(tiny_model("gpt2").to("meta"), ids, max_new_tokens=2)


def test_per_model_state_dies_with_the_model():
    import gc
    import weakref

    from tendril.generation.api import release_graphs

    model = tiny_model("gpt2")
    ids, mask = left_padded([3])
    generate(model, ids, mask, max_new_tokens=2)
    assert "_tendril_generation" in model.__dict__
    release_graphs(model)
    assert "_tendril_generation" not in model.__dict__
    generate(model, ids, mask, max_new_tokens=2)
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("step", ["eager", "fused"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_decode_paths_are_built_again_after_the_weights_are_replaced_or_moved(family, step):
    from tendril.graphs.module_state import ModuleChangedWarning

    model, source = tiny_model(family), tiny_model(family, seed=1)
    ids, mask = left_padded([3])
    options = dict(max_new_tokens=6, step=step, eos_token_id=[], pad_token_id=0)
    generate(model, ids, mask, **options)
    model.load_state_dict(source.state_dict(), assign=True)
    with pytest.warns(ModuleChangedWarning, match="was replaced"):
        assert torch.equal(generate(model, ids, mask, **options), generate(source, ids, mask, **options))
    model.double()
    with pytest.warns(ModuleChangedWarning, match="moved"):
        generate(model, ids, mask, **options)
    model.float()  # float32 again, at new addresses
    with pytest.warns(ModuleChangedWarning, match="moved"):
        assert torch.equal(generate(model, ids, mask, **options), generate(source, ids, mask, **options))


def test_calls_on_one_model_take_turns(monkeypatch):
    from tendril.generation import api

    model, held = tiny_model("gpt2"), []
    loops = api._state(model).loops
    run = loops.run

    def spying_run(*inputs):
        held.append(api._state(model).turn.locked())
        return run(*inputs)

    monkeypatch.setattr(loops, "run", spying_run)
    ids, mask = left_padded([3])
    generate(model, ids, mask, max_new_tokens=2, eos_token_id=[], pad_token_id=0)
    assert held == [True] and not api._state(model).turn.locked()


@pytest.mark.parametrize("step", ["eager", "fused"])
def test_a_copied_or_saved_model_builds_its_own_decode_state(step):
    import copy
    import io

    model = tiny_model("gpt2")
    ids, mask = left_padded([3])
    options = dict(max_new_tokens=4, step=step, eos_token_id=[], pad_token_id=0)
    expected = generate(model, ids, mask, **options)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for twin in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        assert twin.__dict__["_tendril_generation"] is None
        assert torch.equal(generate(twin, ids, mask, **options), expected)
        assert twin.__dict__["_tendril_generation"].arch.model is twin


@pytest.mark.parametrize(
    "config",
    [dict(repetition_penalty=1.5), dict(num_beams=3, length_penalty=0.5), dict(num_beams=2, early_stopping=True)],
    ids=["repetition_penalty", "beams", "early_stopping"],
)
def test_the_models_generation_config_gives_the_defaults_as_in_hf(config):
    model = tiny_model("gpt2")
    for name, value in config.items():
        setattr(model.generation_config, name, value)
    ids, mask = left_padded([5, 3])
    _check(model, ids, mask, None)  # neither call passes the options: both take them from the config


def test_options_passed_override_the_models_generation_config():
    model = tiny_model("gpt2")
    model.generation_config.do_sample, model.generation_config.top_k = True, 5
    ids, mask = left_padded([4])
    options = dict(max_new_tokens=NEW, eos_token_id=[], pad_token_id=0)
    sampled = generate(model, ids, mask, seed=3, **options)
    assert torch.equal(sampled, generate(model, ids, mask, seed=3, do_sample=True, top_k=5, **options))
    greedy = generate(model, ids, mask, do_sample=False, **options)
    model.generation_config.do_sample = False
    assert torch.equal(greedy, generate(model, ids, mask, **options))
    assert not torch.equal(sampled, greedy)


def test_a_generation_config_setting_tendril_lacks_raises_or_runs_hf():
    model = tiny_model("gpt2")
    model.generation_config.no_repeat_ngram_size = 2
    ids, mask = left_padded([5])
    with pytest.raises(ValueError, match=r"no_repeat_ngram_size.*unsupported='hf'"):
        generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=[], pad_token_id=0)
    got = generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=[], pad_token_id=0, unsupported="hf")
    assert torch.equal(got, hf_generate(model, ids, mask, None, max_new_tokens=NEW))


def test_every_plans_loop_runs_through_one_graphed_function_keyed_by_plan_and_shape():
    """One graphed function per model (here on the null backend, which captures as CUDA would key): the plan is part of
    the key, so two plans of one shape are two graphs of one function, sharing its pool and graph budget, and each
    replays its own loop."""
    from tendril.generation import api
    from tendril.graphs.backend import NullBackend

    model = tiny_model("gpt2")
    state = api._state(model)
    state.loops = api.DecodeLoops(state.arch, graphs=True, backend=NullBackend())
    ids, mask = left_padded([4, 3])
    plans = [dict(), dict(num_beams=2), dict(repetition_penalty=1.3)]
    for _ in range(2):
        for options in plans:
            expected = hf_generate(model, ids, mask, None, max_new_tokens=4, **options)
            assert torch.equal(generate(model, ids, mask, max_new_tokens=4, eos_token_id=[], pad_token_id=0,
                                        **options), expected), options
    (runner,) = api.graphed_runners(model)
    assert len(state.loops.by_plan) == 3 and len(runner.stats.graphs) == 3 and runner.stats.eager_calls == 0
    assert {key.constants[0][2] for key in runner.stats.graphs} == set(state.loops.by_plan)  # keyed by the plan


def test_the_fused_step_refuses_dropout_in_training_mode_which_its_kernels_would_skip():
    """The fused kernels compute the eval-mode forward: with dropout layers in training mode they would decode other
    tokens than the model's own forward does, without a word."""
    model = tiny_model("gpt2")
    ids, mask = left_padded([4])
    options = dict(max_new_tokens=3, eos_token_id=[], pad_token_id=0, step="fused")
    model.transformer.h[1].attn.resid_dropout.train()
    with pytest.raises(ValueError, match=r"transformer\.h\.1\.attn\.resid_dropout is in training mode"):
        generate(model, ids, mask, **options)
    model.transformer.h[1].attn.resid_dropout.p = 0.0  # a dropout that drops nothing changes nothing
    assert torch.equal(generate(model, ids, mask, **options), hf_generate(model, ids, mask, None, max_new_tokens=3))
