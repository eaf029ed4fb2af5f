"""ToMe and ToDo in ComfyUI's DiTs (SD3.5, Flux / Flux 2 / Chroma, Wan 2.x, Qwen-Image, Lumina 2 / Z-Image,
HunyuanVideo, LTX-Video, HiDream, Cosmos Predict2): registration on a clone, and the model call's machinery.

What the nodes call: ``apply_todo_dit`` and ``apply_tome_dit`` check their
inputs, choose the scope and the blocks (``scope_and_blocks``) and register,
on a clone, the attention override (``comfyui_dit_attention.DiTReduction``)
and two keyed wrappers. The ``apply_model`` wrapper (``LayoutWrapper``) sees
the latent and the conds of every model call: it writes the call's
``ImageLayout`` (``dit_families``: the grid in patches, and where the image
starts in each sequence that holds it) into a copy of that call's
``transformer_options``, where the override and the block replacements read
it; at the block scope (``comfyui_dit_block``) it puts the block replacements
on the call; on Wan VACE it marks the main blocks while they run
(``MainBlockMark``), on Wan 2.2 S2V it hands the blocks their options
(``OptionsHanded``). The ``outer_sample`` wrapper (``DiTRunStart``) gives each
sampling run its own state, warns at its start where the settings were measured
slower on a GPU at its size (``gpu_rule``) and, when the run ends, warns where
no model call reached a scope's hooks (a step cache's forward that calls the
blocks without them).

The modules of the DiT host, each importing only those before it: ``comfyui``
(ComfyUI's conventions, shared with the U-Net), ``dit_settings`` (the
settings and option keys), ``comfyui_dit_swap`` (the swapped block classes),
``dit_families`` (each family: recognised, laid out, its block arguments),
``gpu_rule`` (the settings measured slower on a GPU, shared with the U-Net),
``dit_tokens`` (the token operations both scopes share),
``comfyui_dit_attention`` (the attention scope), ``dit_token_cache`` (what a
block computes instead of merging under ``token_cache``), ``comfyui_dit_block``
(the block scope), this one. No ComfyUI import; patch objects hold only frozen
settings (see ``comfyui``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..downsample import METHODS, NEAREST
from ..merge import MEAN, REDUCTIONS
from .comfyui import (
    APPLY_MODEL,
    MAX_FACTOR,
    MAX_REUSE_STEPS,
    MERGE_QKV,
    OUTER_SAMPLE,
    RUN_KEY,
    WRAPPER_KEY,
    SamplingRun,
    StartRun,
    call_options,
    capped_ratio,
    check_choice,
    check_range,
    check_tome_inputs,
    model_call,
    options_of_call,
    running_call,
    sampling_window,
    with_dit_replacements,
)
from .comfyui_dit_attention import DiTReduction, OverrideWatch, warn_dropped
from .comfyui_dit_block import BlockScope, block_keys, block_scope, chosen_blocks, swap_family_blocks
from .comfyui_dit_swap import without_swapped_blocks
from .dit_families import BLOCK_FAMILIES, FAMILIES, DiTSpec, dit_family, dit_spec
from .dit_settings import (
    DIT_SCOPES,
    LAYOUT_KEY,
    MAIN_BLOCK_KEY,
    MAX_SKIP_BLOCKS,
    OVERRIDE_KEY,
    SCOPE_ATTENTION,
    SCOPE_BLOCK,
    SKIP_FIRST_BLOCKS,
    SKIP_LAST_BLOCKS,
    DiTToDo,
    DiTToMe,
    TokenCaching,
)
from .gpu_rule import TODO, TOME, Setting, gpu_use

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayoutWrapper:
    """A keyed ``apply_model`` wrapper: hands the model call a copy of its ``transformer_options`` holding the
    call's ``ImageLayout`` and its ``ModelCall`` (``comfyui.call_options``); with ``blocks`` (a
    ``comfyui_dit_block.BlockScope``), a copy of its block replacements reducing the blocks, made for the call
    around whatever replacements the call has (another node's, put there before or after ours). ``attention``:
    whether our override reduces anything inside attention calls (settings at the attention scope), which
    another override put over ours at run time would lose if it does not call ours."""

    spec: DiTSpec
    blocks: BlockScope | None = None
    attention: bool = True

    def __call__(self, executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None,
                 **conds):
        text = 0 if c_crossattn is None else c_crossattn.shape[1]
        options = call_options(transformer_options)
        options[LAYOUT_KEY] = self.spec.layout(x.shape, text, conds, model_call(options).read)
        alone = RUN_KEY not in options  # a model call outside a sampling run is a run of its own
        run = options.setdefault(RUN_KEY, SamplingRun())
        if self.blocks is not None:  # first, so that VACE's marks and S2V's options go around it
            if self.blocks.reaches(executor.class_obj.diffusion_model):
                self.blocks.install(options, executor.class_obj.diffusion_model)
            elif run.first_warning(unreached_key(SCOPE_BLOCK)):
                warn_blocks_replaced(self.attention)
        if self.spec.vace_main_blocks:
            options[MAIN_BLOCK_KEY] = False
            options["patches_replace"] = with_main_blocks_marked(options.get("patches_replace") or {},
                                                                 self.spec.vace_main_blocks)
        if self.spec.blocks_without_options:
            options["patches_replace"] = with_options_handed(options.get("patches_replace") or {},
                                                             executor.class_obj.diffusion_model.blocks, options)
        with running_call(options):
            out = self.run(executor, options, x, t, c_concat, c_crossattn, control, **conds)
        run.note_call(model_call(options).reached)
        if alone:
            warn_unreached(run, self.scopes)
        return out

    @property
    def scopes(self) -> tuple[str, ...]:
        """The scopes this model's settings reduce at."""
        return scopes_of(self.attention, self.blocks is not None)

    def run(self, executor, options, x, t, c_concat, c_crossattn, control, **conds):
        """The model call with ``options``, watching whether another override put over ours still calls ours."""
        on_top = options.get(OVERRIDE_KEY)
        if on_top is None or isinstance(on_top, DiTReduction) or not self.attention:
            # not self.attention: the block scope alone, whose replacements do not go through the override
            return executor(x, t, c_concat, c_crossattn, control, options, **conds)
        # Another node put its override over ours after our node ran (an attention backend reinstalling itself
        # at every step): watch, for this call, whether it still calls ours.
        watch = options[OVERRIDE_KEY] = OverrideWatch(on_top)
        out = executor(x, t, c_concat, c_crossattn, control, options, **conds)
        if watch.calls and not watch.reached and options[RUN_KEY].first_warning(unreached_key(SCOPE_ATTENTION)):
            warn_dropped(on_top, self.blocks is not None)
        return out


def scopes_of(attention: bool, blocks: bool) -> tuple[str, ...]:
    """The scopes of a model's settings: ``attention`` whether any reduces inside attention calls, ``blocks``
    whether any reduces whole blocks."""
    return (SCOPE_ATTENTION,) * attention + (SCOPE_BLOCK,) * blocks


@dataclass(frozen=True)
class DiTRunStart(StartRun):
    """``StartRun`` for a DiT whose settings reduce at ``scopes``: when the run ends, one warning for each scope
    whose hooks no model call of the run reached."""

    scopes: tuple[str, ...] = ()

    def ended(self, run: SamplingRun) -> None:
        warn_unreached(run, self.scopes)


def unreached_key(scope: str) -> str:
    """The run's warning key for ``scope`` not acting: given once per run, whatever the cause."""
    return f"unreached {scope}"


# The replaced forwards of the step caches people install (TeaCache's, MagCache's, First Block Cache's on Flux) call
# the blocks without transformer_options, so the attention override is out of reach; they still call the dit block
# replacements (and the swapped blocks), which find the model call's options another way (options_of_call).
STEP_CACHES_DOC = "docs/SPEED_STACK.md, 'Third-party step caches'"
UNREACHED_CAUSE = {
    SCOPE_ATTENTION: ("its attention override", "a node or pack replaced the model's forward and calls the blocks "
                      "without ComfyUI's transformer_options (TeaCache, MagCache, and First Block Cache on Flux do), "
                      "so the override cannot reach the attention calls; dit_scope 'block' acts under them"),
    SCOPE_BLOCK: ("its block replacements", "a node or pack replaced the model's forward and runs the blocks "
                  "without ComfyUI's dit block replacements; dit_scope 'attention' may still act"),
}


def warn_unreached(run: SamplingRun, scopes) -> None:
    """One warning per run for each of ``scopes`` whose hooks no model call of ``run`` reached."""
    for scope in run.unreached(scopes):
        if run.first_warning(unreached_key(scope)):
            hook, cause = UNREACHED_CAUSE[scope]
            log.warning("Apply ToDo / Apply ToMe: no model call of this sampling run reached %s, so nothing was "
                        "reduced at dit_scope '%s': %s (%s)", hook, scope, cause, STEP_CACHES_DOC)


def warn_blocks_replaced(attention: bool) -> None:
    """The model's block lists are not those the node saw (First Block Cache swaps them for one cached block):
    the block scope leaves this run whole."""
    log.warning("Apply ToDo / Apply ToMe: the model's blocks were replaced after this node ran (First Block Cache "
                "swaps them for one cached block), so dit_scope 'block' reduces nothing in this run%s",
                "; what dit_scope 'attention' reduces still is" if attention else
                f"; dit_scope 'attention' acts under First Block Cache ({STEP_CACHES_DOC})")


@dataclass(frozen=True)
class MainBlockMark:
    """A ``dit`` block replacement for main block ``("double_block", i)`` of a Wan VACE model: marks the call's
    ``transformer_options`` while the block runs. VACE's control blocks attend over the control video, a
    sequence of exactly the video's length and grid, and run between the main blocks: the mark is the only
    thing that tells the override which of the two it is in. ``inner``: the replacement another node put on
    that block (skip-layer guidance, say), called in the block's place."""

    inner: Callable | None = None

    def __call__(self, args, extra):
        options = options_of_call(args, extra)
        options[MAIN_BLOCK_KEY] = True
        try:
            return self.inner(args, extra) if self.inner is not None else extra["original_block"](args)
        finally:
            options[MAIN_BLOCK_KEY] = False


def with_main_blocks_marked(replaces: Mapping, blocks: int) -> dict:
    """A copy of ``patches_replace`` (the model's, shared with its clones: never written) whose ``dit`` entries
    mark each of ``blocks`` main blocks, over whatever replacement was there."""
    return with_dit_replacements(replaces, [("double_block", i) for i in range(blocks)],
                                 lambda key, inner: MainBlockMark(inner))


@dataclass(frozen=True)
class OptionsHanded:
    """A ``dit`` block replacement for block ``("double_block", i)`` of a model that calls its blocks without
    ``transformer_options`` (Wan 2.2 S2V in ComfyUI 0.3.75), so that no attention override would reach them:
    runs ``block`` with the model call's ``options``. Made for one model call (it holds that call's options).
    ``inner``: the replacement another node put on that block, called in the block's place, with an
    ``original_block`` that hands the options over."""

    block: torch.nn.Module
    options: dict
    inner: Callable | None = None

    def __call__(self, args, extra):
        if self.inner is None:
            return self.original(args)
        return self.inner(args, dict(extra, original_block=self.original))

    def original(self, args) -> dict:
        """The block as the model would run it (``WanModel_S2V.forward_orig``'s ``block_wrap``), with the options."""
        return {"img": self.block(args["img"], context=args["txt"], e=args["vec"], freqs=args["pe"],
                                  transformer_options=self.options)}


def with_options_handed(replaces: Mapping, blocks: Sequence[torch.nn.Module], options: dict) -> dict:
    """A copy of ``patches_replace`` whose ``dit`` entries run each of ``blocks`` with ``options``, over whatever
    replacement was there."""
    return with_dit_replacements(replaces, [("double_block", i) for i in range(len(blocks))],
                                 lambda key, inner: OptionsHanded(blocks[key[1]], options, inner))


# Registration: what the nodes call. Each clones the model; the input model is never touched.

def current_reduction(model) -> DiTReduction | None:
    """Our override on ``model``, if an earlier node put one there."""
    override = model.model_options.get("transformer_options", {}).get(OVERRIDE_KEY)
    return override if isinstance(override, DiTReduction) else None


def known_family(model, node: str) -> str | None:
    """``dit_family(model)``, with a warning naming the model's class where it is not a known DiT."""
    family = dit_family(model)
    if family is None:
        log.warning("%s: %s is not a DiT this node knows (%s); the model passes through unchanged",
                    node, type(model.model).__name__, ", ".join(FAMILIES))
    return family


def with_reduction(model, family: str, reduction: DiTReduction):
    """A clone of ``model`` with ``reduction`` in the override slot and the layout wrapper registered; where
    ``reduction`` does nothing, both are removed and the override that was there before is put back."""
    patched = model.clone()
    options = patched.model_options.setdefault("transformer_options", {})
    patched.remove_wrappers_with_key(APPLY_MODEL, WRAPPER_KEY)
    patched.remove_wrappers_with_key(OUTER_SAMPLE, WRAPPER_KEY)
    without_swapped_blocks(patched)
    if reduction.todo is None and reduction.tome is None:
        if reduction.inner is None:
            options.pop(OVERRIDE_KEY, None)
        else:
            options[OVERRIDE_KEY] = reduction.inner
        return patched
    options[OVERRIDE_KEY] = reduction
    blocks = block_scope(reduction.todo, reduction.tome, block_keys(patched, family), family)
    if blocks is not None:
        swap_family_blocks(patched, blocks)
    attention = any(s is not None and s.scope == SCOPE_ATTENTION for s in (reduction.todo, reduction.tome))
    spec = dit_spec(patched, family)
    patched.add_wrapper_with_key(APPLY_MODEL, WRAPPER_KEY, LayoutWrapper(spec, blocks, attention))
    # A run that keeps plans or token caches across steps reads its schedule with its first sigma.
    keeps_plans = blocks is not None and blocks.tome is not None and \
        (blocks.tome.reuse_steps > 1 or blocks.tome.token_cache is not None)
    patched.add_wrapper_with_key(OUTER_SAMPLE, WRAPPER_KEY,
                                 DiTRunStart(keeps_plans, gpu_use(family, gpu_settings(reduction), spec.patch),
                                             scopes=scopes_of(attention, blocks is not None)))
    return patched


def gpu_settings(reduction: DiTReduction) -> list[Setting]:
    """``reduction``'s settings as the GPU rule reads them (``gpu_rule``): each at its scope, but ToMe's token
    cache, which no GPU measured."""
    settings = [Setting(TODO, reduction.todo.scope)] if reduction.todo is not None else []
    if reduction.tome is not None and reduction.tome.token_cache is None:
        settings.append(Setting(TOME, reduction.tome.scope))
    return settings


def base_reduction(model) -> DiTReduction:
    """Our override on ``model``, or an empty one keeping the override another node put there."""
    current = current_reduction(model)
    if current is not None:
        return current
    return DiTReduction(inner=model.model_options.get("transformer_options", {}).get(OVERRIDE_KEY))


def scope_and_blocks(model, family: str, node: str, dit_scope: str, skip_first_blocks: int,
                     skip_last_blocks: int) -> tuple[str, frozenset]:
    """The scope a node's settings get on ``model`` and, at the block scope, the keys of the blocks they reduce.
    A family the block scope does not cover gets the attention scope, with a warning."""
    check_choice("dit_scope", dit_scope, DIT_SCOPES)
    check_range("skip_first_blocks", skip_first_blocks, 0, MAX_SKIP_BLOCKS)
    check_range("skip_last_blocks", skip_last_blocks, 0, MAX_SKIP_BLOCKS)
    if dit_scope == SCOPE_ATTENTION:
        return SCOPE_ATTENTION, frozenset()
    keys = block_keys(model, family)
    if keys is None:
        log.warning("%s: dit_scope 'block' does not reach %s's blocks yet (the block scope covers %s); reducing "
                    "inside its attention calls instead (dit_scope 'attention')", node, type(model.model).__name__,
                    ", ".join(BLOCK_FAMILIES))
        return SCOPE_ATTENTION, frozenset()
    blocks = chosen_blocks(keys, skip_first_blocks, skip_last_blocks)
    if not blocks:
        log.warning("%s: skip_first_blocks %d and skip_last_blocks %d leave none of this model's %d blocks to "
                    "reduce at the block scope: nothing is reduced, and nothing is put on the model", node,
                    skip_first_blocks, skip_last_blocks, len(keys))
    return SCOPE_BLOCK, blocks


def reduces(scope: str, blocks: frozenset) -> bool:
    """Whether settings of ``scope`` on ``blocks`` (``scope_and_blocks``) reduce anything: at the block scope, only
    with a block left to reduce (an empty selection is no setting at all: nothing to install, even on a compiled
    model)."""
    return scope != SCOPE_BLOCK or bool(blocks)


def apply_todo_dit(model, *, downsample_factor: int, method: str = NEAREST, time_factor: int = 1,
                   start_percent: float = 0.0, end_percent: float = 1.0, keep_norms: bool = True,
                   dit_scope: str = SCOPE_ATTENTION, skip_first_blocks: int = SKIP_FIRST_BLOCKS,
                   skip_last_blocks: int = SKIP_LAST_BLOCKS):
    """Clone ``model`` (a DiT) with ToDo's key/value pooling in its image self-attention.

    ``downsample_factor`` pools ``factor x factor`` cells of the image grid,
    ``time_factor`` (video) that many frames too; both 1 removes an earlier
    ToDo. A second call replaces the first. ``keep_norms`` (no node offers
    it) False pools keys by their plain mean with ``average``, shorter than
    they are (``tome.norms``; the quality bench measures what that costs).
    ``dit_scope`` ``block``: the image tokens are pooled at the entry of each
    block but the first ``skip_first_blocks`` and last ``skip_last_blocks``,
    the whole block runs on them, and each token gets its cell's change
    (``comfyui_dit_block``).
    """
    family = known_family(model, "Apply ToDo")
    if family is None:
        return model
    check_range("downsample_factor", downsample_factor, 1, MAX_FACTOR)
    check_range("time_factor", time_factor, 1, MAX_FACTOR)
    check_choice("method", method, METHODS)
    scope, blocks = scope_and_blocks(model, family, "Apply ToDo", dit_scope, skip_first_blocks, skip_last_blocks)
    current = base_reduction(model)
    todo = None
    if (downsample_factor > 1 or time_factor > 1) and reduces(scope, blocks):
        todo = DiTToDo(downsample_factor, time_factor, method, sampling_window(model, start_percent, end_percent),
                       keep_norms=keep_norms, scope=scope, blocks=blocks)
    if todo is None and current.todo is None:
        return model
    return with_reduction(model, family, dataclasses.replace(current, todo=todo))


def checked_token_cache(token_cache: TokenCaching | None, scope: str, ratio: float,
                        reuse_steps: int) -> TokenCaching | None:
    """``token_cache`` where it acts (at the block scope), its settings checked; ``None`` elsewhere, with a
    warning at the attention scope, and a warning where ``reuse_steps`` (no matching to reuse) is given beside
    it."""
    if token_cache is None or ratio <= 0.0:
        return None
    check_range("token_cache full_steps", token_cache.full_steps, 1, MAX_REUSE_STEPS)
    check_range("token_cache refresh_every", token_cache.refresh_every, 0, MAX_REUSE_STEPS)
    check_range("token_cache max_age", token_cache.max_age, 1, MAX_REUSE_STEPS)
    if scope == SCOPE_ATTENTION:
        log.warning("Apply ToMe: token_cache has no meaning at dit_scope 'attention' (it reuses whole blocks' "
                    "changes) and is ignored; set dit_scope to 'block'")
        return None
    if reuse_steps > 1:
        log.warning("Apply ToMe: reuse_steps=%d has no meaning with token_cache (nothing is matched) and is "
                    "ignored", reuse_steps)
    return token_cache


def apply_tome_dit(model, *, ratio: float, stride_x: int = 2, stride_y: int = 2, seed: int = 0,
                   use_rand: bool = True, merge: str = MERGE_QKV, start_percent: float = 0.0,
                   end_percent: float = 1.0, reduce: str = MEAN, keep_norms: bool = True,
                   dit_scope: str = SCOPE_ATTENTION, skip_first_blocks: int = SKIP_FIRST_BLOCKS,
                   skip_last_blocks: int = SKIP_LAST_BLOCKS, reuse_steps: int = 1,
                   token_cache: TokenCaching | None = None, share_matching: bool = False):
    """Clone ``model`` (a DiT) with ToMe in its image self-attention: the image tokens of q, k and v (or those
    ``merge`` names) merged per frame, the queries unmerged after. Ratio 0 removes an earlier ToMe; a second
    call replaces the first. ``dit_scope`` ``block``: the image tokens are merged at the entry of each block but
    the first ``skip_first_blocks`` and last ``skip_last_blocks`` (matched on the block's input), the whole block
    runs on them, and each token gets its merged token's change (``comfyui_dit_block``; ``merge`` has no meaning
    there). No node offers ``reduce``, ``MEAN`` (ToMe) or ``PRUNE`` (the same tokens dropped: the quality bench's
    baseline), and ``keep_norms``: False merges keys by their plain mean, shorter than they are (``tome.norms``;
    the quality bench measures what that costs). At the block scope a block's matching serves ``reuse_steps``
    consecutive steps; with ``token_cache`` a block does not merge but computes ``1 - ratio`` of the image tokens
    and gives the rest their own cached change (``dit_token_cache``; strides, seed, ``use_rand`` and
    ``reuse_steps`` have no meaning then). ``share_matching``: one matching per model call, made at the first
    image attention call (or reduced block) and shared by the rest (``comfyui.block_plan``)."""
    family = known_family(model, "Apply ToMe")
    if family is None:
        return model
    check_tome_inputs(ratio, stride_x, stride_y, reuse_steps, merge, reduce, REDUCTIONS)
    scope, blocks = scope_and_blocks(model, family, "Apply ToMe", dit_scope, skip_first_blocks, skip_last_blocks)
    if scope == SCOPE_BLOCK and merge != MERGE_QKV and ratio > 0.0:
        log.warning("Apply ToMe: merge=%r has no meaning at dit_scope 'block' (the whole block runs on the merged "
                    "tokens) and is ignored", merge)
    if scope == SCOPE_ATTENTION and ratio > 0.0 and reuse_steps > 1:
        log.warning("Apply ToMe: reuse_steps=%d has no meaning at dit_scope 'attention' (every attention call "
                    "matches afresh) and is ignored", reuse_steps)
    token_cache = checked_token_cache(token_cache, scope, ratio, reuse_steps)
    if token_cache is not None and share_matching:
        log.warning("Apply ToMe: share_matching has no meaning with token_cache (no block matches) and is ignored")
        share_matching = False
    current = base_reduction(model)
    if not reduces(scope, blocks):
        ratio = 0.0
    if ratio <= 0.0 and current.tome is None:
        return model
    if token_cache is None:  # a token cache computes a share of each frame, whatever the cells
        ratio = capped_ratio(ratio, stride_x, stride_y)
    tome = None
    if ratio > 0.0:
        tome = DiTToMe(ratio, stride_x, stride_y, sampling_window(model, start_percent, end_percent),
                       seed=seed, use_rand=use_rand, merge=merge, reduce=reduce, keep_norms=keep_norms,
                       scope=scope, blocks=blocks,
                       reuse_steps=reuse_steps if scope == SCOPE_BLOCK and token_cache is None else 1,
                       token_cache=token_cache, share_matching=share_matching)
    return with_reduction(model, family, dataclasses.replace(current, tome=tome))
