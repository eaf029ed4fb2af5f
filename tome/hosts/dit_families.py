"""The DiT families of ``comfyui_dit``: how each is recognised, and where its image (video) tokens sit.

A family is one ``Family`` in ``FAMILY_LIST``: the class names it is known by
(of ComfyUI's ``model_base`` class or of its diffusion model), how its patch
size is read from the diffusion model, and its layout: from the latent's shape,
the text length and the conds of one model call, an ``ImageLayout`` (the grid
in patches, and where the image starts in each self-attention sequence that
holds it). Every token a layout does not place in the image (text, registers,
reference, edit, guide frames, padding) is left whole by the override. Adding a
family touches this module, its tests and its example workflow; the machinery
(the override, the wrappers, registration) is ``comfyui_dit``'s.

Each layout is written from the family's own code in ComfyUI (``comfy/ldm/<family>/``): the token order
its blocks build, read from shapes alone. No ComfyUI import.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

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
