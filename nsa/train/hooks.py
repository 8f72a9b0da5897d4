"""Named hooks of the training loop: what only some runs do, kept out of ``Trainer._train`` and ``_step``.

A hook sees each step at three points: :meth:`StepHook.on_step_start` before its micro-batches,
:meth:`StepHook.on_micro_batch` after each micro-batch's backward, and :meth:`StepHook.step_sums`, device
values summed over the ranks in the step's one all-reduce, whose totals :meth:`StepHook.log_fields` turns
into telemetry fields (``training.csv``, the heartbeat's ``progress``, TensorBoard ``train/<field>``).
The session registers the hooks its config asks for (:func:`step_hooks`).
"""

from __future__ import annotations

from typing import Any

import torch

from nsa.config import RunConfig
from nsa.model.diagnostics import ScorerParams


class StepHook:
    """A hook's protocol; each point does nothing unless overridden."""

    def on_step_start(self, step: int) -> None:
        """Step ``step`` (1-based) is about to run."""

    def on_micro_batch(self, out: Any, y: torch.Tensor) -> None:
        """A micro-batch's forward and backward ran: the model's output ``out`` (``LMOutput``) for targets
        ``y``."""

    def step_sums(self) -> list[torch.Tensor]:
        """This step's 0-d device values, each summed over the ranks (no host sync of its own)."""
        return []

    def log_fields(self, totals: list[float]) -> dict[str, float]:
        """Telemetry fields of this step from the totals over ranks of :meth:`step_sums`."""
        return {}


class ScorerWarmup(StepHook):
    """``scorer.until``: the scorer (and alignment) loss trains steps ``1 .. until``, then is switched off for
    good (also on a resume past it)."""

    def __init__(self, model: Any, until: int) -> None:
        self.model = model
        self.until: int | None = until

    def on_step_start(self, step: int) -> None:
        if self.until is not None and step > self.until:  # the scorer's warm-up is over
            self.model.set_scorer(ScorerParams())
            self.until = None


class AnswerMetrics(StepHook):
    """A synthetic task's answers (``mask [S]``: where the targets hold one): the mean cross-entropy and the
    accuracy of the predictions there, as ``answer_loss`` and ``answer_acc`` (over all ranks' answers)."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask
        self.sums = torch.zeros(3, device=mask.device)

    def on_step_start(self, step: int) -> None:
        self.sums = torch.zeros(3, device=self.mask.device)  # answer loss and hits summed, answers

    def on_micro_batch(self, out: Any, y: torch.Tensor) -> None:
        self.sums += answer_scores(out.logits.detach(), y, self.mask)

    def step_sums(self) -> list[torch.Tensor]:
        return list(self.sums)

    def log_fields(self, totals: list[float]) -> dict[str, float]:
        loss, hits, n = totals
        return {"answer_loss": loss / max(n, 1), "answer_acc": hits / max(n, 1)}


def answer_scores(logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[cross-entropy summed, hits, answers]`` of the predictions at a synthetic task's answer positions
    (sums, so ranks holding different numbers of answers combine exactly; none: zeros)."""
    picked, want = logits[:, mask].float(), y[:, mask]
    loss = torch.nn.functional.cross_entropy(picked.reshape(-1, picked.shape[-1]), want.reshape(-1),
                                             reduction="sum")
    hits = (picked.argmax(-1) == want).float().sum()
    return torch.stack([loss, hits, torch.tensor(float(want.numel()), device=logits.device)])


class StepHooks:
    """The hooks of a session, called in the order they were registered."""

    def __init__(self, hooks: list[StepHook]) -> None:
        self.hooks = hooks
        self._counts: list[int] = []

    def on_step_start(self, step: int) -> None:
        for h in self.hooks:
            h.on_step_start(step)

    def on_micro_batch(self, out: Any, y: torch.Tensor) -> None:
        for h in self.hooks:
            h.on_micro_batch(out, y)

    def step_sums(self) -> list[torch.Tensor]:
        """Every hook's step values, one after another (:meth:`log_fields` splits their totals again)."""
        per_hook = [h.step_sums() for h in self.hooks]
        self._counts = [len(v) for v in per_hook]
        return [t for v in per_hook for t in v]

    def log_fields(self, totals: list[float]) -> dict[str, float]:
        fields: dict[str, float] = {}
        start = 0
        for h, n in zip(self.hooks, self._counts, strict=True):
            fields.update(h.log_fields(totals[start:start + n]))
            start += n
        return fields


def step_hooks(cfg: RunConfig, model: Any, answer_mask: torch.Tensor | None) -> StepHooks:
    """The hooks ``cfg`` asks for: the scorer's warm-up (a scorer or alignment loss with ``scorer.until``) on
    ``model`` (unwrapped), the answer metrics of a synthetic task (``answer_mask``: on the run's device)."""
    hooks: list[StepHook] = []
    if cfg.scorer.active and cfg.scorer.until is not None:
        hooks.append(ScorerWarmup(model, cfg.scorer.until))
    if answer_mask is not None:
        hooks.append(AnswerMetrics(answer_mask))
    return StepHooks(hooks)
