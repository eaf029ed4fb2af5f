"""The block scope's hook on DiTs whose blocks ComfyUI calls without a ``dit`` block replacement (Lumina 2 /
Z-Image, HiDream in ComfyUI 0.3.75).

ComfyUI's ``dit`` replacement (``patches_replace["dit"][key](args, {"original_block": ...})``) is how the block
scope reaches a block (``comfyui_dit_block``). Lumina 2's and HiDream's forwards call their blocks directly.
For them each block's class is swapped, on the patched clone only, for a subclass that offers the same
protocol: an object patch of the module's ``__class__`` (as the U-Net adapter swaps a feed-forward's class),
so the module, its weights and its LoRA keys stay what they are, a MultiGPU copy swaps its own modules' classes,
and ComfyUI puts the class back when the clone is unloaded. The subclass knows its block's key; at every call it
looks in its ``transformer_options`` for this model call's replacement of that key (``SWAPPED_KEY``, put there
by the layout wrapper for each call, as the other families' go into ``patches_replace``) and, with none, runs
as the block. The replacement gets the block's arguments as ``dit`` replacement ``args`` (``img``, ``txt``,
``vec``, ``pe``, ``attn_mask``, ``transformer_options``) and the block as ``original_block``; what it returns
goes back as the block's own output. Under ``torch.compile`` only the lookup of the replacement runs outside the
graph (``eager``): a block with none, or the block a replacement runs, is traced as the unswapped class would be.

Cosmos (1 and Predict2) is not reached this way: its blocks take the video as a grid ``[B, T, H, W, D]``
(Predict2) or ``[T, H, W, B, D]`` (1), which merged tokens are not.

No ComfyUI import; the swapped classes hold only the key of their block.
"""

from __future__ import annotations

from collections.abc import Callable

from .comfyui import eager, mixed_class, options_of_call, without_swapped_classes

SWAPPED_KEY = "tome_blocks"  # in a model call's transformer_options: the replacements of swapped blocks, by key


class SwappedBlock:
    """The mixin of a swapped block class: its block's key (``tome_block_key``) and the class it swaps
    (``tome_base``)."""

    tome_block_key: tuple[str, int]
    tome_base: type

    @eager  # outside compiled graphs: made for each model call, so read afresh at every call
    def tome_replacement(self, options) -> Callable | None:
        """This model call's replacement of this block, if the call has one: from the block's own
        ``transformer_options``, or the running call's where a step cache's forward calls the block without them
        (TeaCache's Lumina 2 and HiDream forwards)."""
        return (options_of_call({"transformer_options": options}).get(SWAPPED_KEY) or {}).get(self.tome_block_key)


class LuminaBlock(SwappedBlock):
    """Lumina 2's and Z-Image's ``JointTransformerBlock``: ``x [B, text + image (+ padding), C]``, its rotary
    table ``freqs_cis [B, L, 1, D/2, 2, 2]`` and the time modulation ``adaln_input [B, C]``; returns ``x``."""

    def forward(self, x, x_mask, freqs_cis, adaln_input=None, transformer_options={}):  # noqa: B006 (ComfyUI's)
        block = super().forward
        replacement = self.tome_replacement(transformer_options)
        if replacement is None:
            return block(x, x_mask, freqs_cis, adaln_input, transformer_options=transformer_options)

        def original(args):
            return {"img": block(args["img"], args["attn_mask"], args["pe"], args["vec"],
                                 transformer_options=args["transformer_options"])}

        args = {"img": x, "attn_mask": x_mask, "pe": freqs_cis, "vec": adaln_input,
                "transformer_options": transformer_options}
        return replacement(args, {"original_block": original})["img"]


class HiDreamBlock(SwappedBlock):
    """HiDream's ``HiDreamImageBlock``: a double-stream block takes ``image_tokens`` and ``text_tokens`` apart and
    returns both, a single-stream block ``[image | text]`` joined (``text_tokens`` ``None``) and returns it; the
    rotary table ``rope [B, L, 1, D/2, 2, 2]`` covers ``[image | text]``."""

    def forward(self, image_tokens, image_tokens_masks=None, text_tokens=None, adaln_input=None, rope=None,
                transformer_options={}):  # noqa: B006 (ComfyUI's)
        block = super().forward
        replacement = self.tome_replacement(transformer_options)
        if replacement is None:
            return block(image_tokens, image_tokens_masks, text_tokens, adaln_input, rope,
                         transformer_options=transformer_options)

        def original(args):
            out = block(args["img"], args["attn_mask"], args["txt"], args["vec"], args["pe"],
                        transformer_options=args["transformer_options"])
            return {"img": out[0], "txt": out[1]} if isinstance(out, tuple) else {"img": out}

        args = {"img": image_tokens, "attn_mask": image_tokens_masks, "txt": text_tokens, "vec": adaln_input,
                "pe": rope, "transformer_options": transformer_options}
        out = replacement(args, {"original_block": original})
        return out["img"] if text_tokens is None else (out["img"], out["txt"])


def swapped_class(base: type, mixin: type, key: tuple[str, int]) -> type:
    """``base`` with ``mixin`` in front, for block ``key`` (``comfyui.mixed_class``): one class per block class
    and key, so every clone swapping a block gets the same class."""
    return mixed_class(base, mixin, tome_block_key=key)


def swap_blocks(model, paths: dict[tuple[str, int], str], mixin: type) -> None:
    """Object patches on ``model`` (a clone) swapping the class of each block at ``paths`` (key -> its path under
    the diffusion model) for ``mixin``'s subclass."""
    for key, path in paths.items():
        name = f"diffusion_model.{path}.__class__"
        model.add_object_patch(name, swapped_class(model.get_model_object(name), mixin, key))


def without_swapped_blocks(model) -> None:
    """Drop an earlier node's block class swaps from ``model``'s object patches."""
    without_swapped_classes(model, SwappedBlock)
