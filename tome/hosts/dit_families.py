"""The DiT families of ComfyUI: how each is recognised, where its image (video) tokens sit, and what its blocks
take.

A family is one ``Family`` in ``FAMILY_LIST``: the class names it is known by
(of ComfyUI's ``model_base`` class or of its diffusion model), how its patch
size is read from the diffusion model, and its layout: from the latent's shape,
the text length and the conds of one model call, an ``ImageLayout`` (the grid
in patches, and where the image starts in each self-attention sequence that
holds it). Every token a layout does not place in the image (text, registers,
reference, edit, guide frames, padding) is left whole. A family the block scope
reaches has its entry in ``BLOCK_FAMILIES`` too: its blocks in the order they
run, and per kind of block every argument of ComfyUI's ``dit`` block
replacement, declared by what becomes of it (``BlockArgs``). Adding a family
touches this module, its tests and its example workflow; the machinery (the
attention override, the block replacements, the wrappers, registration) is
``comfyui_dit`` and the modules it names.

Each layout and each block's arguments are written from the family's own code in ComfyUI
(``comfy/ldm/<family>/``): the token order its blocks build, read from shapes alone, and the ``args`` its
forward hands each block replacement. No ComfyUI import.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from .comfyui_dit_swap import HiDreamBlock, LuminaBlock

# Layouts: where the image tokens are, from shapes alone.

@dataclass(frozen=True)
class ImageLayout:
    """The image tokens of one model call.

    ``grid (t, h, w)``: frames, rows and columns in patches (``t`` is 1 for
    images). ``starts``: for each length of a self-attention sequence that
    holds the image, the index of its first image token; the image is
    ``t * h * w`` tokens from there, row-major per frame. ``others``: lengths
    a call may have without the image; any other length is unrecognised.
    ``row_stride``: where the image is not one span but ``t * h`` rows of
    ``w`` tokens, one every ``row_stride`` tokens from the start, other tokens
    between them (HiDream E1: each row of patches is the image's, then the
    edit image's); ``None``: one span.
    """

    grid: tuple[int, int, int]
    starts: Mapping[int, int] = field(default_factory=dict)
    others: frozenset[int] = frozenset()  # self-attention lengths known to hold no image (text refiners)
    row_stride: int | None = None

    @property
    def n_tokens(self) -> int:
        return math.prod(self.grid)

    def start(self, length: int) -> int | None:
        """Where the image starts in a sequence of ``length`` tokens; ``None`` for a sequence without it."""
        return self.starts.get(length)

    def recognises(self, length: int) -> bool:
        """Whether a self-attention sequence of ``length`` tokens is one this layout expects."""
        return length in self.starts or length in self.others


def image_layout(grid: tuple[int, int, int], starts: Mapping[int, int], others: Iterable[int] = (),
                 row_stride: int | None = None) -> ImageLayout:
    """An ``ImageLayout``, leaving out the lengths that ``others`` (sequences without the image: a text-only
    refiner, cross-attention keys) share: a call of such a length cannot be told apart, so it is left alone."""
    others = frozenset(others)
    return ImageLayout(grid, {length: start for length, start in starts.items() if length not in others}, others,
                       row_stride)


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


HostRead = Callable[[torch.Tensor], list]  # a 1-D tensor's values on the host (plainly: torch.Tensor.tolist)


def vace_reference_frames(vace_context: torch.Tensor, read: HostRead = torch.Tensor.tolist) -> int:
    """How many leading latent frames of a VACE call are reference images, from its ``vace_context``
    ``[B, contexts, 2C + 64, T, H, W]`` (per context: inactive and reactive control latents, ``C`` channels
    each, then a 64-channel mask). ``WanVaceToVideo`` puts the reference image's latent ahead of the control
    video's with a zero reactive half (zeros through the latent format and back: exactly 0) and a zero mask, in
    every context it makes; a VAE-encoded control frame is never exactly zero."""
    reactive = (vace_context.shape[2] - 64) // 2  # where the reactive half starts: the mask follows it
    # One reduction over every frame, then one read: a read per frame would wait for a GPU's queue each time.
    control = read(vace_context[:, :, reactive:].any(dim=(0, 1, 2, 4, 5)))
    return next((frame for frame, nonzero in enumerate(control) if nonzero), len(control))


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
    layer's and each block's own).

    ``edit``: the shape of HiDream E1's edit latent, which ``_forward`` joins
    to the image along the width before patching: each of the ``h`` rows of
    patches is the image's ``w`` and then the edit's, so the image is rows of
    ``w`` tokens, ``row_stride`` apart, then the text. Where the latent's width
    is not a whole number of patches, one patch of each row holds the image's
    last column and the edit's first: neither image nor edit, so no call is
    recognised (each is left whole, with the one warning per run).
    """
    grid = patch_grid(latent_shape, (1, patch, patch))
    if edit is None:
        return image_layout(grid, {math.prod(grid) + text: 0})
    if latent_shape[-1] % patch:
        return ImageLayout(grid)
    row = math.ceil((latent_shape[-1] + edit[-1]) / patch)  # the joined latent is padded to whole patches
    return image_layout(grid, {grid[1] * row + text: 0}, row_stride=row)


def mochi_layout(latent_shape, patch: Sequence[int], text: int) -> ImageLayout:
    """Mochi: ``[video | text]`` in every block's joint attention (``AsymmetricAttention`` joins the video's
    queries, keys and values to the text's, the text cut to ``text`` tokens)."""
    grid = patch_grid(latent_shape, patch)
    return image_layout(grid, {math.prod(grid) + text: 0})


# Wan 2.2 Animate's reference image is the latent's first frame: WanAnimateToVideo puts its latent ahead of the
# video's, and AnimateWanModel adds the pose latents from frame 1 on and pads the face motion with one empty frame
# for it (``comfy/ldm/wan/model_animate.py``).
ANIMATE_REFERENCE_FRAMES = 1
# HuMo's audio cross-attention attends each frame's video tokens to that frame's 16 audio tokens
# (``WanT2VCrossAttentionGather``): a length of no self-attention call.
HUMO_AUDIO_TOKENS = 16


def unpadded_tokens(shape: Sequence[int], patch: Sequence[int]) -> int:
    """Tokens of a latent ``[B, C, T, H, W]`` patched by an unpadded ``patch`` convolution, as Wan S2V and HuMo
    patch their reference latent with the video's ``patch_embedding`` (the video is padded first; it is not)."""
    return (shape[-3] // patch[0]) * (shape[-2] // patch[1]) * (shape[-1] // patch[2])


def s2v_motion_tokens(motion_shape: Sequence[int]) -> int:
    """Wan S2V's motion tokens from its reference motion latent ``[B, 16, T, H, W]``: ``FramePackMotioner`` packs
    the last 19 latent frames (zero-padded to 19) as 1 frame of 1x2x2 patches, 2 frames of 2x4x4 and 16 frames of
    4x8x8, each an unpadded convolution of fixed kernel."""
    h, w = motion_shape[-2], motion_shape[-1]
    return (h // 2) * (w // 2) + (h // 4) * (w // 4) + 4 * ((h // 8) * (w // 8))


def wan_appended_layout(latent_shape, patch: Sequence[int], contexts: Iterable[int] = (),
                        appended: int = 0) -> ImageLayout:
    """Wan 2.2 S2V and HuMo: self-attention sees ``[video t*h*w | appended]`` and no text; ``appended``: the
    tokens the model puts after the video (S2V's reference and motion tokens, HuMo's reference), left whole."""
    grid = patch_grid(latent_shape, patch)
    return image_layout(grid, {math.prod(grid) + appended: 0}, contexts)


# The model's side: what a layout needs from the diffusion model, read once when a node patches it.

@dataclass(frozen=True)
class DiTSpec:
    """What a layout needs from the model itself: its family and patch size, SD3's registers, Lumina's token
    padding, whether Wan has Fun's reference convolution, whether HunyuanVideo 1.5 takes ByT5 and CLIP vision
    tokens, how many main blocks a Wan VACE model has (0 for every other model), and whether the model calls its
    blocks without ``transformer_options`` (Wan 2.2 S2V), which must then be handed to them."""

    family: str
    patch: tuple[int, int, int]
    registers: int = 0
    pad_multiple: int | None = None
    reference_conv: bool = False
    byt5: bool = False
    vision: bool = False
    vace_main_blocks: int = 0
    blocks_without_options: bool = False

    def layout(self, latent_shape, text: int, conds: Mapping, read: HostRead = torch.Tensor.tolist) -> ImageLayout:
        """The ``ImageLayout`` of one model call with latent ``latent_shape``, ``text`` context tokens and the
        extra ``conds`` the model receives; ``read``: how a family whose layout depends on a tensor's values
        (Wan VACE) reads them to the host (the layout wrapper passes ``ModelCall.read``)."""
        return FAMILY_BY_NAME[self.family].layout(self, latent_shape, text, conds, read)


# Each family's layout of one model call: its layout function fed from the spec and the call's conds.

def shapes(latents) -> list[torch.Size]:
    """The shapes of a list of reference latents (``ref_latents``), empty for ``None``."""
    return [r.shape for r in latents or ()]


def flux_call(spec: DiTSpec, latent_shape, text: int, conds: Mapping, read: HostRead) -> ImageLayout:
    """Flux, Flux 2, Chroma: Kontext / Flux 2 references from ``ref_latents``."""
    return flux_layout(latent_shape, spec.patch[-1], text, shapes(conds.get("ref_latents")))


def sd3_call(spec: DiTSpec, latent_shape, text: int, conds: Mapping, read: HostRead) -> ImageLayout:
    """SD3: the registers the model has."""
    return sd3_layout(latent_shape, spec.patch[-1], text, spec.registers)


def qwen_image_call(spec: DiTSpec, latent_shape, text: int, conds: Mapping, read: HostRead) -> ImageLayout:
    """Qwen-Image: edit references from ``ref_latents``."""
    return qwen_image_layout(latent_shape, spec.patch[-1], text, shapes(conds.get("ref_latents")))


def lumina2_call(spec: DiTSpec, latent_shape, text: int, conds: Mapping, read: HostRead) -> ImageLayout:
    """Lumina 2 / Z-Image: the model's token padding."""
    return lumina2_layout(latent_shape, spec.patch[-1], text, spec.pad_multiple)


def wan_contexts(text: int, conds: Mapping) -> list[int]:
    """The key lengths of Wan's cross-attention: the text, and i2v's CLIP image tokens (a second one)."""
    clip = conds.get("clip_fea")
    return [text] + ([clip.shape[-2]] if clip is not None else [])


def wan_call(spec: DiTSpec, latent_shape, text: int, conds: Mapping, read: HostRead) -> ImageLayout:
    """Wan 2.x: frames appended in time, Fun's reference latent (where the model has its convolution), VACE's
    reference frames."""
    extra = conds.get("time_dim_concat")
    reference = conds.get("reference_latent") if spec.reference_conv else None
    vace = conds.get("vace_context")
    return wan_layout(latent_shape, spec.patch, wan_contexts(text, conds), 0 if extra is None else extra.shape[2],
                      None if reference is None else reference.shape,
                      0 if vace is None else vace_reference_frames(vace, read))


def wan_animate_call(spec: DiTSpec, latent_shape, text: int, conds: Mapping, read: HostRead) -> ImageLayout:
    """Wan 2.2 Animate: ``[reference frame | video]``, the reference frame left whole. Its pose latents are
    added to the video's tokens, its face motion reaches the video through an attention of its own (no
    ``transformer_options``, so never through the override): neither adds tokens."""
    return wan_layout(latent_shape, spec.patch, wan_contexts(text, conds), reference_frames=ANIMATE_REFERENCE_FRAMES)


def wan_s2v_call(spec: DiTSpec, latent_shape, text: int, conds: Mapping, read: HostRead) -> ImageLayout:
    """Wan 2.2 S2V: ``[video | reference | motion]``. Its control video is added to the video's tokens, its audio
    is injected after the blocks by an attention of its own (no ``transformer_options``)."""
    reference, motion = conds.get("reference_latent"), conds.get("reference_motion")
    appended = (0 if reference is None else unpadded_tokens(reference.shape, spec.patch)) + \
        (0 if motion is None else s2v_motion_tokens(motion.shape))
    return wan_appended_layout(latent_shape, spec.patch, [text], appended)


def wan_humo_call(spec: DiTSpec, latent_shape, text: int, conds: Mapping, read: HostRead) -> ImageLayout:
    """HuMo: ``[video | reference]``; the audio cross-attention's per-frame keys are a length of their own."""
    reference = conds.get("reference_latent")
    return wan_appended_layout(latent_shape, spec.patch, [text, HUMO_AUDIO_TOKENS],
                               0 if reference is None else unpadded_tokens(reference.shape, spec.patch))


def hunyuan_video_call(spec: DiTSpec, latent_shape, text: int, conds: Mapping, read: HostRead) -> ImageLayout:
    """HunyuanVideo: 1.5's ByT5 and CLIP vision tokens join the text; the I2V reference latent."""
    byt5 = conds.get("txt_byt5") if spec.byt5 else None
    clip = conds.get("clip_fea") if spec.vision else None
    joint = text + sum(0 if c is None else c.shape[1] for c in (byt5, clip))
    reference = conds.get("ref_latent")
    return hunyuan_video_layout(latent_shape, spec.patch, joint, text, None if reference is None else reference.shape)


def ltxv_call(spec: DiTSpec, latent_shape, text: int, conds: Mapping, read: HostRead) -> ImageLayout:
    """LTX-Video: the guide tokens ``keyframe_idxs [B, 3, guide tokens]`` names by their pixel coordinates."""
    keyframes = conds.get("keyframe_idxs")
    return ltxv_layout(latent_shape, spec.patch, [text], 0 if keyframes is None else keyframes.shape[2])


def hidream_call(spec: DiTSpec, latent_shape, text: int, conds: Mapping, read: HostRead) -> ImageLayout:
    """HiDream: the LLM's tokens ``[B, LLM layers, tokens, width]`` twice after T5's; E1's edit latent."""
    llama = conds.get("encoder_hidden_states_llama3")
    edit = conds.get("image_cond")
    return hidream_layout(latent_shape, spec.patch[-1], text + 2 * (0 if llama is None else llama.shape[2]),
                          None if edit is None else edit.shape)


def cosmos_call(spec: DiTSpec, latent_shape, text: int, conds: Mapping, read: HostRead) -> ImageLayout:
    """Cosmos Predict2 and Cosmos 1: self-attention sees the video alone, as Wan's (Cosmos 1's image to video
    enters as channels, a mask and the image's latent); cross-attention has the text's keys."""
    return wan_layout(latent_shape, spec.patch, [text])


# Mochi's text in joint attention: AsymmDiTJoint.forward crops it to ``num_tokens``, which GenmoMochi.extra_conds
# counts from the T5 mask (the prompt without its padding to 256 tokens); without a mask, the default of 256.
MOCHI_TEXT_TOKENS = 256


def mochi_call(spec: DiTSpec, latent_shape, text: int, conds: Mapping, read: HostRead) -> ImageLayout:
    """Mochi: the text as the blocks crop it, to ``num_tokens`` of its ``text`` tokens."""
    return mochi_layout(latent_shape, spec.patch, min(text, conds.get("num_tokens", MOCHI_TEXT_TOKENS)))


# The families.

def patch_size(net) -> Sequence[int] | int:
    """The patch size most diffusion models keep as ``patch_size``."""
    return net.patch_size


def cosmos_patch(net) -> Sequence[int]:
    """Cosmos (1 and Predict2) keeps its temporal and spatial patch sizes apart."""
    return net.patch_temporal, net.patch_spatial, net.patch_spatial


@dataclass(frozen=True)
class Family:
    """One DiT family: its name, the class names it is known by (matched anywhere in the class hierarchy of
    ComfyUI's model class or of its diffusion model), its ``layout(spec, latent_shape, text, conds, read)``, and how
    its patch size is read from the diffusion model; ``blocks_without_options``: its model calls its blocks without
    ``transformer_options``, so the attention override reaches them only if the layout wrapper hands them over."""

    name: str
    classes: tuple[str, ...]
    layout: Callable[[DiTSpec, Sequence[int], int, Mapping, HostRead], ImageLayout]
    patch: Callable[[torch.nn.Module], Sequence[int] | int] = patch_size
    blocks_without_options: bool = False


FLUX, SD3, WAN, QWEN_IMAGE, LUMINA2 = "flux", "sd3", "wan", "qwen_image", "lumina2"
HUNYUAN_VIDEO, LTXV, HIDREAM, COSMOS = "hunyuan_video", "ltxv", "hidream", "cosmos_predict2"
MOCHI, COSMOS1 = "mochi", "cosmos1"
WAN_ANIMATE, WAN_S2V, WAN_HUMO = "wan_animate", "wan_s2v", "wan_humo"
# Flux 2, Chroma and Chroma Radiance run Flux's token order ([text | image | refs]) and count as Flux; Wan 2.2
# (TI2V-5B), VACE, i2v and Fun count as Wan; HunyuanVideo 1.5 and HunyuanImage 2.1 (its network) as
# HunyuanVideo. Wan's Animate, S2V and HuMo subclass Wan's classes and add tokens (or a reference frame) of their
# own: they are families of their own (a class hierarchy is matched from its most derived class up, so their
# own class names win over Wan's).
FAMILY_LIST = (
    Family(FLUX, ("Flux",), flux_call),
    Family(SD3, ("SD3", "MMDiT"), sd3_call),
    Family(WAN_ANIMATE, ("WAN22_Animate", "AnimateWanModel"), wan_animate_call),
    Family(WAN_S2V, ("WAN22_S2V", "WanModel_S2V"), wan_s2v_call, blocks_without_options=True),
    Family(WAN_HUMO, ("WAN21_HuMo", "HumoWanModel"), wan_humo_call),
    Family(WAN, ("WAN21", "WanModel"), wan_call),
    Family(QWEN_IMAGE, ("QwenImage", "QwenImageTransformer2DModel"), qwen_image_call),
    Family(LUMINA2, ("Lumina2", "NextDiT"), lumina2_call),
    Family(HUNYUAN_VIDEO, ("HunyuanVideo",), hunyuan_video_call),
    Family(LTXV, ("LTXV", "LTXVModel"), ltxv_call, patch=lambda net: net.patchifier.patch_size),
    Family(HIDREAM, ("HiDream", "HiDreamImageTransformer2DModel"), hidream_call),
    Family(COSMOS, ("CosmosPredict2", "MiniTrainDIT"), cosmos_call, patch=cosmos_patch),
    Family(COSMOS1, ("CosmosVideo", "GeneralDIT"), cosmos_call, patch=cosmos_patch),
    Family(MOCHI, ("GenmoMochi", "AsymmDiTJoint"), mochi_call),
)
FAMILY_BY_NAME = {family.name: family for family in FAMILY_LIST}
FAMILIES = tuple(FAMILY_BY_NAME)
FAMILY_OF_CLASS = {cls: family.name for family in FAMILY_LIST for cls in family.classes}


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
    patch = FAMILY_BY_NAME[family].patch(net)
    patch = tuple(patch) if isinstance(patch, Sequence) else (patch, patch)
    patch = (1,) * (3 - len(patch)) + patch  # (ph, pw) of an image model: one frame
    return DiTSpec(family, patch, registers=getattr(net, "register_length", 0) or 0,
                   pad_multiple=getattr(net, "pad_tokens_multiple", None),
                   reference_conv=getattr(net, "ref_conv", None) is not None,
                   byt5=getattr(net, "byt5_in", None) is not None, vision=getattr(net, "vision_in", None) is not None,
                   vace_main_blocks=len(net.blocks) if getattr(net, "vace_blocks", None) is not None else 0,
                   blocks_without_options=FAMILY_BY_NAME[family].blocks_without_options)


# The blocks: what each family's blocks take, for the block scope (``comfyui_dit_block``).

BlockKey = tuple[str, int]  # ComfyUI's key of a block: ("double_block", i) or ("single_block", i)
DOUBLE, SINGLE = "double_block", "single_block"


def keys_of(double: str, single: str | None = None) -> Callable[[torch.nn.Module], tuple[BlockKey, ...]]:
    """A family's block keys in the order its blocks run: those of the list ``net.<double>``, which ComfyUI calls
    ``("double_block", i)``, then those of ``net.<single>`` (``("single_block", i)``) where it has one."""
    def keys(net: torch.nn.Module) -> tuple[BlockKey, ...]:
        return tuple((DOUBLE, i) for i in range(len(getattr(net, double)))) + \
            (tuple((SINGLE, i) for i in range(len(getattr(net, single)))) if single else ())
    return keys


def block_paths(**lists: str) -> Callable[[torch.nn.Module], dict[BlockKey, str]]:
    """The paths of a swapped family's blocks by key: ``lists`` names, per kind of block, its list in the net
    (``double_block="layers"``: ``("double_block", i)`` is ``layers.i``)."""
    return lambda net: {(kind, i): f"{name}.{i}" for kind, name in lists.items()
                        for i in range(len(getattr(net, name)))}


# Where a block's sequence puts its text: ``args["txt"]`` ahead of the image stream (Flux's double blocks, SD3,
# Qwen-Image), after it (HunyuanVideo's double blocks, Mochi), or in no sequence of the block's (``None``: joined
# into ``img`` already, or cross-attention context).
TEXT_BEFORE, TEXT_AFTER = "before", "after"
# What a per-token table has one row for: every token of the layout's sequence, or those of ``args["img"]``.
SEQUENCE, IMAGE_STREAM = "sequence", "img"
IMG = "img"  # the argument holding the tokens the block scope reduces (the image's, where the layout places them)


@dataclass(frozen=True)
class TokenRows:
    """An entry of a block's ``args`` with one row per token (rotary tables, a per-token modulation, a
    self-attention mask over the sequence), which follows the tokens into the reduced block: a merged token
    gets its destination's row, a pooled cell its first token's. A table of one row is shared by every token
    and left as it is.

    ``axis``: its token axis; ``over``: the tokens it has rows for (``SEQUENCE`` or ``IMAGE_STREAM``);
    ``batched``: whether its first axis is the batch (Mochi's rotary tables ``[N, heads, D/2]`` have none).
    """

    key: str
    axis: int
    over: str = SEQUENCE
    batched: bool = True

    def image_at(self, start: int, offset: int) -> int:
        """Where the image starts in the table's rows, ``start`` and ``offset`` being where it and ``img`` start
        in the layout's sequence."""
        return start if self.over == SEQUENCE else start - offset

    def expected(self, length: int, stream: int) -> int:
        """How many rows a table following the tokens has, of a sequence of ``length`` and an ``img`` of
        ``stream`` tokens."""
        return length if self.over == SEQUENCE else stream

    def fits(self, table, length: int, stream: int) -> bool:
        """Whether ``table`` (this entry of one call's ``args``) is absent, or a tensor of one row per token or a
        single row."""
        if table is None:
            return True
        return isinstance(table, torch.Tensor) and table.ndim > self.axis and \
            table.shape[self.axis] in (1, self.expected(length, stream))


@dataclass(frozen=True)
class BlockArgs:
    """Every argument one kind of block of a family takes in the ``args`` of ComfyUI's ``dit`` replacement, by
    what the block scope does with it. ``img`` holds the tokens it reduces (the image's, where the layout places
    them; every other token in it runs whole).

    ``text``: where ``args["txt"]`` sits in the layout's sequence (``TEXT_BEFORE``, ``TEXT_AFTER``) or ``None``
    (the sequence is ``img`` itself: Flux's single blocks hold the text in it, Wan's and LTX-Video's text is
    cross-attention context). ``whole``: the arguments passed as they are (the text, a modulation shared by every
    token, ``transformer_options``, text-only masks and ranges). ``rows``: the per-token tables that follow the
    tokens. ``ranges``: ``args`` keys of token ranges ``[(start, end or None, modulation index)]`` over ``img``
    (HunyuanVideo's image-to-video modulation: the first frame's tokens apart), moved to the reduced tokens'
    frames. ``masks``: self-attention masks over the sequence (regional prompting's), which reduced tokens cannot
    follow: a call with one runs whole. ``text_crop``: the ``args`` key of how many text tokens the sequence takes
    (Mochi's ``num_tokens``). ``frame_vec``: ``vec`` (passed whole otherwise) may hold one modulation per latent
    frame, which the block repeats over each frame's tokens (Wan 2.2 TI2V-5B with a start image): pooled over
    frames as the tokens are. Any other argument is undeclared.
    """

    text: str | None
    whole: tuple[str, ...] = ()
    rows: tuple[TokenRows, ...] = ()
    ranges: tuple[str, ...] = ()
    masks: tuple[str, ...] = ()
    text_crop: str | None = None
    frame_vec: bool = False

    @property
    def declared(self) -> frozenset[str]:
        """The ``args`` keys this kind of block takes."""
        return frozenset((IMG, *self.whole, *(rows.key for rows in self.rows), *self.ranges, *self.masks,
                          *((self.text_crop,) if self.text_crop else ())))

    def sequence(self, args: dict) -> tuple[int, int]:
        """Where ``img`` starts in the layout's sequence of this call, and the sequence's length."""
        stream = args[IMG].shape[1]
        if self.text is None:
            return 0, stream
        text = args["txt"].shape[1]
        if self.text_crop is not None:
            text = min(text, args[self.text_crop])
        return (text, text + stream) if self.text == TEXT_BEFORE else (0, stream + text)

    def wrong_table(self, args: dict, length: int) -> str | None:
        """The first of this call's tables that is of the wrong kind (``TokenRows.fits``), ``length`` being the
        sequence's; ``None`` where none is."""
        stream = args[IMG].shape[1]
        return next((rows.key for rows in self.rows if not rows.fits(args.get(rows.key), length, stream)), None)

    def tables(self, args: dict, length: int) -> list[tuple[TokenRows, torch.Tensor]] | None:
        """The tables of this call that follow the tokens (those of one row per token); ``None`` where one is of
        the wrong kind."""
        if self.wrong_table(args, length) is not None:
            return None
        return [(rows, args[rows.key]) for rows in self.rows
                if args.get(rows.key) is not None and args[rows.key].shape[rows.axis] != 1]


@dataclass(frozen=True)
class BlockSwap:
    """How the block scope reaches the blocks of a family ComfyUI calls without a ``dit`` replacement
    (``comfyui_dit_swap``): ``paths(net)``, each block's path under the diffusion model by key, and ``mixin``,
    the swapped class's front."""

    paths: Callable[[torch.nn.Module], dict[BlockKey, str]]
    mixin: type


@dataclass(frozen=True)
class DirectBlock:
    """How the block scope runs a family's block itself instead of ComfyUI's ``original_block``, where that
    closure stands in torch.compile's way: ``module(net, key)``, the block's module; ``run(module, net, args)``,
    the block on ``args`` (the replacement's), as the closure runs it, returning its ``{"img", "txt"}``."""

    module: Callable[[torch.nn.Module, BlockKey], torch.nn.Module]
    run: Callable[[torch.nn.Module, torch.nn.Module, dict], dict]


@dataclass(frozen=True)
class FamilyBlocks:
    """A family the block scope reaches: ``keys(net)``, its blocks in the order they run; ``args``, per kind of
    block (``DOUBLE``, ``SINGLE``), what it takes; ``swap``, for a family ComfyUI calls without a ``dit``
    replacement, how its blocks' classes are swapped (``None``: ComfyUI's own replacement); ``direct``, for a
    family whose ``original_block`` the scope does not call, how it runs the block itself."""

    keys: Callable[[torch.nn.Module], tuple[BlockKey, ...]]
    args: Mapping[str, BlockArgs]
    swap: BlockSwap | None = None
    direct: DirectBlock | None = None


def run_joint_block(block: torch.nn.Module, net: torch.nn.Module, args: dict) -> dict:
    """An MMDiT joint block on a ``dit`` replacement's ``args``. ComfyUI's ``block_wrap`` indexes
    ``joint_blocks`` by the block index it captured, which torch.compile specializes on: the same code
    recompiled for every block, and past dynamo's recompile limit (8) the remaining blocks run uncompiled. The
    block, handed in, compiles once for every block of its shape. ``use_checkpoint`` as the unpatched forward
    passes it (``block_wrap`` leaves the block's default, which wraps its work in activation checkpointing: the
    same values, more host work)."""
    txt, img = block(args["txt"], args["img"], c=args["vec"], use_checkpoint=net.use_checkpoint,
                     transformer_options=args["transformer_options"])
    return {"txt": txt, "img": img}


# Each family's block arguments, as ComfyUI 0.3.75's forward hands them to a ``dit`` replacement (the step caches'
# forwards, TeaCache's, MagCache's and First Block Cache's, hand a subset: no ``transformer_options``).
OPTIONS = "transformer_options"
# Flux, Flux 2, Chroma (Radiance): the rotary table ``pe [B, 1, L, D/2, 2, 2]`` over ``[txt | img]``; ``vec`` the
# modulation (Flux 2's and Chroma's: tuples of them); ``attn_mask`` regional prompting's mask over the sequence.
FLUX_PE = TokenRows("pe", 2)
FLUX_DOUBLE = BlockArgs(TEXT_BEFORE, whole=("txt", "vec", OPTIONS), rows=(FLUX_PE,), masks=("attn_mask",))
FLUX_SINGLE = BlockArgs(None, whole=("vec", OPTIONS), rows=(FLUX_PE,), masks=("attn_mask",))
SD3_JOINT = BlockArgs(TEXT_BEFORE, whole=("txt", "vec", OPTIONS))
# Wan: ``pe [1, L, 1, D/2, 2, 2]`` over the video; ``txt`` the cross-attention context; ``vec`` the modulation.
WAN_BLOCKS = FamilyBlocks(keys_of("blocks"), {DOUBLE: BlockArgs(None, whole=("txt", "vec", OPTIONS),
                                                                 rows=(TokenRows("pe", 1),), frame_vec=True)})
# HunyuanVideo's self-attention mask (text padding) is ``[1, 1, L]`` over the sequence, its image rows zero.
HUNYUAN_ROWS = (FLUX_PE, TokenRows("attention_mask", 2))
# LTX-Video's modulation ``vec`` is ``[B, 1, 6C]``, or one per token (a start image or keyframe at timestep 0); its
# ``attention_mask`` is the text's, for cross-attention.
LTXV_BLOCK = BlockArgs(None, whole=("txt", "attention_mask", OPTIONS), rows=(FLUX_PE, TokenRows("vec", 1)))
MOCHI_ROPE = tuple(TokenRows(key, 0, IMAGE_STREAM, batched=False) for key in ("rope_cos", "rope_sin"))
# Lumina 2's and HiDream's rotary tables are ``[B, L, 1, D/2, 2, 2]`` over the sequence; the swapped blocks
# (``comfyui_dit_swap``) hand their masks as ``attn_mask``.
SEQUENCE_ROPE = (TokenRows("pe", 1),)

# How each family's blocks hold their tokens:
# - Flux and its descendants (Flux 2, Chroma, Chroma Radiance): double blocks
#   take ``img`` ([image | references]) and ``txt`` apart, single blocks
#   ``[txt | image | references]`` joined; ``pe`` covers ``[txt | img]``.
# - SD3 / SD3.5 (MMDiT): joint blocks take ``img`` (the image alone) and ``txt``
#   ([registers | text]) apart; no ``pe`` (the learned position table is added
#   to the tokens before the blocks, so they carry their positions). SD3.5's
#   image-only second attention (``attn2``) runs on the reduced image too; the
#   last block's text (``pre_only``) comes out as ``None``, as without us.
# - Wan 2.x (t2v, i2v, Fun and Fun Control with their reference frame, VACE with
#   its reference frames, Wan 2.2 TI2V-5B) and Wan 2.2 Animate (its reference
#   frame): ``img`` is the video sequence alone (the text is cross-attention
#   context), ``pe`` is per token of it (``[1, L, 1, D/2, 2, 2]``); TI2V-5B's
#   per-frame modulation (``vec [B, T, 6, C]``) is pooled over frames as the
#   tokens are. VACE's control blocks run between the main blocks on the full
#   video (``x_orig``) and add into the full output, as without us.
# - Qwen-Image: as Flux's double blocks (``img`` [image | edit references],
#   ``txt`` apart, ``pe`` over ``[txt | img]``).
# - HunyuanVideo (and 1.5, HunyuanImage 2.1): Flux's blocks with the text
#   after the image: double blocks take ``img`` ([I2V reference | video]) and
#   ``txt`` apart, single blocks ``[reference | video | text]`` joined; ``pe``
#   and the text-padding mask ``attention_mask`` ``[1, 1, L]`` cover
#   ``[img | txt]``; image to video's first-frame modulation
#   (``modulation_dims``, token ranges) moves to the reduced first frame.
# - LTX-Video: ``img`` is ``[video | keyframe guides]`` (the text is
#   cross-attention context, its ``attention_mask`` the text's), ``pe`` per token
#   of it, ``vec`` per token where a start image or keyframe runs at its own
#   timestep.
# - Mochi: ``img`` (the video) and ``txt`` apart, joint attention over
#   ``[video | text cut to num_tokens]``; its rotary tables ``rope_cos`` and
#   ``rope_sin`` ``[N, heads, D/2]`` cover the video alone.
# - Lumina 2 / Z-Image and HiDream, whose blocks ComfyUI calls without a ``dit``
#   replacement: their blocks' classes are swapped on the patched clone for ones
#   that take the same replacements (``BlockSwap``, ``comfyui_dit_swap``).
#   Lumina's main layers take ``[text | image]`` joined (each padded, Z-Image),
#   HiDream's double-stream blocks the image and its text apart (text after the
#   image), its single-stream blocks ``[image | text]`` joined; their rotary
#   tables ``[B, L, 1, D/2, 2, 2]`` cover the sequence. HiDream E1's image, in
#   rows beside its edit image, runs whole (one warning per run).
#
# The families whose blocks the block scope reaches (names of ``FAMILY_LIST``; a family's variants that are
# families of their own need their own entry), and how.
BLOCK_FAMILIES: dict[str, FamilyBlocks] = {
    FLUX: FamilyBlocks(keys_of("double_blocks", "single_blocks"), {DOUBLE: FLUX_DOUBLE, SINGLE: FLUX_SINGLE}),
    SD3: FamilyBlocks(keys_of("joint_blocks"), {DOUBLE: SD3_JOINT},
                      direct=DirectBlock(lambda net, key: net.joint_blocks[key[1]], run_joint_block)),
    WAN: WAN_BLOCKS,
    WAN_ANIMATE: WAN_BLOCKS,  # its face adapter adds into the full video after a block, as without the block scope
    QWEN_IMAGE: FamilyBlocks(keys_of("transformer_blocks"), {
        DOUBLE: BlockArgs(TEXT_BEFORE, whole=("txt", "vec", OPTIONS), rows=(FLUX_PE,))}),
    HUNYUAN_VIDEO: FamilyBlocks(keys_of("double_blocks", "single_blocks"), {
        DOUBLE: BlockArgs(TEXT_AFTER, whole=("txt", "vec", "modulation_dims_txt", OPTIONS), rows=HUNYUAN_ROWS,
                          ranges=("modulation_dims_img",)),
        SINGLE: BlockArgs(None, whole=("vec", OPTIONS), rows=HUNYUAN_ROWS, ranges=("modulation_dims",))}),
    LTXV: FamilyBlocks(keys_of("transformer_blocks"), {DOUBLE: LTXV_BLOCK}),
    MOCHI: FamilyBlocks(keys_of("blocks"), {DOUBLE: BlockArgs(TEXT_AFTER, whole=("txt", "vec", OPTIONS),
                                                              rows=MOCHI_ROPE, text_crop="num_tokens")}),
    # Lumina 2 / Z-Image: its main layers take [text (+ padding) | image (+ padding)] joined (the refiners, which
    # see the text alone and the image alone, are not blocks of the scope).
    LUMINA2: FamilyBlocks(keys_of("layers"), {DOUBLE: BlockArgs(None, whole=("vec", OPTIONS), rows=SEQUENCE_ROPE,
                                                                masks=("attn_mask",))},
                          BlockSwap(block_paths(double_block="layers"), LuminaBlock)),
    # HiDream: double-stream blocks take the image and the text (T5, the LLM's last and the block's own layer)
    # apart, single-stream blocks [image | text] joined (their ``txt`` is None); E1's image, in rows beside its
    # edit image, runs whole.
    HIDREAM: FamilyBlocks(keys_of("double_stream_blocks", "single_stream_blocks"), {
        DOUBLE: BlockArgs(TEXT_AFTER, whole=("txt", "vec", OPTIONS), rows=SEQUENCE_ROPE, masks=("attn_mask",)),
        SINGLE: BlockArgs(None, whole=("txt", "vec", OPTIONS), rows=SEQUENCE_ROPE, masks=("attn_mask",))},
        BlockSwap(block_paths(double_block="double_stream_blocks", single_block="single_stream_blocks"),
                  HiDreamBlock)),
}
