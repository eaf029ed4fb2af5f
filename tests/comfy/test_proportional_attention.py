"""ToMe's proportional attention at the block scope (``tome_harness/proportional_attention.py``: measured by the
quality bench, offered by no node): each merged image key weighed by the image tokens it stands for.
"""

import pytest
import torch

from tome_harness import dit_models
from tome_harness.proportional_attention import (
    SIZES_KEY,
    MergedSizes,
    ProportionalAttention,
    with_proportional_attention,
)

TEXT = 7


def attention(q, k, v, heads, mask=None, **kwargs):
    """One head's attention, token-major ``[B, L, C]``, as ComfyUI's backends take it."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, 0])


def test_a_merged_key_of_s_identical_tokens_draws_what_the_s_tokens_would_together(pack):
    """Text then 4 merged image keys standing for 1, 3, 2 and 2 tokens: the weighed attention over them is the
    plain attention over the 8 tokens they stand for (each repeated), with ``heads`` by position or keyword; a
    sequence of another length, or with a mask of its own, is left as it is."""
    generator = torch.Generator().manual_seed(0)
    sizes = torch.tensor([[1, 3, 2, 2]])
    text, image, v_text, v_image = (torch.randn(1, n, 8, generator=generator) for n in (2, 4, 2, 4))
    q = torch.randn(1, 6, 8, generator=generator)
    options = {pack.dit.LAYOUT_KEY: None, SIZES_KEY: MergedSizes(sizes.float().log(), {6: 2})}
    k, v = torch.cat([text, image], 1), torch.cat([v_text, v_image], 1)
    repeated = [torch.cat([t, i.repeat_interleave(sizes[0], dim=1)], 1) for t, i in ((text, image), (v_text, v_image))]
    override = ProportionalAttention(pack.dit.LAYOUT_KEY)
    for heads in ((1,), ()):  # Flux hands heads by position, SD3 and Wan by keyword
        weighed = override(attention, q, k, v, *heads, transformer_options=options, **({} if heads else {"heads": 1}))
        torch.testing.assert_close(weighed, attention(q, *repeated, 1))

    for q_other, kwargs in ((q[:, :5], {}), (q, {"mask": torch.zeros(1, 1, 1, 6)})):
        n = q_other.shape[1]
        plain = attention(q_other, k[:, :n], v[:, :n], 1, **kwargs)
        torch.testing.assert_close(override(attention, q_other, k[:, :n], v[:, :n], 1, transformer_options=options,
                                            **kwargs), plain)


@pytest.mark.parametrize("family, latent", [("flux", (1, 16, 10, 12)), ("sd3", (1, 16, 10, 12)),
                                            ("wan21", (1, 16, 3, 10, 12))])
def test_through_the_sampler_every_merged_self_attention_weighs_its_image_keys_alone(comfy_nodes, pack, family,
                                                                                    latent):
    """Tiny random-weight models at the block scope on every block (3 steps, 2 conds; 30 image tokens a frame,
    15 left): every self-attention of a merged block (Flux's and SD3's joint ones, SD3.5's image-only one,
    Wan's) gets a bias, 0 on the text keys and on the merged image keys the log of the tokens each stands for,
    which add up to the image's; Wan's cross-attention gets none. The samples differ from plain ToMe's. A model
    the block scope does not reduce is returned as it is."""
    model = dit_models.build_dit_model(family)
    frames = latent[2] if len(latent) == 5 else 1
    seen = []

    def spy(func, *args, **kwargs):
        q, k = (t.shape[2] if kwargs.get("skip_reshape") else t.shape[1] for t in args[:2])
        seen.append((q, k, kwargs.get("mask")))
        return func(*args, **kwargs)

    spied = model.clone()
    spied.model_options.setdefault("transformer_options", {})[pack.dit.OVERRIDE_KEY] = spy

    def sample(patched):
        positive = [[torch.randn(1, TEXT, dit_models.CONTEXT_DIM, generator=torch.Generator().manual_seed(5)),
                     {"pooled_output": torch.zeros(1, dit_models.CONTEXT_DIM)}]]
        (out,) = comfy_nodes.KSampler().sample(patched, 3, 3, 2.0, "euler", "normal", positive, positive,
                                               {"samples": torch.zeros(latent)})
        return out["samples"]

    tome = pack.dit.apply_tome_dit(spied, ratio=0.5, dit_scope="block", skip_first_blocks=0, skip_last_blocks=0)
    plain = sample(tome)
    calls = len(seen)
    seen.clear()
    weighed = sample(with_proportional_attention(tome))
    assert len(seen) == calls and any(mask is not None for _, _, mask in seen)
    for q, k, mask in seen:
        assert (mask is not None) == (q == k)
        if mask is not None:
            assert (mask[..., :-15 * frames] == 0).all()
            torch.testing.assert_close(mask[..., -15 * frames:].exp().sum(-1),
                                       torch.full(mask.shape[:-1], 30.0 * frames))
    assert torch.isfinite(weighed).all() and (weighed - plain).abs().max() > 1e-4
    assert with_proportional_attention(model) is model
