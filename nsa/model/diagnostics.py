"""What an NSA layer measures besides its output, kept apart from the layer's math: the running gate and
selection statistics (:mod:`nsa.model.stats`), the selection probe and the scorer loss
(:mod:`nsa.model.selection`).

:class:`LayerDiagnostics` is a plain object that the layer owns (``NSAAttention.diag``), not a module: none of
its tensors is in ``state_dict`` or broadcast by DDP (rank 0's running sums must not overwrite the others').
Its tensors exist from construction and follow the layer's ``.to()``/``.cuda()`` (the layer's ``_apply`` calls
:meth:`LayerDiagnostics.follow`), so a compiled forward never meets them missing or on another device (each
would be a guard failure and a recompilation).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from nsa.model.selection import (
    AttachLoss,
    align_loss,
    block_mass,
    block_scores,
    compressed_probs,
    dense_block_mass,
    layer_report,
    merge_reports,
    probe_positions,
    probe_range,
    scorer_kl,
)
from nsa.model.stats import ALIGN, N_FIELDS, SCORER, gate_sums, loss_sums, selection_sums, summarise
from nsa.ops import NSAParams

if TYPE_CHECKING:
    from nsa.config import ScorerConfig


@dataclass(frozen=True)
class ScorerParams:
    """The scorer and alignment losses of an NSA layer as one frozen object (like
    :class:`nsa.model.gates.GateParams`), given to the layer at construction: ``queries`` positions per
    training forward (0: off, nothing computed), the scorer loss's ``weight``, what it trains (``into``:
    ``query_and_keys``; ``keys``, the compressed keys alone; ``weights``, the layer's own weights from its
    detached input) and the alignment loss's weight ``align`` (0: off). The default: both off."""

    queries: int = 0
    weight: float = 0.0
    into: str = "query_and_keys"
    align: float = 0.0

    @classmethod
    def of_config(cls, scorer: ScorerConfig, accum: int = 1) -> ScorerParams:
        """The losses of a ``scorer`` config section as a training step runs them: query positions (0 when
        both losses are off), each weight divided by the micro-batches of a step (``accum``; each
        micro-batch's losses are means, so the step's add up to the whole batch's, as the language loss
        does)."""
        return cls(scorer.queries if scorer.active else 0, scorer.weight / accum, scorer.into,
                   scorer.align / accum)


class LayerDiagnostics:
    """Statistics, probe and scorer loss of one NSA layer (``hp``, softmax ``scale``, ``collapse_threshold``:
    the layer's).

    - Statistics: every training forward adds its gate and selection sums to ``acc`` (float64, no host
      sync); :meth:`take_sums` reads and zeroes it, :meth:`suppress` pauses it (checkpoint recomputes).
    - Probe: after :meth:`arm_probe` the next forward records :func:`nsa.model.selection.layer_report`;
      :meth:`take_probe` returns it.
    - Scorer loss: with ``scorer_queries > 0`` every training forward computes
      :func:`nsa.model.selection.scorer_kl` on that many query positions and adds ``scorer_weight * loss`` to
      the backward pass (not to the reported loss). ``scorer_weight`` is a tensor filled in place, so a
      schedule changes it without recompiling. With ``align_weight > 0`` the same positions also add
      :func:`nsa.model.selection.align_loss` (dense attention drawn into the selected blocks) times it.
    """

    def __init__(self, hp: NSAParams, scale: float, collapse_threshold: float,
                 scorer: ScorerParams | None = None) -> None:
        self.hp, self.scale, self.collapse_threshold = hp, scale, collapse_threshold
        self.acc = torch.zeros(N_FIELDS, dtype=torch.float64)  # nsa.model.stats.FIELDS
        self.suppressed = False
        self.scorer_weight = torch.tensor(0.0)
        self.align_weight = torch.tensor(0.0)
        self.set_scorer(scorer or ScorerParams())
        self.probe_queries = 0  # > 0 once armed: the next forward records layer_report in probe_out
        self.probe_out: dict[str, Any] | None = None
        # a packed forward's reports per document, and lengths
        self._parts: list[tuple[dict[str, Any], int]] = []

    def follow(self, device: torch.device, dtype: torch.dtype) -> None:
        """After the layer's ``.to()``/``.cuda()``/``.double()``: running sums zeroed on ``device`` (float64),
        ``scorer_weight`` on ``device`` in ``dtype`` (as a floating buffer of the layer would be)."""
        self.acc = torch.zeros(N_FIELDS, dtype=torch.float64, device=device)
        self.scorer_weight = torch.tensor(self._weight, dtype=dtype, device=device)
        self.align_weight = torch.tensor(self._align, dtype=dtype, device=device)

    # ------------------------------------------------------------------------------------------
    # the layer's forward calls these

    @torch.no_grad()
    def count(self, field: int, mean: torch.Tensor, share: float = 1.0) -> None:
        """One forward's auxiliary loss (a mean, ``share`` of the forward) into the running sums at ``field``
        (:data:`nsa.model.stats.SCORER` or :data:`~nsa.model.stats.ALIGN`); nothing while suppressed."""
        if not self.suppressed:
            self.acc[field:field + 2].add_(loss_sums(mean, share))

    def whole_sequence_only(self) -> bool:
        """The probe or the scorer's KL is on: neither runs under context parallelism (the alignment loss
        does:
        :meth:`align_part`)."""
        return self.probe_queries > 0 or (self.scorer_queries > 0 and self._weight > 0)

    def aligns(self) -> bool:
        """Whether a training forward now computes the alignment loss."""
        return self.scores() and self._align > 0

    def align_part(self, q: torch.Tensor, k_sel: torch.Tensor, block_idx: torch.Tensor, q_start: int,
                   probes: range, weight: float = 1.0) -> torch.Tensor | None:
        """Under context parallelism: the alignment loss's part from the probe positions ``probes`` (of a
        whole sequence, or of one document: :func:`nsa.model.selection.probe_range` of its length) that fall
        among the query rows ``q`` (positions ``q_start ..`` of the keys ``k_sel``, which start at position 0;
        selection
        ``block_idx`` of those rows): their mean times their share of ``probes`` times ``weight`` (a
        document's share of the forward's tokens), so the parts add up to the whole forward's loss (float32 at
        least;
        ``None`` when no position falls here)."""
        mine = [t for t in probes if q_start <= t < q_start + q.shape[1]]
        if not mine:
            return None
        ts = torch.tensor(mine, device=q.device)
        mean = align_loss(block_mass(q, k_sel, ts, self.hp, self.scale, q_start), block_idx[:, ts - q_start])
        share = weight * len(mine) / len(probes)
        self.count(ALIGN, mean, share)
        return mean * share

    def align_documents(self, q: torch.Tensor, k_sel: torch.Tensor, block_idx: torch.Tensor, q_start: int,
                        spans: list[tuple[int, int, int]], tokens: int) -> torch.Tensor | None:
        """:meth:`align_part` over packed documents: the query rows ``q`` at ``q_start ..`` of the batch's
        rows (``block_idx`` in each document's own positions), for each document of ``spans``
        (:func:`nsa.model.documents.chunk_spans`) long enough to choose, its probe positions against its own
        keys of ``k_sel`` (the whole batch's), weighted by its share of the batch's ``tokens`` as in the whole
        model's packed forward. ``None`` when none of them falls here."""
        stop = q_start + q.shape[1]
        parts = []
        for b, s0, length in spans:
            probes = probe_range(length, self.hp, self.scorer_queries)
            part = None if probes is None else self.align_part(q[b:b + 1], k_sel[b:b + 1, s0:stop],
                                                               block_idx[b:b + 1], q_start - s0, probes,
                                                               length / tokens)
            if part is not None:
                parts.append(part)
        return torch.stack(parts).sum() if parts else None

    def attach_align(self, o: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        """``o`` carrying ``align_weight * total`` into the backward (``total``: the parts of
        :meth:`align_part`; a context-parallel rank passes their sum times the group's size, as its language
        loss is the mean of its own rows)."""
        return AttachLoss.apply(o, total * self.align_weight)

    def observe(self, q: torch.Tensor, k_sel: torch.Tensor, k_cmp: torch.Tensor, gates: torch.Tensor,
                block_idx: torch.Tensor, o: torch.Tensor, collect: bool,
                scorer: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One forward's probe, statistics and scorer loss (``collect``: a training forward); returns ``o``,
        carrying the scorer loss into the backward when it is on. ``scorer``: the scorer's own ``(q, k_cmp)``
        (the same values from a detached input) when not the attention's."""
        if self.probe_queries > 0:
            self.probe_out = layer_report(q, k_sel, k_cmp, block_idx, gates, self.hp, self.scale,
                                          self.probe_queries)
        if collect:
            self.accumulate(gates, block_idx)
            sq, skc = scorer or (q, k_cmp)
            o = self.scorer_loss(sq, k_sel, skc, o, q, block_idx)
        return o

    def probe_document(self, q: torch.Tensor, k_sel: torch.Tensor, k_cmp: torch.Tensor,
                       block_idx: torch.Tensor, gates: torch.Tensor) -> None:
        """The probe on one document of a packed forward (a batch of one, unpadded), kept for
        :meth:`end_documents`."""
        self._parts.append((layer_report(q, k_sel, k_cmp, block_idx, gates, self.hp, self.scale,
                                         self.probe_queries), q.shape[1]))

    def end_documents(self) -> None:
        """The packed forward's report: its documents' (:func:`nsa.model.selection.merge_reports`)."""
        self.probe_out, self._parts = merge_reports(self._parts), []

    @torch.no_grad()
    def accumulate(self, gates: torch.Tensor, block_idx: torch.Tensor) -> None:
        if self.suppressed:
            return
        add = torch.cat([gate_sums(gates, self.collapse_threshold), selection_sums(block_idx, self.hp.l_sel)])
        if self.acc.device != add.device:  # a module used on a device it was not moved to
            self.acc = torch.zeros(N_FIELDS, dtype=torch.float64, device=add.device)
        # in place: torch.compile keeps one graph (the auxiliary losses' fields come after: count)
        self.acc[: add.numel()].add_(add)

    def scores(self) -> bool:
        """Whether a training forward now computes the scorer loss."""
        return self.scorer_queries > 0 and torch.is_grad_enabled()

    def scorer_loss(self, q: torch.Tensor, k_sel: torch.Tensor, k_cmp: torch.Tensor, o: torch.Tensor,
                    q_att: torch.Tensor, block_idx: torch.Tensor, share: float = 1.0) -> torch.Tensor:
        """``o``, carrying ``share * (scorer_weight * scorer_kl + align_weight * align_loss)`` into the
        backward (training forwards with ``scorer_queries > 0`` and gradients on). ``q``/``k_cmp``: the
        scorer's;
        ``q_att``/``k_sel``: the attention's own, which the alignment loss trains; ``block_idx``: the
        forward's selection. ``share``: the part of the forward's tokens ``q`` holds (one document of a packed
        forward, a batch of one: the documents' losses add up as one forward's)."""
        S = q.shape[1]
        ts = probe_positions(S, self.hp, self.scorer_queries, q.device)
        if ts is None or not torch.is_grad_enabled():
            return o
        loss = q.new_zeros((), dtype=torch.float32)
        mass = None
        if self._align > 0:
            mass = block_mass(q_att, k_sel, ts, self.hp, self.scale)
            nll = align_loss(mass, block_idx[:, ts])
            self.count(ALIGN, nll, share)
            loss = loss + self.align_weight * nll
        if self._weight > 0:
            # the scorer's target: the alignment loss's mass when both read the attention's query
            target = mass.detach() if mass is not None and q is q_att else dense_block_mass(q, k_sel, ts,
                self.hp,
                                                                                             self.scale)
            probs, _ = compressed_probs(q.detach() if self.scorer_into == "keys" else q, k_cmp, ts, S,
                                        self.hp, self.scale)
            kl = scorer_kl(target, block_scores(probs, ts, S, self.hp))
            self.count(SCORER, kl, share)
            loss = loss + kl * self.scorer_weight
        return AttachLoss.apply(o, loss * share)

    # ------------------------------------------------------------------------------------------
    # the language model drives these

    def set_scorer(self, scorer: ScorerParams) -> None:
        """The losses of :class:`ScorerParams` from now on (the layer's, given at construction; a schedule
        switches them off: ``scorer.until``)."""
        self.scorer = scorer
        self.scorer_queries, self.scorer_into = int(scorer.queries), scorer.into
        # scorer_weight's value on the host: a move rebuilds the tensor from it
        self._weight = float(scorer.weight)
        self._align = float(scorer.align)  # align_weight's value on the host
        self.scorer_weight.fill_(self._weight)
        self.align_weight.fill_(self._align)

    def arm_probe(self, queries: int) -> None:
        """The next forward records :func:`nsa.model.selection.layer_report` on ``queries`` positions."""
        self.probe_queries, self.probe_out = int(queries), None

    def take_probe(self) -> dict[str, Any]:
        """The recorded report (empty if no forward ran), disarmed; over packed documents, theirs merged."""
        out, self.probe_out, self.probe_queries = self.probe_out or {}, None, 0
        return out

    def take_sums(self) -> torch.Tensor:
        """A copy of the running sums (zeros when no training forward ran since the last call), then zero them
        in place. No host sync."""
        out = self.acc.clone()
        self.acc.zero_()
        return out

    def consume(self) -> dict[str, float | list[float]]:
        """Gate entropy, branch shares, collapse fraction, mean gates, ``sel_keys_mean``; one transfer."""
        return summarise(self.take_sums().tolist())

    @contextlib.contextmanager
    def suppress(self) -> Iterator[None]:
        """No statistics inside (the recompute pass of gradient checkpointing: the same computation, the
        scorer loss included, counted once)."""
        old, self.suppressed = self.suppressed, True
        try:
            yield
        finally:
            self.suppressed = old
