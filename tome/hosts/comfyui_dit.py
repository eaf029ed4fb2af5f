"""ToMe and ToDo in ComfyUI's DiTs (SD3.5, Flux / Flux 2 / Chroma, Wan 2.x, Qwen-Image, Lumina 2 / Z-Image,
HunyuanVideo, LTX-Video, HiDream, Cosmos Predict2).

No DiT calls ``attn1_patch``, but every one of them calls attention through
``wrap_attn``, which hands the call to
``transformer_options["optimized_attention_override"](func, q, k, v, heads, ...)``
when that is set (``comfy/ldm/modules/attention.py``). The override cannot see
the image grid or the text length, so a keyed ``apply_model`` wrapper, which
sees the latent and the conds of every model call, writes the call's
``ImageLayout`` (the grid in patches, and where the image tokens start in each
sequence that holds them) into a copy of that call's ``transformer_options``;
the override reads it back from its ``transformer_options`` keyword.

Inside an attention call the override finds the image tokens by the length of
the sequence (self-attention: queries as long as keys, a length the layout
knows), and leaves everything else as it is: text, registers, reference images
and padding tokens, cross-attention, masked calls, and Wan VACE's control
blocks (told apart by a ``dit`` block replacement that marks the main blocks
while they run: their sequences have the video's length). A self-attention call
of a length the layout neither places the image in nor knows as image-free (a
variant that adds tokens, another pack's extra tokens) is left alone too, with
one warning per sampling run: the image is never looked for by guess. ToDo pools the image
keys and values over cells of the grid; ToMe merges the image tokens by
bipartite soft matching and, where the queries were merged, gives every merged
query its destination's output back.

Tensor layouts differ by model: ``[B, H, L, D]`` with ``skip_reshape`` (Flux,
Qwen-Image, Lumina 2), ``[B, L, H*D]`` (Wan, SD3's q and k) and ``[B, L, H, D]``
(SD3's v). Every operation here works in the token-major view (``[B, L, ...]``,
a transpose for heads-major tensors), where the image tokens of Flux's strided
single-block views are gathered without copying whole sequences.

There is one override slot: an override already on the model is kept and
called instead of ``func``. Patch objects hold only frozen settings (see
``comfyui``). No ComfyUI import.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..downsample import MAX, METHODS, NEAREST
from ..grid import derive_seed
from ..merge import IDENTITY, MEAN, REDUCTIONS, build_plan
from .comfyui import (
    OUTER_SAMPLE,
    WRAPPER_KEY,
    Reach,
    capped_ratio,
    check_choice,
    check_range,
    current_sigma,
    eager,
    sigma_window,
)
from .comfyui_unet import MERGE_KV, MERGE_MODES, MERGE_Q, MERGE_QKV

log = logging.getLogger(__name__)

APPLY_MODEL = "apply_model"  # comfy.patcher_extension.WrappersMP.APPLY_MODEL
OVERRIDE_KEY = "optimized_attention_override"  # the one attention override slot of transformer_options
LAYOUT_KEY = "tome_layout"  # in a model call's transformer_options: its ImageLayout
CALL_KEY = "tome_call"  # in a model call's transformer_options: image self-attention calls so far (for seeds)
MAIN_BLOCK_KEY = "tome_main_block"  # in a VACE model call's transformer_options: whether a main block is running
RUN_KEY = "tome_dit_run"  # in a sampling run's transformer_options: that run's RunWarnings

FLUX, SD3, WAN, QWEN_IMAGE, LUMINA2 = "flux", "sd3", "wan", "qwen_image", "lumina2"
HUNYUAN_VIDEO, LTXV, HIDREAM, COSMOS = "hunyuan_video", "ltxv", "hidream", "cosmos_predict2"
FAMILIES = (FLUX, SD3, WAN, QWEN_IMAGE, LUMINA2, HUNYUAN_VIDEO, LTXV, HIDREAM, COSMOS)
# Class names (of ComfyUI's model_base class, or of its diffusion model) and their family; matched anywhere
# in the class hierarchy. Flux 2, Chroma and Chroma Radiance run Flux's token order ([text | image | refs]) and
# count as Flux; Wan 2.2 (TI2V-5B), VACE, i2v and Fun count as Wan; HunyuanVideo 1.5 and HunyuanImage 2.1 (its
# network) as HunyuanVideo. Wan's S2V, Animate and HuMo add tokens of their own to the video: their calls are
# unrecognised lengths.
FAMILY_OF_CLASS = {
    "Flux": FLUX, "SD3": SD3, "MMDiT": SD3, "WAN21": WAN, "WanModel": WAN,
    "QwenImage": QWEN_IMAGE, "QwenImageTransformer2DModel": QWEN_IMAGE, "Lumina2": LUMINA2, "NextDiT": LUMINA2,
    "HunyuanVideo": HUNYUAN_VIDEO, "LTXV": LTXV, "LTXVModel": LTXV, "HiDream": HIDREAM,
    "HiDreamImageTransformer2DModel": HIDREAM, "CosmosPredict2": COSMOS, "MiniTrainDIT": COSMOS,
}


# Layouts: where the image tokens are, from shapes alone.

@dataclass(frozen=True)
class ImageLayout:
    """The image tokens of one model call.

    ``grid (t, h, w)``: frames, rows and columns in patches (``t`` is 1 for
    images). ``starts``: for each length of a self-attention sequence that
    holds the image, the index of its first image token; the image is
    ``t * h * w`` tokens from there, row-major per frame. ``others``: lengths
    a call may have without the image; any other length is unrecognised.
    """

    grid: tuple[int, int, int]
    starts: Mapping[int, int] = field(default_factory=dict)
    others: frozenset[int] = frozenset()  # self-attention lengths known to hold no image (text refiners)

    @property
    def n_tokens(self) -> int:
        return math.prod(self.grid)

    def start(self, length: int) -> int | None:
        """Where the image starts in a sequence of ``length`` tokens; ``None`` for a sequence without it."""
        return self.starts.get(length)

    def recognises(self, length: int) -> bool:
        """Whether a self-attention sequence of ``length`` tokens is one this layout expects."""
        return length in self.starts or length in self.others


def image_layout(grid: tuple[int, int, int], starts: Mapping[int, int], others: Iterable[int] = ()) -> ImageLayout:
    """An ``ImageLayout``, leaving out the lengths that ``others`` (sequences without the image: a text-only
    refiner, cross-attention keys) share: a call of such a length cannot be told apart, so it is left alone."""
    others = frozenset(others)
    return ImageLayout(grid, {length: start for length, start in starts.items() if length not in others}, others)


def patch_grid(latent_shape: Sequence[int], patch: Sequence[int]) -> tuple[int, int, int]:
    """``(t, h, w)`` in patches of a latent ``[B, C, H, W]`` or ``[B, C, T, H, W]`` padded up to whole patches
    (``pad_to_patch_size``); ``patch`` is ``(pt, ph, pw)``."""
    frames = latent_shape[-3] if len(latent_shape) == 5 else 1
    pt, ph, pw = patch
    return math.ceil(frames / pt), math.ceil(latent_shape[-2] / ph), math.ceil(latent_shape[-1] / pw)


def padded(n: int, multiple: int | None) -> int:
    """``n`` rounded up to ``multiple`` (Lumina's ``pad_tokens_multiple``; ``None``: no padding)."""
    return n + (-n) % multiple if multiple else n


def flux_layout(latent_shape, patch: int, text: int, references: Sequence[Sequence[int]] = ()) -> ImageLayout:
    """Flux: ``[text | image | Kontext references]`` in every block (double blocks join text and image)."""
    grid = patch_grid(latent_shape, (1, patch, patch))
    refs = sum(math.prod(patch_grid(r, (1, patch, patch))) for r in references)
    return image_layout(grid, {text + math.prod(grid) + refs: text})


def sd3_layout(latent_shape, patch: int, text: int, registers: int = 0) -> ImageLayout:
    """SD3 / SD3.5 (MMDiT): ``[registers | text | image]`` in joint attention; SD3.5's ``attn2`` sees the
    image alone."""
    grid = patch_grid(latent_shape, (1, patch, patch))
    n = math.prod(grid)
    return image_layout(grid, {registers + text + n: registers + text, n: 0})


def wan_layout(latent_shape, patch: Sequence[int], contexts: Iterable[int] = (), extra_frames: int = 0,
               reference: Sequence[int] | None = None, reference_frames: int = 0) -> ImageLayout:
    """Wan 2.x: self-attention sees ``[Fun reference frame | video t*h*w]`` and no text.

    ``extra_frames``: latent frames appended in time (``time_dim_concat``);
    ``reference``: the shape of Wan Fun's reference latent ``[B, C, H, W]``,
    made one frame of tokens by an unpadded ``ph x pw`` convolution;
    ``reference_frames``: the video's first latent frames that are reference
    images (VACE), left whole. Cross-attention has keys of the ``contexts``
    lengths (text, CLIP image).
    """
    t, h, w = patch_grid(latent_shape, patch)
    t += math.ceil(extra_frames / patch[0])
    ref = 0 if reference is None else (reference[-2] // patch[1]) * (reference[-1] // patch[2])
    whole = min(reference_frames, t - 1)  # a call made of reference frames alone reduces its last frame
    return image_layout((t - whole, h, w), {ref + t * h * w: ref + whole * h * w}, contexts)


def vace_reference_frames(vace_context: torch.Tensor) -> int:
    """How many leading latent frames of a VACE call are reference images, from its ``vace_context``
    ``[B, contexts, 2C + 64, T, H, W]`` (per context: inactive and reactive control latents, ``C`` channels
    each, then a 64-channel mask). ``WanVaceToVideo`` puts the reference image's latent ahead of the control
    video's with a zero reactive half (zeros through the latent format and back: exactly 0) and a zero mask, in
    every context it makes; a VAE-encoded control frame is never exactly zero."""
    reactive = (vace_context.shape[2] - 64) // 2  # where the reactive half starts: the mask follows it
    frames = 0
    for frame in range(vace_context.shape[3]):
        if vace_context[:, :, reactive:, frame].any():
            break
        frames += 1
    return frames


def qwen_image_layout(latent_shape, patch: int, text: int, references: Sequence[Sequence[int]] = ()) -> ImageLayout:
    """Qwen-Image: ``[text | image | edit references]`` in every block."""
    grid = patch_grid(latent_shape, (1, patch, patch))
    refs = sum(math.prod(patch_grid(r, (1, patch, patch))) for r in references)
    return image_layout(grid, {text + math.prod(grid) + refs: text})


def lumina2_layout(latent_shape, patch: int, text: int, pad_multiple: int | None = None) -> ImageLayout:
    """Lumina 2 / Z-Image: the refiners see the text alone and the image alone, the main layers
    ``[text + pad | image + pad]`` (Z-Image pads each to ``pad_multiple``)."""
    grid = patch_grid(latent_shape, (1, patch, patch))
    text_len, image_len = padded(text, pad_multiple), padded(math.prod(grid), pad_multiple)
    return image_layout(grid, {text_len + image_len: text_len, image_len: 0}, (text_len,))


def hunyuan_video_layout(latent_shape, patch: Sequence[int], text: int, refined_text: int,
                         reference: Sequence[int] | None = None) -> ImageLayout:
    """HunyuanVideo (and 1.5): ``[reference | video | text]`` in every block, the image first.

    ``text``: every context token of the joint blocks (1.5 adds its ByT5 and
    CLIP vision tokens to the LLM's); ``refined_text``: the LLM tokens alone,
    which the token refiner attends among themselves; ``reference``: the shape
    of an I2V reference latent, patched as the video and put before it.
    """
    grid = patch_grid(latent_shape, patch)
    ref = 0 if reference is None else math.prod(patch_grid(reference, patch))
    return image_layout(grid, {ref + math.prod(grid) + text: ref}, (refined_text,))


def ltxv_layout(latent_shape, patch: Sequence[int], contexts: Iterable[int] = (), guides: int = 0) -> ImageLayout:
    """LTX-Video: self-attention sees ``[video | guide frames]`` and no text.

    ``guides``: the tokens of the keyframes ``LTXVAddGuide`` appended to the
    latent in time (``keyframe_idxs``), whole latent frames after the video;
    they are left whole. Cross-attention has keys of the ``contexts`` lengths.
    """
    t, h, w = patch_grid(latent_shape, patch)
    if guides % (h * w):  # not whole frames: not a layout LTXVAddGuide makes
        return ImageLayout((t, h, w), {}, frozenset(contexts))
    return image_layout((t - guides // (h * w), h, w), {t * h * w: 0}, contexts)


def hidream_layout(latent_shape, patch: int, text: int, edit: Sequence[int] | None = None) -> ImageLayout:
    """HiDream: ``[image | text]`` in every block, ``text`` being T5's tokens and the LLM's twice (the last
    layer's and each block's own). ``edit``: the shape of HiDream E1's edit latent, joined to the image along
    the width, so every row of patches holds both: no image span, nothing recognised."""
    if edit is not None:
        return ImageLayout(patch_grid(latent_shape, (1, patch, patch)))
    grid = patch_grid(latent_shape, (1, patch, patch))
    return image_layout(grid, {math.prod(grid) + text: 0})


@dataclass(frozen=True)
class DiTSpec:
    """What a layout needs from the model itself: its family and patch size, SD3's registers, Lumina's token
    padding, whether Wan has Fun's reference convolution, whether HunyuanVideo 1.5 takes ByT5 and CLIP vision
    tokens, and how many main blocks a Wan VACE model has (0 for every other model)."""

    family: str
    patch: tuple[int, int, int]
    registers: int = 0
    pad_multiple: int | None = None
    reference_conv: bool = False
    byt5: bool = False
    vision: bool = False
    vace_main_blocks: int = 0

    def layout(self, latent_shape, text: int, conds: Mapping) -> ImageLayout:
        """The ``ImageLayout`` of one model call with latent ``latent_shape``, ``text`` context tokens and the
        extra ``conds`` the model receives."""
        patch = self.patch[-1]
        if self.family == FLUX:
            return flux_layout(latent_shape, patch, text, [r.shape for r in conds.get("ref_latents") or ()])
        if self.family == SD3:
            return sd3_layout(latent_shape, patch, text, self.registers)
        if self.family == QWEN_IMAGE:
            return qwen_image_layout(latent_shape, patch, text, [r.shape for r in conds.get("ref_latents") or ()])
        if self.family == LUMINA2:
            return lumina2_layout(latent_shape, patch, text, self.pad_multiple)
        if self.family == WAN:
            clip = conds.get("clip_fea")  # i2v: CLIP image tokens, a second cross-attention
            extra = conds.get("time_dim_concat")
            reference = conds.get("reference_latent") if self.reference_conv else None
            vace = conds.get("vace_context")
            return wan_layout(latent_shape, self.patch, [text] + ([clip.shape[-2]] if clip is not None else []),
                              0 if extra is None else extra.shape[2], None if reference is None else reference.shape,
                              0 if vace is None else vace_reference_frames(vace))
        if self.family == HUNYUAN_VIDEO:
            byt5 = conds.get("txt_byt5") if self.byt5 else None
            clip = conds.get("clip_fea") if self.vision else None
            joint = text + sum(0 if c is None else c.shape[1] for c in (byt5, clip))
            reference = conds.get("ref_latent")
            return hunyuan_video_layout(latent_shape, self.patch, joint, text,
                                        None if reference is None else reference.shape)
        if self.family == LTXV:
            keyframes = conds.get("keyframe_idxs")  # [B, 3, guide tokens]: their pixel coordinates
            return ltxv_layout(latent_shape, self.patch, [text], 0 if keyframes is None else keyframes.shape[2])
        if self.family == HIDREAM:
            llama = conds.get("encoder_hidden_states_llama3")  # [B, LLM layers, tokens, width]
            edit = conds.get("image_cond")
            return hidream_layout(latent_shape, patch, text + 2 * (0 if llama is None else llama.shape[2]),
                                  None if edit is None else edit.shape)
        if self.family == COSMOS:  # the video alone, as Wan's
            return wan_layout(latent_shape, self.patch, [text])
        raise ValueError(f"no layout for the DiT family {self.family!r}")


def dit_family(model) -> str | None:
    """The DiT family of a ``ModelPatcher`` (one of ``FAMILIES``), from the class of its model or of its
    diffusion model; ``None`` for anything else (U-Nets, DiTs this adapter does not know)."""
    for obj in (model.model, model.get_model_object("diffusion_model")):
        for cls in type(obj).__mro__:
            if cls.__name__ in FAMILY_OF_CLASS:
                return FAMILY_OF_CLASS[cls.__name__]
    return None


def dit_spec(model, family: str) -> DiTSpec:
    """The ``DiTSpec`` of ``model``, read from its diffusion model's attributes."""
    net = model.get_model_object("diffusion_model")
    if family == LTXV:
        patch = net.patchifier.patch_size
    elif family == COSMOS:
        patch = (net.patch_temporal, net.patch_spatial, net.patch_spatial)
    else:
        patch = net.patch_size
    patch = tuple(patch) if isinstance(patch, Sequence) else (patch, patch)
    patch = (1,) * (3 - len(patch)) + patch  # (ph, pw) of an image model: one frame
    return DiTSpec(family, patch, registers=getattr(net, "register_length", 0) or 0,
                   pad_multiple=getattr(net, "pad_tokens_multiple", None),
                   reference_conv=getattr(net, "ref_conv", None) is not None,
                   byt5=getattr(net, "byt5_in", None) is not None, vision=getattr(net, "vision_in", None) is not None,
                   vace_main_blocks=len(net.blocks) if getattr(net, "vace_blocks", None) is not None else 0)


class RunWarnings:
    """The warnings one sampling run has given, so each is given once per run; cond and uncond may run in two
    threads at once, hence the lock."""

    def __init__(self):
        self._lock = threading.Lock()
        self._given: set[str] = set()

    def first(self, key: str) -> bool:
        """Whether this is the run's first warning of ``key`` (and from now on it is not)."""
        with self._lock:
            if key in self._given:
                return False
            self._given.add(key)
            return True


def start_run(executor, *args, **kwargs):
    """A keyed ``OUTER_SAMPLE`` wrapper: give the sampling run its own ``RunWarnings``, in the copy of the
    model options ComfyUI makes for the run (``executor.class_obj`` is the guider), so it reaches every model
    call of this run and no other."""
    executor.class_obj.model_options.setdefault("transformer_options", {})[RUN_KEY] = RunWarnings()
    return executor(*args, **kwargs)


@dataclass(frozen=True)
class LayoutWrapper:
    """A keyed ``apply_model`` wrapper: hands the model call a copy of its ``transformer_options`` holding the
    call's ``ImageLayout`` (a copy, so a caller's dict, or a default shared between calls, is never written)."""

    spec: DiTSpec

    def __call__(self, executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None,
                 **conds):
        text = 0 if c_crossattn is None else c_crossattn.shape[1]
        options = dict(transformer_options or {})
        options[LAYOUT_KEY] = self.spec.layout(x.shape, text, conds)
        if RUN_KEY not in options:  # a model call outside a sampling run is a run of its own
            options[RUN_KEY] = RunWarnings()
        if self.spec.vace_main_blocks:
            options[MAIN_BLOCK_KEY] = False
            options["patches_replace"] = with_main_blocks_marked(options.get("patches_replace") or {},
                                                                 self.spec.vace_main_blocks)
        on_top = options.get(OVERRIDE_KEY)
        if on_top is None or isinstance(on_top, DiTReduction):
            return executor(x, t, c_concat, c_crossattn, control, options, **conds)
        # Another node put its override over ours after our node ran (an attention backend reinstalling itself
        # at every step): watch, for this call, whether it still calls ours.
        watch = options[OVERRIDE_KEY] = OverrideWatch(on_top)
        out = executor(x, t, c_concat, c_crossattn, control, options, **conds)
        if watch.calls and not watch.reached and options[RUN_KEY].first("dropped"):
            warn_dropped(on_top)
        return out


@dataclass(frozen=True)
class MainBlockMark:
    """A ``dit`` block replacement for main block ``("double_block", i)`` of a Wan VACE model: marks the call's
    ``transformer_options`` while the block runs. VACE's control blocks attend over the control video, a
    sequence of exactly the video's length and grid, and run between the main blocks: the mark is the only
    thing that tells the override which of the two it is in. ``inner``: the replacement another node put on
    that block (skip-layer guidance, say), called in the block's place as before."""

    inner: Callable | None = None

    def __call__(self, args, extra):
        options = args["transformer_options"]
        options[MAIN_BLOCK_KEY] = True
        try:
            return self.inner(args, extra) if self.inner is not None else extra["original_block"](args)
        finally:
            options[MAIN_BLOCK_KEY] = False


def with_main_blocks_marked(replaces: Mapping, blocks: int) -> dict:
    """A copy of ``patches_replace`` (the model's, shared with its clones: never written) whose ``dit`` entries
    mark each of ``blocks`` main blocks, over whatever replacement was there."""
    dit = dict(replaces.get("dit") or {})
    for i in range(blocks):
        dit[("double_block", i)] = MainBlockMark(dit.get(("double_block", i)))
    return dict(replaces, dit=dit)


@dataclass
class OverrideWatch:
    """Another node's override, found on top of ours in one model call, called in its place: counts its calls;
    ours, when reached below it, sets ``reached``. Outside compiled graphs, as ours is: its counts are state."""

    inner: Callable
    calls: int = 0
    reached: bool = False

    @eager
    def __call__(self, func, *args, **kwargs):
        self.calls += 1
        return self.inner(func, *args, **kwargs)


def warn_dropped(override) -> None:
    """One line, once per sampling run: the override on top of ours never calls ours."""
    name = getattr(override, "__qualname__", None) or type(override).__qualname__
    module = getattr(override, "__module__", None) or type(override).__module__
    log.warning("Apply ToDo / Apply ToMe: another node's attention override (%s from %s) replaced this pack's "
                "at run time and does not call it, so nothing is reduced in this run; that node cannot be "
                "stacked with Apply ToDo / Apply ToMe on a DiT", name, module)


# Token-major tensor operations.

def token_major(x: torch.Tensor, heads_major: bool) -> torch.Tensor:
    """``x [B, H, L, D]`` (``heads_major``) as the view ``[B, L, H, D]``; anything else as it is."""
    return x.transpose(1, 2) if heads_major else x


def pool_grid(x: torch.Tensor, grid: tuple[int, int, int], factor: int, time_factor: int,
              method: str) -> torch.Tensor:
    """Image tokens ``x [B, t*h*w, ...]`` pooled over ``time_factor x factor x factor`` cells of ``grid (t, h, w)``.

    Partial cells at the far edges are kept, pooled over the tokens they have
    (as ``tome.downsample.downsample_tokens`` does). Returns
    ``[B, ceil(t/tf) * ceil(h/f) * ceil(w/f), ...]``. ``nearest`` keeps the
    first token of each cell and copies only those.
    """
    t, h, w = grid
    batch, rest = x.shape[0], x.shape[2:]
    cells = x.unflatten(1, (t, h, w))
    if method == NEAREST:
        return cells[:, ::time_factor, ::factor, ::factor].flatten(1, 3)
    dims, steps = (t, h, w), (time_factor, factor, factor)
    sizes = [math.ceil(n / step) for n, step in zip(dims, steps, strict=True)]
    # Pad every axis up to whole cells (F.pad lists the last axis first: channels, w, h, t), then reduce each cell.
    pad = [0, 0]
    for n, step, size in zip(dims[::-1], steps[::-1], sizes[::-1], strict=True):
        pad += [0, size * step - n]
    fill = -math.inf if method == MAX else 0.0
    blocks = F.pad(cells.reshape(batch, t, h, w, -1), pad, value=fill)
    blocks = blocks.view(batch, sizes[0], steps[0], sizes[1], steps[1], sizes[2], steps[2], -1)
    if method == MAX:
        pooled = blocks.amax(dim=(2, 4, 6))
    else:  # a partial cell is the mean of the tokens it has
        counts = [torch.tensor([min(step, n - i * step) for i in range(size)], dtype=x.dtype, device=x.device)
                  for n, step, size in zip(dims, steps, sizes, strict=True)]
        count = counts[0].view(-1, 1, 1, 1) * counts[1].view(1, -1, 1, 1) * counts[2].view(1, 1, -1, 1)
        pooled = blocks.sum(dim=(2, 4, 6)) / count
    return pooled.reshape(batch, -1, *rest)


def replace_span(x: torch.Tensor, start: int, length: int, image: torch.Tensor) -> torch.Tensor:
    """``x [B, L, ...]`` with its ``length`` tokens from ``start`` replaced by ``image [B, L', ...]``."""
    return torch.cat([x[:, :start], image, x[:, start + length:]], dim=1)


class FramePlan:
    """A ``MergePlan`` per frame of a ``(t, h, w)`` grid (frames folded into the batch): merges the image
    tokens ``[B, t*h*w, ...]`` to ``[B, t*m, ...]`` and back."""

    def __init__(self, plan, frames: int):
        self.plan = plan
        self.frames = frames

    @property
    def removed(self) -> int:
        """How many image tokens ``merge`` removes, over all frames."""
        return self.plan.removed * self.frames

    def merge(self, x: torch.Tensor, mode: str = MEAN) -> torch.Tensor:
        batch, n, rest = x.shape[0], x.shape[1], x.shape[2:]
        merged = self.plan.merge(x.reshape(batch * self.frames, n // self.frames, -1), mode)
        return merged.reshape(batch, -1, *rest)

    def unmerge(self, x: torch.Tensor) -> torch.Tensor:
        batch, m, rest = x.shape[0], x.shape[1], x.shape[2:]
        return self.plan.unmerge(x.reshape(batch * self.frames, m // self.frames, -1)).reshape(batch, -1, *rest)


# The attention override.

@dataclass(frozen=True)
class DiTToDo:
    """What one Apply ToDo node asked for, on a DiT."""

    factor: int
    time_factor: int
    method: str
    reach: Reach  # only its sampling window counts on a DiT


@dataclass(frozen=True)
class DiTToMe:
    """What one Apply ToMe node asked for, on a DiT."""

    ratio: float
    sx: int
    sy: int
    reach: Reach  # only its sampling window counts on a DiT
    seed: int = 0
    use_rand: bool = True
    merge: str = MERGE_QKV
    reduce: str = MEAN  # PRUNE: the quality bench's baseline, which drops the tokens ToMe would merge


def warn_unrecognised(options, length: int, layout: ImageLayout) -> None:
    """Once per sampling run: a self-attention call of a length the layout does not know."""
    run = options.get(RUN_KEY)
    if run is None or run.first("unrecognised"):
        log.warning("Apply ToDo / Apply ToMe: a self-attention call of %d tokens is not one this model's token "
                    "layout knows (%s, image grid %s); it is left whole, as is every such call in this run",
                    length, ", ".join(f"{n} tokens with the image at {s}" for n, s in layout.starts.items())
                    or "no sequence with the image", "x".join(map(str, layout.grid)))


@functools.lru_cache(maxsize=64)
def _warn_grid_too_small(grid: tuple[int, int, int], factor: int) -> None:
    """Once per grid and factor, not once per attention call."""
    log.warning("Apply ToDo: downsample_factor %d is larger than a %dx%d token grid; it is left as is",
                factor, grid[2], grid[1])


@dataclass(frozen=True)
class DiTReduction:
    """The ``optimized_attention_override`` of a patched DiT: ToDo, ToMe or both, on image self-attention.

    ``inner``: the override that was on the model before (called instead of
    ``func``). With both, ToDo pools the image keys and values and ToMe merges
    the queries only (as on U-Nets), matching on the unpooled keys.
    """

    todo: DiTToDo | None = None
    tome: DiTToMe | None = None
    inner: Callable | None = None

    @eager  # outside compiled graphs: the layout, the window and the plan are decided at every call
    def __call__(self, func, *args, **kwargs):
        """``wrap_attn``'s call: ``func(q, k, v, heads, [mask], **kwargs)`` is the attention it would run."""
        attention = func if self.inner is None else functools.partial(self.inner, func)
        options = kwargs.get("transformer_options") or {}
        watch = options.get(OVERRIDE_KEY)
        if isinstance(watch, OverrideWatch):  # another override is on top of ours, and it called ours
            watch.reached = True
        layout = options.get(LAYOUT_KEY)
        mask = args[4] if len(args) > 4 else kwargs.get("mask")
        if layout is None or mask is not None or len(args) < 3 or options.get(MAIN_BLOCK_KEY) is False:
            return attention(*args, **kwargs)  # MAIN_BLOCK_KEY False: in a VACE control block
        heads_major = bool(kwargs.get("skip_reshape", False))
        q, k, v = (token_major(t, heads_major) for t in args[:3])
        todo = self.todo if self.todo is not None and self.todo.reach.in_window(options) else None
        tome = self.tome if self.tome is not None and self.tome.reach.in_window(options) else None
        if todo is None and tome is None:
            return attention(*args, **kwargs)
        # Self-attention only: cross-attention has as many keys as context tokens, never as many as queries
        # unless the layout already left that length out.
        self_attention = q.shape[1] == k.shape[1] == v.shape[1]
        start = layout.start(k.shape[1]) if self_attention else None
        if start is None:
            if self_attention and not layout.recognises(k.shape[1]):
                warn_unrecognised(options, k.shape[1], layout)
            return attention(*args, **kwargs)
        call_index = options.get(CALL_KEY, 0)
        options[CALL_KEY] = call_index + 1
        plan = IDENTITY
        if tome is not None:
            plan = self.plan(tome, k[:, start:start + layout.n_tokens], layout.grid, call_index, options)
        merge_q = plan is not IDENTITY and tome.merge in (MERGE_QKV, MERGE_Q)
        merge_kv = plan is not IDENTITY and tome.merge in (MERGE_QKV, MERGE_KV) and todo is None
        if todo is not None:
            k, v = (self.pooled(todo, t, start, layout) for t in (k, v))
        elif merge_kv:
            k, v = (self.merged(plan, t, start, layout.n_tokens, tome.reduce) for t in (k, v))
        if merge_q:
            q = self.merged(plan, q, start, layout.n_tokens, tome.reduce)
        out = attention(*(token_major(t, heads_major) for t in (q, k, v)), *args[3:], **kwargs)
        if not merge_q:
            return out
        out_heads_major = heads_major and bool(kwargs.get("skip_output_reshape", False))
        return token_major(self.unmerged(plan, token_major(out, out_heads_major), start, layout.n_tokens),
                           out_heads_major)

    @staticmethod
    def merged(plan, x: torch.Tensor, start: int, n: int, mode: str) -> torch.Tensor:
        """``x [B, L, ...]`` with its ``n`` image tokens from ``start`` merged by ``plan`` (``mode``: ``MEAN``
        or ``PRUNE``)."""
        return replace_span(x, start, n, plan.merge(x[:, start:start + n], mode))

    @staticmethod
    def unmerged(plan, out: torch.Tensor, start: int, n: int) -> torch.Tensor:
        """The attention output ``out [B, L - removed, ...]`` of merged queries, every image query given its
        destination's output back: ``[B, L, ...]``."""
        kept = n - plan.removed
        return replace_span(out, start, kept, plan.unmerge(out[:, start:start + kept]))

    @staticmethod
    def pooled(todo: DiTToDo, x: torch.Tensor, start: int, layout: ImageLayout) -> torch.Tensor:
        """``x [B, L, ...]`` with its image tokens pooled, or as it is where the grid is smaller than a cell."""
        _, h, w = layout.grid
        if todo.factor > min(h, w):
            _warn_grid_too_small(layout.grid, todo.factor)
            return x
        image = pool_grid(x[:, start:start + layout.n_tokens], layout.grid, todo.factor, todo.time_factor,
                          todo.method)
        return replace_span(x, start, layout.n_tokens, image)

    @staticmethod
    def plan(tome: DiTToMe, keys: torch.Tensor, grid: tuple[int, int, int], call_index: int, options):
        """The merge plan of this call, matched on the image keys ``keys [B, t*h*w, ...]`` frame by frame:
        a ``FramePlan``, or ``IDENTITY`` where nothing is merged."""
        t, h, w = grid
        metric = keys.reshape(keys.shape[0] * t, h * w, -1)
        generator = None
        if tome.use_rand:
            seed = derive_seed(tome.seed, current_sigma(options) or 0.0, ("dit",), call_index)
            generator = torch.Generator().manual_seed(seed)
        plan = build_plan(metric, w, h, tome.sx, tome.sy, int(h * w * tome.ratio), no_rand=not tome.use_rand,
                          generator=generator)
        return IDENTITY if plan is IDENTITY else FramePlan(plan, t)


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
    if reduction.todo is None and reduction.tome is None:
        if reduction.inner is None:
            options.pop(OVERRIDE_KEY, None)
        else:
            options[OVERRIDE_KEY] = reduction.inner
        return patched
    options[OVERRIDE_KEY] = reduction
    patched.add_wrapper_with_key(APPLY_MODEL, WRAPPER_KEY, LayoutWrapper(dit_spec(patched, family)))
    patched.add_wrapper_with_key(OUTER_SAMPLE, WRAPPER_KEY, start_run)
    return patched


def base_reduction(model) -> DiTReduction:
    """Our override on ``model``, or an empty one keeping the override another node put there."""
    current = current_reduction(model)
    if current is not None:
        return current
    return DiTReduction(inner=model.model_options.get("transformer_options", {}).get(OVERRIDE_KEY))


def apply_todo_dit(model, *, downsample_factor: int, method: str = NEAREST, time_factor: int = 1,
                   start_percent: float = 0.0, end_percent: float = 1.0):
    """Clone ``model`` (a DiT) with ToDo's key/value pooling in its image self-attention.

    ``downsample_factor`` pools ``factor x factor`` cells of the image grid,
    ``time_factor`` (video) that many frames too; both 1 removes an earlier
    ToDo. A second call replaces the first.
    """
    family = known_family(model, "Apply ToDo")
    if family is None:
        return model
    check_range("downsample_factor", downsample_factor, 1, 8)
    check_range("time_factor", time_factor, 1, 8)
    check_choice("method", method, METHODS)
    current = base_reduction(model)
    todo = None
    if downsample_factor > 1 or time_factor > 1:
        todo = DiTToDo(downsample_factor, time_factor, method,
                       Reach(1, *sigma_window(model, start_percent, end_percent)))
    if todo is None and current.todo is None:
        return model
    return with_reduction(model, family, dataclasses.replace(current, todo=todo))


def apply_tome_dit(model, *, ratio: float, stride_x: int = 2, stride_y: int = 2, seed: int = 0,
                   use_rand: bool = True, merge: str = MERGE_QKV, start_percent: float = 0.0,
                   end_percent: float = 1.0, reduce: str = MEAN):
    """Clone ``model`` (a DiT) with ToMe in its image self-attention: the image tokens of q, k and v (or those
    ``merge`` names) merged per frame, the queries unmerged after. Ratio 0 removes an earlier ToMe; a second
    call replaces the first. ``reduce``: ``MEAN`` (ToMe) or ``PRUNE`` (the same tokens dropped: the quality
    bench's baseline; no node offers it)."""
    family = known_family(model, "Apply ToMe")
    if family is None:
        return model
    check_range("ratio", ratio, 0.0, 0.99)
    check_range("stride_x", stride_x, 1, 8)
    check_range("stride_y", stride_y, 1, 8)
    check_choice("merge", merge, MERGE_MODES)
    check_choice("reduce", reduce, REDUCTIONS)
    current = base_reduction(model)
    if ratio <= 0.0 and current.tome is None:
        return model
    ratio = capped_ratio(ratio, stride_x, stride_y)
    tome = None
    if ratio > 0.0:
        tome = DiTToMe(ratio, stride_x, stride_y, Reach(1, *sigma_window(model, start_percent, end_percent)),
                       seed=seed, use_rand=use_rand, merge=merge, reduce=reduce)
    return with_reduction(model, family, dataclasses.replace(current, tome=tome))
