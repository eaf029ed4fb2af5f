"""A schedule over the steps at the block scope (issue 44): the ratio a reduced block runs at, set by where the
call's sigma lies in the run, measured by the quality bench, offered by no node.

SDTM (arXiv 2412.10569, on SD3) reduces most while the image's structure forms and less as its detail does: a
ratio that decays over the run. ``Schedule`` gives the block scope's ToMe (merging or its token cache) a ratio
that goes linearly from ``first`` at the start of the schedule to ``last`` at its end, by the percent of the
schedule the call's sigma lies at (the percent ``start_percent`` counts in: the simple scheduler spaces a run's
steps evenly in it), and can leave every ``whole_every``-th step of the run whole (the 5th, the 10th, ...: SDTM's
full step every few). A ratio by noise level and not by step gives a single x0 prediction the ratio a run gives
its step at that noise, and an img2img run only the ratios of the schedule's part it samples.

SDTM's other half, the MLP alone reduced late, is out of the block scope's reach: it runs ComfyUI's blocks whole,
their attention and MLP on the same tokens.

``with_schedule`` gives a model patched with Apply ToMe at the block scope a scope that reads the call's sigma
(the one read of the model call) and its step (``SamplingRun.step``) and reduces each block at the step's ratio.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from dataclasses import dataclass

from tome_harness.block_reuse import with_scope_subclass
from tome_harness.comfyui import pack_module

PERCENTS = 200  # the sigma table's resolution: the percent of a sigma to 0.005


@dataclass(frozen=True)
class Schedule:
    """ToMe's ratio from ``first`` (at the schedule's start) to ``last`` (its end), linear in the percent of the
    schedule; every ``whole_every``-th step of a run whole (0: none)."""

    first: float
    last: float
    whole_every: int = 0

    def __post_init__(self):
        for name in ("first", "last"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"Schedule.{name} must be at least 0 and below 1, not {getattr(self, name)!r}")
        if self.whole_every < 0:
            raise ValueError(f"Schedule.whole_every must be 0 or more, not {self.whole_every!r}")

    def ratio_at(self, percent: float) -> float:
        return self.first + (self.last - self.first) * min(max(percent, 0.0), 1.0)

    def whole_at(self, step: int) -> bool:
        """Whether step ``step`` (0 first) of a run is left whole."""
        return self.whole_every > 0 and step % self.whole_every == self.whole_every - 1

    def ratios(self, steps: int) -> tuple[float | None, ...]:
        """The ratio of each step of a run of ``steps`` from noise with the simple scheduler (step ``i`` at
        ``i / steps`` of the schedule; ``None``: whole), what its speed is taken over."""
        return tuple(None if self.whole_at(i) else self.ratio_at(i / steps) for i in range(steps))


def sigma_table(model_sampling) -> tuple[float, ...]:
    """The sigma at each percent ``0, 1 / PERCENTS, ..., 1`` of ``model_sampling``'s schedule, falling."""
    return tuple(float(model_sampling.percent_to_sigma(i / PERCENTS)) for i in range(PERCENTS + 1))


def percent_of(sigma: float, table: tuple[float, ...]) -> float:
    """Where ``sigma`` lies in the schedule whose ``sigma_table`` is ``table`` (0: its start or above, 1: its end),
    to ``1 / PERCENTS`` below."""
    at_or_above = len(table) - bisect.bisect_left(table[::-1], sigma)  # the table's sigmas at ``sigma`` or above
    return max(at_or_above - 1, 0) / PERCENTS


@functools.cache
def scheduled_scope_class(base: type) -> type:
    """``base`` (the pack's ``BlockScope``, as ComfyUI loaded it) reducing at ``schedule``'s ratio."""
    host = pack_module("tome.hosts.comfyui")

    @dataclasses.dataclass(frozen=True)
    class ScheduledBlockScope(base):
        schedule: Schedule | None = None
        sigmas: tuple[float, ...] = ()  # the model's sigma_table

        def reduction(self, image, layout, key, options):
            sigma, run = host.current_sigma(options), options.get(host.RUN_KEY)
            if self.tome is None or sigma is None:
                return super().reduction(image, layout, key, options)
            step = None if run is None else run.step(options)
            if step is not None and self.schedule.whole_at(step):
                return None
            tome = dataclasses.replace(self.tome, ratio=self.schedule.ratio_at(percent_of(sigma, self.sigmas)))
            return base.reduction(dataclasses.replace(self, tome=tome), image, layout, key, options)

    return ScheduledBlockScope


def with_schedule(model, schedule: Schedule):
    """A clone of ``model`` (Apply ToMe at the block scope) whose reduced blocks run at ``schedule``'s ratio. A model
    whose Apply ToMe reduces no block is returned as it is."""
    sigmas = sigma_table(model.get_model_object("model_sampling"))
    return with_scope_subclass(model, scheduled_scope_class, schedule=schedule, sigmas=sigmas)
