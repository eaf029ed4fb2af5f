"""One ToMe matching for several blocks of a model call (``reuse_blocks``), measured by the benches (docs/DITS.md "A
matching reused" says what it saves and costs, and why no row recommends it). One matching for every block
(``EVERY_BLOCK``) is what Apply ToMe (Advanced)'s ``share_matching`` does, bit for bit on a model of one token grid
(``tests/comfy/test_share_matching.py``); a matching for a few blocks at a time no node offers.

The block scope (``tome.hosts.comfyui_dit_block``) matches ToMe's plan at every block call. ``with_reuse_blocks``
gives a model patched at the block scope a scope whose plan, matched at one block, serves the next
``reuse_blocks - 1`` blocks of the same model call where their tokens have the same shape and grid. Seeds count
every block call, reused or not, so a reused plan moves no later block's seed.
"""

from __future__ import annotations

import dataclasses
import functools
import sys

from tome_harness.comfyui import pack_module

PLAN_KEY = "tome_harness_block_plan"  # in a model call's options: (the block it was matched at, its tokens, plan)
EVERY_BLOCK = 100  # reuse_blocks for one matching a model call: more than the largest model's blocks


@functools.cache
def reusing_scope_class(base: type) -> type:
    """``base`` (the pack's ``BlockScope``, as ComfyUI loaded it) with ``reuse_blocks``."""
    model_call = sys.modules[base.__module__].model_call

    @dataclasses.dataclass(frozen=True)
    class ReusingBlockScope(base):
        reuse_blocks: int = 1

        def tome_plan(self, tome, tokens, grid, key, options):
            position, seen = self.keys.index(key), (tuple(tokens.shape), grid)
            kept = options.get(PLAN_KEY)
            if kept is not None and kept[1] == seen and 0 <= position - kept[0] < self.reuse_blocks:
                model_call(options).next_attention()  # the seed count, as a fresh matching would move it
                return kept[2]
            plan = super().tome_plan(tome, tokens, grid, key, options)
            options[PLAN_KEY] = (position, seen, plan)
            return plan

    return ReusingBlockScope


def with_reuse_blocks(model, reuse_blocks: int):
    """A clone of ``model`` (Apply ToMe at the block scope) whose matchings each serve ``reuse_blocks`` consecutive
    blocks of a model call. A model whose Apply ToMe reduces no block (skips that leave none: the node then puts
    nothing on it) is returned as it is."""
    if reuse_blocks < 1:
        raise ValueError(f"reuse_blocks must be 1 or more, not {reuse_blocks}")
    return with_scope_subclass(model, reusing_scope_class, reuse_blocks=reuse_blocks)


def with_scope_subclass(model, subclass, **added):
    """A clone of ``model`` (Apply ToMe at the block scope) whose block scope is ``subclass(type(scope))`` (a
    harness's subclass of the pack's ``BlockScope``), made from the scope's own fields and ``added``. A model
    whose Apply ToMe reduces no block is returned as it is."""
    host = pack_module("tome.hosts.comfyui")
    wrappers = model.get_wrappers(host.APPLY_MODEL, host.WRAPPER_KEY)
    scope = wrappers[0].blocks if wrappers else None
    if scope is None or scope.tome is None:
        return model
    fields = {field.name: getattr(scope, field.name) for field in dataclasses.fields(scope)}
    patched = model.clone()
    patched.remove_wrappers_with_key(host.APPLY_MODEL, host.WRAPPER_KEY)
    patched.add_wrapper_with_key(host.APPLY_MODEL, host.WRAPPER_KEY,
                                 dataclasses.replace(wrappers[0], blocks=subclass(type(scope))(**fields | added)))
    return patched
