"""What the ComfyUI of late 2026 does differently from the 0.3.75 host, emulated on it for tests.

Read from ComfyUI's own source (the newest host cannot be installed here):

- ``ModelPatcher.clone()`` copies ``model_options`` with ``deepcopy_list_dict``: dicts and lists are copied,
  every other object in them is shared, so a model and its clones call the same patch objects
  (``clones_share_patch_objects``);
- the MultiGPU CFG split runs cond and uncond as separate batches in worker threads at the same time, each on
  the model copy of its device (``cfg_in_threads``; ``device_copy`` makes such a copy: a second model object
  with the same options and object patches, as ``clone(model_override=...)`` does);
- ``TorchCompileModel`` compiles with ``options={"guard_filter_fn": skip_torch_compile_dict}``, which drops every
  dynamo guard whose name holds ``transformer_options`` (``compile_like_newest``): what a compiled graph read
  from there is not checked again on later calls.
"""

from __future__ import annotations

import contextlib
import copy
import threading


def copy_lists_and_dicts(value):
    """``comfy.utils.deepcopy_list_dict``: copies of dicts and lists, all the way down; other objects shared."""
    if isinstance(value, dict):
        return {key: copy_lists_and_dicts(item) for key, item in value.items()}
    if isinstance(value, list):
        return [copy_lists_and_dicts(item) for item in value]
    return value


@contextlib.contextmanager
def clones_share_patch_objects():
    """``ModelPatcher.clone()`` as ComfyUI does it since February 2026: patch objects shared, not deep-copied."""
    import comfy.model_patcher

    original = comfy.model_patcher.ModelPatcher.clone

    def clone(self, *args, **kwargs):
        cloned = original(self, *args, **kwargs)
        cloned.model_options = copy_lists_and_dicts(self.model_options)
        return cloned

    comfy.model_patcher.ModelPatcher.clone = clone
    try:
        yield
    finally:
        comfy.model_patcher.ModelPatcher.clone = original


@contextlib.contextmanager
def cfg_in_threads(threaded: bool = True):
    """Every sampler step runs each cond (cond, uncond) as its own batch; with ``threaded``, all of them at once
    in worker threads that start together, as the MultiGPU CFG split does; without, one after the other (the
    sequential reference, same batches)."""
    import comfy.samplers

    original = comfy.samplers._calc_cond_batch_outer

    def split(model, conds, x_in, timestep, model_options):
        results = [None] * len(conds)
        start = threading.Barrier(len(conds))
        errors = []

        def run(i):
            try:
                if threaded:
                    start.wait()
                results[i] = original(model, [conds[i]], x_in, timestep, model_options)[0]
            except BaseException as error:  # re-raised in the sampler's thread below
                errors.append(error)

        if threaded:
            threads = [threading.Thread(target=run, args=(i,)) for i in range(len(conds))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        else:
            for i in range(len(conds)):
                run(i)
        if errors:
            raise errors[0]
        return results

    comfy.samplers._calc_cond_batch_outer = split
    try:
        yield
    finally:
        comfy.samplers._calc_cond_batch_outer = original


def device_copy(model, weight_scale: float = 1.0):
    """A MultiGPU copy of ``model`` (a ``ModelPatcher``): a clone around its own deep copy of the model, with the
    same options and object patches; ``weight_scale`` makes its weights differ, so a test sees whose run."""
    import comfy.model_management
    import torch

    comfy.model_management.unload_all_models()  # copy the model at rest, not with a loaded clone's patches on it
    copy_ = model.clone()
    copy_.model = copy.deepcopy(model.model)
    copy_.backup, copy_.object_patches_backup = {}, {}  # its own model: its own originals to restore
    # A fresh model, not loaded anywhere yet: the deep copy must not inherit the load state of the original.
    copy_.model.current_patcher = None
    copy_.model.current_weight_patches_uuid = None
    copy_.model.model_loaded_weight_memory = 0
    with torch.no_grad():
        for parameter in copy_.model.diffusion_model.parameters():
            parameter.mul_(weight_scale)
    return copy_


def skip_transformer_options_guards(guard_entries):
    """``comfy_extras.nodes_torch_compile.skip_torch_compile_dict``: keep every guard but those on
    ``transformer_options``."""
    return ["transformer_options" not in entry.name for entry in guard_entries]


def compile_like_newest(model, backend: str = "inductor"):
    """``TorchCompileModel`` of late 2026 on ``model`` (a ``ModelPatcher``): a clone whose diffusion model is
    compiled through ComfyUI's own ``set_torch_compile_wrapper``, with the newest host's guard filter."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    compiled = model.clone()
    set_torch_compile_wrapper(model=compiled, backend=backend,
                              options={"guard_filter_fn": skip_transformer_options_guards})
    return compiled
