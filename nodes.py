"""The Apply ToMe and Apply ToDo nodes (ComfyUI's V3 schema): inputs, tooltips, and one call each.

What the nodes do lives in ``tome/hosts/``: ``comfyui_models`` sends each model to its
adapter, ``comfyui_unet`` (SD1.x, SD2.x, SDXL) or ``comfyui_dit`` (SD3.5, Flux / Flux 2 /
Chroma, Wan, Qwen-Image, Lumina 2, HunyuanVideo, LTX-Video, HiDream, Cosmos 1 and Predict2, Mochi); the ranges
both adapters check are in ``comfyui``, the DiT-only ones in ``dit_settings``. Node ids and input names never
change, so saved workflows keep loading; inputs that not every saved graph has are optional, with defaults.
Apply ToDo's ``auto`` method is a choice beside the named ones, so a saved workflow keeps the method it stored.
"""

from __future__ import annotations

import dataclasses

from comfy_api.latest import ComfyExtension, io

from .tome.hosts.comfyui import MAX_FACTOR, MAX_RATIO, MAX_REUSE_STEPS, MAX_STRIDE, MERGE_MODES, MERGE_QKV
from .tome.hosts.comfyui_models import AUTO, METHOD_CHOICES, apply_todo, apply_tome, auto_method_summary
from .tome.hosts.comfyui_unet import DOWNSAMPLE_CHOICES, SCOPE_SELF, SCOPES
from .tome.hosts.dit_settings import DIT_SCOPES, MAX_SKIP_BLOCKS, SCOPE_ATTENTION, SKIP_FIRST_BLOCKS, SKIP_LAST_BLOCKS

CATEGORY = "model_patches/unet"

# Other words people search for. Where io.Schema has search_aliases (newer ComfyUI), ComfyUI sends them in
# /object_info and its frontend's node search matches them; where it has none (0.3.75) they are left out and the
# nodes are found by their ids and display names only, which hold two aliases of each node ("tome" / "todo" and
# the method's full name).
TOME_ALIASES = ["tome", "token merging", "merge tokens", "TomePatchModel", "speed up", "faster"]
TODO_ALIASES = ["todo", "token downsampling", "downsample tokens", "tome", "TomePatchModel", "speed up", "faster"]
HAS_SEARCH_ALIASES = "search_aliases" in {field.name for field in dataclasses.fields(io.Schema)}


def search_aliases(aliases: list[str]) -> dict[str, list[str]]:
    """The search_aliases argument of io.Schema, where this ComfyUI's schema has it."""
    return {"search_aliases": aliases} if HAS_SEARCH_ALIASES else {}


def model_input() -> io.Model.Input:
    return io.Model.Input("model", tooltip="The diffusion model to speed up. It is cloned; the input stays unpatched.")


def max_downsample_input(effect: str) -> io.Combo.Input:
    return io.Combo.Input(
        "max_downsample", options=list(DOWNSAMPLE_CHOICES), default="auto",
        tooltip="Patch the transformer blocks at this downsample factor or finer. auto: the model's "
                "highest-resolution level with transformer blocks (1 on SD1.x/SD2.x, 2 on SDXL). " + effect +
                " No meaning on a DiT (SD3.5, Flux, Wan, Qwen-Image, Lumina 2, HunyuanVideo, LTX-Video, HiDream, "
                "Cosmos, Mochi), whose blocks all work at one "
                "resolution: ignored there.")


def window_inputs(tool: str) -> list[io.Float.Input]:
    return [
        io.Float.Input("start_percent", default=0.0, min=0.0, max=1.0, step=0.01,
                       tooltip=f"Start {tool} at this share of the sampling schedule (0 = first step)."),
        io.Float.Input("end_percent", default=1.0, min=0.0, max=1.0, step=0.01,
                       tooltip=f"Stop {tool} after this share of the sampling schedule (1 = last step). "
                               "Must not be below start_percent."),
    ]


def dit_scope_inputs(reduced: str, change: str) -> list[io.Input]:
    """The block scope's inputs (optional, so graphs without them still validate; absent: the attention scope).
    ``reduced``: what the node does to the image tokens; ``change``: what each token gets."""
    blocks = ("(in the order they run: Flux's, HunyuanVideo's and HiDream's double blocks, then their single "
              f"blocks) run whole at dit_scope 'block'. 0 to {MAX_SKIP_BLOCKS}; Flux has 57 blocks, SD3.5 medium 24, "
              "SD3.5 large 38, Wan 14B 40, Qwen-Image 60, Z-Image 30, HunyuanVideo 60, LTX-Video 2B 28, HiDream 48, "
              "Mochi 48. Default 2: the blocks at either end cost the most to reduce. SD3.5's fast setting spares 3 "
              "at each end of medium's 24. No meaning at dit_scope 'attention' or on U-Nets.")
    return [
        io.Combo.Input("dit_scope", options=list(DIT_SCOPES), default=SCOPE_ATTENTION, optional=True,
                       tooltip="DiTs: where the image tokens are reduced. attention: inside each attention call "
                               "only. block: the whole block (projections, attention and MLP) runs on "
                               f"the {reduced} image tokens; text and reference tokens stay whole, and each image "
                               f"token keeps its own residual and gets {change}. Faster, at more cost in fidelity "
                               "(the recommended settings use it on SD3.5; on Flux every block setting costs more "
                               "than the README allows). A start_percent of about 0.2 keeps the first steps whole "
                               "and the samples nearer. Flux, Flux 2, Chroma, SD3 / SD3.5, Wan 2.x (t2v, i2v, "
                               "Fun, VACE, 2.2 5B, Animate), Qwen-Image, Lumina 2 / Z-Image, HunyuanVideo (and "
                               "1.5, HunyuanImage 2.1), LTX-Video, HiDream and Mochi; other DiTs (Wan 2.2 S2V, "
                               "HuMo, Cosmos) fall back to attention with a warning. Under TeaCache and MagCache "
                               "only block acts (their forwards leave the attention calls out of reach); under "
                               "First Block Cache on SD3.5, HunyuanVideo and LTX-Video only attention. No meaning "
                               "on U-Nets."),
        io.Int.Input("skip_first_blocks", default=SKIP_FIRST_BLOCKS, min=0, max=MAX_SKIP_BLOCKS, optional=True,
                     tooltip="This many of the model's first blocks " + blocks),
        io.Int.Input("skip_last_blocks", default=SKIP_LAST_BLOCKS, min=0, max=MAX_SKIP_BLOCKS, optional=True,
                     tooltip="This many of the model's last blocks " + blocks),
    ]


def tome_inputs() -> list[io.Input]:
    """The inputs of Apply ToMe, which Apply ToMe (Advanced) starts with."""
    return [
        model_input(),
        io.Float.Input("ratio", default=0.5, min=0.0, max=MAX_RATIO, step=0.01,
                       tooltip="Share of tokens merged away before self-attention in the patched blocks. "
                               "0.3 to 0.6 is the useful range: higher is faster and costs more fidelity. "
                               "Capped at 1 - 1/(stride_x*stride_y), 0.75 for 2x2. 0 turns ToMe off."),
        io.Int.Input("stride_x", default=2, min=1, max=MAX_STRIDE,
                     tooltip=f"Width of the cells that each get one destination token (1 to {MAX_STRIDE}). 2 is the "
                             "paper's choice."),
        io.Int.Input("stride_y", default=2, min=1, max=MAX_STRIDE,
                     tooltip=f"Height of the cells that each get one destination token (1 to {MAX_STRIDE}). 2 is the "
                             "paper's choice."),
        max_downsample_input("Larger values merge more blocks: faster, lower fidelity."),
    ]


TOME_DESCRIPTION = ("Token Merging for Stable Diffusion (Bolya & Hoffman 2023): merges similar tokens before "
                    "self-attention and unmerges after, so attention runs on fewer queries, keys and values. "
                    "Works on SD1.x, SD2.x and SDXL, and inside the attention of the DiTs SD3.5, Flux / Flux 2 / "
                    "Chroma, Wan 2.x, Qwen-Image, Lumina 2 / Z-Image, HunyuanVideo, LTX-Video, HiDream, Cosmos "
                    "(1 and Predict2) and Mochi (image tokens only, matched on the keys); reproducible for "
                    "a fixed seed.")


class ApplyToMe(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(node_id="ApplyToMe", display_name="Apply ToMe (Token Merging)", category=CATEGORY,
                         description=TOME_DESCRIPTION, inputs=tome_inputs(), outputs=[io.Model.Output()],
                         **search_aliases(TOME_ALIASES))

    @classmethod
    def execute(cls, model, ratio, stride_x, stride_y, max_downsample) -> io.NodeOutput:
        return io.NodeOutput(apply_tome(model, ratio=ratio, stride_x=stride_x, stride_y=stride_y,
                                        max_downsample=max_downsample))


class ApplyToMeAdvanced(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ApplyToMeAdvanced", display_name="Apply ToMe (Token Merging, Advanced)", category=CATEGORY,
            **search_aliases(TOME_ALIASES),
            description=TOME_DESCRIPTION + (" The advanced node adds the seed, the merge mode, a sampling window, "
                                            "the modules merged (scope), reuse of a matching across steps and "
                                            "across the blocks of a model call, and on DiTs the block scope and "
                                            "its token cache."),
            inputs=[
                *tome_inputs(),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=False,
                             tooltip="Seeds the random choice of destination tokens (mixed with the step and "
                                     "block). Its own generator: the sampler's noise is never affected."),
                io.Boolean.Input("use_rand", default=True,
                                 tooltip="Draw a random destination in each cell (the paper's default). Off: always "
                                         "the top-left token, which can leave grid artifacts at high ratios."),
                io.Combo.Input("merge", options=list(MERGE_MODES), default=MERGE_QKV,
                               tooltip="Which self-attention inputs are merged. 'q, k and v': the paper, fastest. "
                                       "'q only': like ComfyUI's core ToMe node, more fidelity, less speed. "
                                       "'k and v only': queries stay full, nothing to unmerge."),
                *window_inputs("merging"),
                # Optional, so API graphs saved before they existed still validate; absent means the default.
                io.Combo.Input("scope", options=list(SCOPES), default=SCOPE_SELF, optional=True,
                               tooltip="Which modules of a patched block run on the merged tokens. self-attention: "
                                       "the paper's default. Adding cross-attention (its queries) and the MLP is "
                                       "faster, most of all on SDXL with max_downsample 4, at a larger cost in "
                                       "fidelity. U-Nets only: on a DiT, see dit_scope."),
                io.Int.Input("reuse_steps", default=1, min=1, max=MAX_REUSE_STEPS, optional=True,
                             tooltip="How many consecutive sampling steps one matching serves. 1: a fresh matching "
                                     "every step (the paper). Larger values skip the similarity search on the steps "
                                     "between, a small saving, at some cost in fidelity as tokens drift from their "
                                     "match. U-Nets, and DiTs at dit_scope 'block' (each block's matching; no "
                                     "recommended setting uses it: docs/DITS.md \"A matching reused\"). At "
                                     "dit_scope 'attention' every attention call matches afresh (ignored, with a "
                                     "warning)."),
                *dit_scope_inputs("merged", "its merged token's change (matched on the block's input)"),
                io.Boolean.Input("token_cache", default=False, optional=True,
                                 tooltip="DiTs at dit_scope 'block': instead of merging, each reduced block "
                                         "computes 1 - ratio of each frame's image tokens (those whose input moved "
                                         "most since they were last computed, a change 4 steps old first) and "
                                         "every other token keeps its own change from the last step it was "
                                         "computed (token-wise caching, as ToCa). The first 2 steps compute "
                                         "every token. Faster than merging at the same ratio and much nearer the "
                                         "unpatched run, but fewer steps at the same speed still beat it on the "
                                         "judges, so no recommended setting uses it (docs/DITS.md \"Token-wise "
                                         "caching\"). Memory: each reduced block keeps 2 x tokens x width values "
                                         "per batch of conds for the run (Flux at 1024 px, bf16: about 50 MB a "
                                         "block). Strides, seed, use_rand and reuse_steps have no meaning with "
                                         "it. No meaning at dit_scope 'attention' or on U-Nets."),
                io.Boolean.Input("share_matching", default=False, optional=True,
                                 tooltip="One matching per model call: the first merged block (or DiT image "
                                         "attention call) on a token grid finds the similar tokens, and every "
                                         "later block on that grid merges the same ones (ToMA's reuse). Saves "
                                         "most where a forward is short and set by the GPU's host (on an H200, "
                                         "Flux's block-scope ToMe 0.5 went from 1.45x to 1.64x), at a cost in "
                                         "fidelity: the prediction moves 27-37% further on the Flux and SD3.5 "
                                         "judges at dit_scope 'block', 1.3-2.5 times as far on the U-Net and "
                                         "at the attention scope (docs/DITS.md \"A matching reused\"). "
                                         "Off: every block matches afresh (the paper). No meaning with "
                                         "token_cache."),
            ],
            outputs=[io.Model.Output()])

    @classmethod
    def execute(cls, model, ratio, stride_x, stride_y, max_downsample, seed, use_rand, merge, start_percent,
                end_percent, scope=SCOPE_SELF, reuse_steps=1, dit_scope=SCOPE_ATTENTION,
                skip_first_blocks=SKIP_FIRST_BLOCKS, skip_last_blocks=SKIP_LAST_BLOCKS,
                token_cache=False, share_matching=False) -> io.NodeOutput:
        return io.NodeOutput(apply_tome(model, ratio=ratio, stride_x=stride_x, stride_y=stride_y,
                                        max_downsample=max_downsample, seed=seed, use_rand=use_rand, merge=merge,
                                        start_percent=start_percent, end_percent=end_percent, scope=scope,
                                        reuse_steps=reuse_steps, dit_scope=dit_scope,
                                        skip_first_blocks=skip_first_blocks, skip_last_blocks=skip_last_blocks,
                                        token_cache=token_cache, share_matching=share_matching))


class ApplyToDo(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ApplyToDo", display_name="Apply ToDo (Token Downsampling)", category=CATEGORY,
            **search_aliases(TODO_ALIASES),
            description=("Token Downsampling (Smith, Saxena & Saha 2024): self-attention keeps every query and "
                         "attends to keys and values pooled over factor x factor cells of the token grid. No "
                         "similarity search and nothing to unmerge, so its overhead is close to nothing. SD1.x, "
                         "SD2.x and SDXL, and the image self-attention of the DiTs SD3.5, Flux / Flux 2 / Chroma, "
                         "Wan 2.x, Qwen-Image, Lumina 2 / Z-Image, HunyuanVideo, LTX-Video, HiDream, Cosmos "
                         "(1 and Predict2) and Mochi (text and reference tokens stay whole)."),
            inputs=[
                model_input(),
                io.Int.Input("downsample_factor", default=2, min=1, max=MAX_FACTOR,
                             tooltip="Keys and values are pooled over cells of this many tokens a side: 2 leaves a "
                                     "quarter of them, 3 a ninth. 1 turns ToDo off. A block whose token grid is "
                                     "smaller than the factor is left as is."),
                max_downsample_input("Larger values pool in more blocks: faster, lower fidelity."),
                io.Combo.Input("method", options=list(METHOD_CHOICES), default=AUTO,
                               tooltip="How a cell becomes one key/value token. auto: the one the quality bench "
                                       "measured cheaper (nearest and average take the same time): "
                                       + auto_method_summary() + ". nearest: its top-left token (the paper's "
                                       "default); average: the mean of the cell (on a DiT, keys keep their "
                                       "tokens' mean length); max: the maximum of each channel."),
                *window_inputs("downsampling"),
                io.Int.Input("time_factor", default=1, min=1, max=MAX_FACTOR, optional=True,
                             tooltip="Video DiTs (Wan, HunyuanVideo, LTX-Video, Cosmos, Mochi): also pool keys and "
                                     "values over this many frames. 1: frames stay separate. No meaning on images "
                                     "and U-Nets: ignored there."),
                *dit_scope_inputs("pooled", "its cell's change (a cell runs at its first token's position)"),
            ],
            outputs=[io.Model.Output()])

    @classmethod
    def execute(cls, model, downsample_factor, max_downsample, method, start_percent, end_percent,
                time_factor=1, dit_scope=SCOPE_ATTENTION, skip_first_blocks=SKIP_FIRST_BLOCKS,
                skip_last_blocks=SKIP_LAST_BLOCKS) -> io.NodeOutput:
        return io.NodeOutput(apply_todo(model, downsample_factor=downsample_factor, max_downsample=max_downsample,
                                        method=method, start_percent=start_percent, end_percent=end_percent,
                                        time_factor=time_factor, dit_scope=dit_scope,
                                        skip_first_blocks=skip_first_blocks, skip_last_blocks=skip_last_blocks))


class ToMeExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [ApplyToMe, ApplyToMeAdvanced, ApplyToDo]
