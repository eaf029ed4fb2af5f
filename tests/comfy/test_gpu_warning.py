"""The GPU rule's warning at the start of a real sampling run (the rule itself: tests/tome/test_gpu_rule.py).

There is no GPU here and no CUDA tensor is faked: the run's start reads the device of the guider's model (its
``load_device``, the CPU here), the latent's shape and whether ComfyUI's compile wrapper is on, and hands them to
the model's ``GpuUse``. On the CPU nothing is logged. To see the line a CUDA run gets, once per run, the tests
put on the run's start a ``GpuUse`` of the same settings that records what the run handed it and answers as the
rule answers for ``cuda`` at that size: the host's side (ComfyUI, the sampler, the wrapper) is all real.
"""

import dataclasses
import logging

import pytest
from helpers import LATENT, dit_sample, sample

from tome_harness import comfyui as comfyui_host
from tome_harness import dit_models

GPU_LINE = "on a GPU"


@pytest.fixture(scope="module")
def rule(comfy_nodes):
    """``tome.hosts.gpu_rule``, as ComfyUI imported it."""
    return comfyui_host.pack_module("tome.hosts.gpu_rule")


@pytest.fixture(scope="module")
def flux(comfy_nodes):
    return dit_models.build_dit_model("flux")


def run_start(model):
    """The model's ``outer_sample`` wrapper under our key (``comfyui.StartRun``), or ``None``."""
    starts = model.get_wrappers("outer_sample", "tome")
    assert len(starts) <= 1
    return starts[0] if starts else None


def as_on_a_gpu(rule, model):
    """A clone of ``model`` whose run start asks, for the same settings, what the rule answers for ``cuda``; and
    the list of what each run's start handed it (device type, latent shape, compiled)."""
    start = run_start(model)

    @dataclasses.dataclass(frozen=True)
    class OnAGpu(rule.GpuUse):
        seen: list = dataclasses.field(default_factory=list, compare=False)

        def warning(self, device_type, latent_shape, compiled=False):
            self.seen.append((device_type, tuple(latent_shape), compiled))
            return super().warning("cuda", latent_shape, compiled)

    spy = OnAGpu(start.gpu_use.family, start.gpu_use.settings, start.gpu_use.patch)
    clone = model.clone()
    clone.remove_wrappers_with_key("outer_sample", "tome")
    clone.add_wrapper_with_key("outer_sample", "tome", dataclasses.replace(start, gpu_use=spy))
    return clone, spy.seen


def gpu_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if GPU_LINE in r.getMessage() and r.levelno == logging.WARNING]


def test_the_unet_adapter_hands_the_run_start_what_its_patches_do(pack, rule, sd15, sdxl):
    tome_self = rule.Setting(rule.TOME, rule.SELF_ATTENTION)
    todo = rule.Setting(rule.TODO, rule.SELF_ATTENTION)
    tome = pack.unet.apply_tome(sd15, ratio=0.5)
    assert run_start(tome).gpu_use == rule.GpuUse(rule.SD15, (tome_self,))
    both = pack.unet.apply_todo(tome, downsample_factor=2)
    assert run_start(both).gpu_use == rule.GpuUse(rule.SD15, (tome_self, todo))
    # SD1.5's ToDo gained at every size measured: nothing for a run's start to do once ToMe is gone.
    assert run_start(pack.unet.apply_tome(both, ratio=0.0)) is None
    assert run_start(pack.unet.apply_todo(sd15, downsample_factor=2)) is None
    kept = run_start(pack.unet.apply_todo(pack.unet.apply_tome(sd15, ratio=0.5, reuse_steps=2), downsample_factor=2))
    assert kept.keeps_plans and kept.gpu_use.settings == (tome_self, todo)
    wide = pack.unet.apply_tome(sdxl, ratio=0.5, scope="self-attention, cross-attention and MLP", max_downsample="4")
    assert run_start(wide).gpu_use == rule.GpuUse(rule.SDXL, (rule.Setting(rule.TOME, rule.WIDER),))
    assert run_start(pack.unet.apply_todo(sdxl, downsample_factor=2)).gpu_use.settings == (todo,)


def test_a_unet_run_on_the_cpu_logs_no_gpu_warning(pack, comfy_nodes, sd15, caplog):
    with caplog.at_level(logging.WARNING):
        sample(comfy_nodes, pack.unet.apply_todo(pack.unet.apply_tome(sd15, ratio=0.5), downsample_factor=2))
    assert gpu_lines(caplog) == []


def test_a_unet_run_the_rule_judges_on_cuda_warns_once_per_run(pack, rule, comfy_nodes, sd15, caplog):
    model, seen = as_on_a_gpu(rule, pack.unet.apply_tome(sd15, ratio=0.5))
    with caplog.at_level(logging.WARNING):
        sample(comfy_nodes, model)
        sample(comfy_nodes, model)
    assert seen == [("cpu", (1, 4, 16, 16), False)] * 2  # the guider's load device, the KSampler's latent
    expected = rule.gpu_warning("cuda", 16 * 16, rule.SD15, [rule.Setting(rule.TOME, rule.SELF_ATTENTION)])
    assert "0.87x the speed of no patch on SD1.5 at 512 px" in expected
    assert gpu_lines(caplog) == [expected] * 2  # four steps of cond and uncond: one line per run


def test_the_dit_adapter_hands_the_run_start_what_its_settings_do(pack, rule, flux):
    tome = pack.dit.apply_tome_dit(flux, ratio=0.5)
    assert run_start(tome).gpu_use == rule.GpuUse("flux", (rule.Setting(rule.TOME, "attention"),), (1, 2, 2))
    both = pack.dit.apply_todo_dit(tome, downsample_factor=2, dit_scope="block", skip_first_blocks=0,
                                   skip_last_blocks=0)
    assert run_start(both).gpu_use.settings == (rule.Setting(rule.TODO, "block"), rule.Setting(rule.TOME, "attention"))
    assert run_start(both).scopes == ("attention", "block")
    # Flux gained with ToDo at both scopes, and the token cache was not timed on a GPU: nothing to warn of.
    assert run_start(pack.dit.apply_todo_dit(flux, downsample_factor=2)).gpu_use is None
    cached = pack.models.apply_tome(flux, ratio=0.5, dit_scope="block", skip_first_blocks=0, skip_last_blocks=0,
                                    token_cache=True)
    assert run_start(cached).keeps_plans and run_start(cached).gpu_use is None


def test_a_dit_run_warns_once_per_run_where_the_rule_answers_for_cuda_and_never_on_the_cpu(pack, rule, comfy_nodes,
                                                                                          flux, caplog):
    patched = pack.dit.apply_tome_dit(flux, ratio=0.5)
    with caplog.at_level(logging.WARNING):
        dit_sample(comfy_nodes, patched, "flux")
    assert gpu_lines(caplog) == []
    model, seen = as_on_a_gpu(rule, patched)
    with caplog.at_level(logging.WARNING):
        dit_sample(comfy_nodes, model, "flux")
        dit_sample(comfy_nodes, model, "flux")
    assert seen == [("cpu", LATENT, False)] * 2
    expected = rule.gpu_warning("cuda", 5 * 6, "flux", [rule.Setting(rule.TOME, "attention")])
    assert "Apply ToMe at dit_scope 'attention' ran at 0.84x the speed of no patch on Flux at 1024 px" in expected
    assert gpu_lines(caplog) == [expected] * 2


@pytest.mark.slow  # compiles, as tests/comfy/test_compile.py does
def test_the_run_start_sees_comfyuis_compile_wrapper(pack, rule, comfy_nodes, caplog):
    """Under ``TorchCompileModel`` the run's start reads the compiled rows: SD3.5 medium's ToDo 2 at the
    attention scope gained uncompiled and lost compiled."""
    import torch
    from comfy_extras.nodes_torch_compile import TorchCompileModel

    sd3 = dit_models.build_dit_model("sd3")
    model, seen = as_on_a_gpu(rule, pack.dit.apply_todo_dit(sd3, downsample_factor=2))
    torch._dynamo.reset()
    try:
        compiled = TorchCompileModel.execute(model, "eager").result[0]
        with caplog.at_level(logging.WARNING):
            dit_sample(comfy_nodes, compiled, "sd3", steps=1)
    finally:
        torch._dynamo.reset()
    assert seen == [("cpu", LATENT, True)]
    assert len(gpu_lines(caplog)) == 1 and "under torch.compile ran at 0.96x" in gpu_lines(caplog)[0]
