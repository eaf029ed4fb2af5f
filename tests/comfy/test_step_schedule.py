"""A schedule over the steps at the block scope (``tome_harness/step_schedule.py``: measured by the quality bench,
offered by no node): each reduced block at the ratio of where the call's sigma lies in the run, some steps whole.
"""

import collections
import importlib

import pytest
import torch
from helpers import dit_sample, record_lengths

from tome_harness import dit_models, random_models
from tome_harness.step_schedule import PERCENTS, Schedule, percent_of, sigma_table, with_schedule

BLOCKS = dict(dit_scope="block", skip_first_blocks=0, skip_last_blocks=0)
STEPS = 4


def test_a_schedule_falls_linearly_leaves_every_nth_step_whole_and_names_a_bad_field():
    schedule = Schedule(0.7, 0.3, whole_every=5)
    assert [schedule.ratio_at(p) for p in (-1.0, 0.0, 0.5, 1.0, 2.0)] == pytest.approx([0.7, 0.7, 0.5, 0.3, 0.3])
    ratios = schedule.ratios(20)
    assert [i for i, r in enumerate(ratios) if r is None] == [4, 9, 14, 19]
    assert ratios[0] == pytest.approx(0.7) and ratios[18] == pytest.approx(0.7 - 0.4 * 18 / 20)
    for fields, name in (((1.0, 0.3), "first"), ((0.5, -0.1), "last"), ((0.5, 0.5, -1), "whole_every")):
        with pytest.raises(ValueError, match=f"Schedule.{name}"):
            Schedule(*fields)


@pytest.mark.parametrize("family", ["flux", "sd15"])
def test_a_sigma_lies_at_the_percent_the_model_sampling_gives_it(comfy_nodes, family):
    """Flow (Flux) and discrete (SD1.5) model samplings: the sigma at ``k / PERCENTS``, or just below it, lies at
    that percent; a sigma above the schedule at 0, the last at 1."""
    model = dit_models.build_dit_model(family) if family == "flux" else random_models.build_unet_model(family)
    sampling = model.get_model_object("model_sampling")
    table = sigma_table(sampling)
    for k in (1, 37, 100, 163, PERCENTS - 1):
        sigma = float(sampling.percent_to_sigma(k / PERCENTS))
        assert percent_of(sigma, table) == k / PERCENTS
        assert percent_of(sigma * 0.9999 + table[k + 1] * 0.0001, table) == k / PERCENTS  # just below it
    assert percent_of(table[1] * 2, table) == 0.0 and percent_of(0.0, table) == 1.0


def attention_lengths(comfy_nodes, model, steps):
    """The (query, key) lengths of every attention call of a ``steps``-step run of ``model``, counted."""
    calls = []
    patched = model.clone()
    patched.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = \
        record_lengths(calls)
    out = dit_sample(comfy_nodes, patched, "flux", steps=steps)
    return out, collections.Counter(calls)


@pytest.fixture(scope="module")
def flux(comfy_nodes):
    return dit_models.build_dit_model("flux")


@pytest.mark.parametrize("cache", [False, True])
def test_through_the_sampler_each_step_runs_at_its_ratio_and_a_whole_step_whole(comfy_nodes, pack, flux, cache):
    """Tiny random-weight Flux at the block scope on every block, 4 steps (30 image tokens): the attention calls of
    each step see the lengths ToMe (or its token cache) at that step's ratio gives, a whole step the model's; a
    schedule of one ratio samples as that ratio does, and one of every step whole as the model."""
    model_sampling = flux.get_model_object("model_sampling")
    sigmas = importlib.import_module("comfy.samplers").calculate_sigmas(model_sampling, "normal", STEPS)
    table = sigma_table(model_sampling)
    schedule = Schedule(0.7, 0.1, whole_every=3)
    caching = pack.dit.TokenCaching(full_steps=1) if cache else None

    def patched(ratio, schedule=None, caching=caching):
        model = pack.dit.apply_tome_dit(flux, ratio=ratio, token_cache=caching, **BLOCKS)
        return model if schedule is None else with_schedule(model, schedule)

    # A token cache computes as many image tokens as ToMe at its ratio keeps, and every one at its first step,
    # which has nothing cached.
    expected = collections.Counter()
    for step in range(STEPS):
        ratio = None if schedule.whole_at(step) or (cache and step == 0) else \
            schedule.ratio_at(percent_of(float(sigmas[step]), table))
        expected += attention_lengths(comfy_nodes, flux if ratio is None else patched(ratio, caching=None), 1)[1]
    out, lengths = attention_lengths(comfy_nodes, patched(0.5, schedule), STEPS)
    assert lengths == expected and len(set(lengths)) > 3 and torch.isfinite(out).all()

    torch.testing.assert_close(dit_sample(comfy_nodes, patched(0.5, Schedule(0.5, 0.5)), "flux", steps=STEPS),
                               dit_sample(comfy_nodes, patched(0.5), "flux", steps=STEPS), rtol=0, atol=0)
    torch.testing.assert_close(dit_sample(comfy_nodes, patched(0.5, Schedule(0.5, 0.5, 1)), "flux", steps=STEPS),
                               dit_sample(comfy_nodes, flux, "flux", steps=STEPS), rtol=1e-5, atol=1e-5)


def test_a_model_the_block_scope_does_not_reduce_is_returned_as_it_is(pack, flux):
    attention_scope = pack.dit.apply_tome_dit(flux, ratio=0.5)
    assert with_schedule(attention_scope, Schedule(0.7, 0.3)) is attention_scope
