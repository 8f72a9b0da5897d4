"""Quality benchmark: NSA recipes against dense attention on the same data, tokens, model and seeds.

Each *arm* is the base run config plus a few overrides (:data:`ARMS`, or ``label=key=value;key=value``).
Per arm and seed, :func:`run_text_arm` trains with the real trainer (``nsa.train.Trainer``, the
config's data, held-out evaluation at the end) into ``out_dir/<arm>/seed<N>`` and reports the final
held-out loss and, for NSA, the selection diagnostics of the trained model on a held-out batch
(:meth:`nsa.model.lm.NSALM.selection_report`: recall, compressed entropy, gates per layer).
Arms with warm phases first train a share of the steps in each with the phase's own settings, every arm
seeing the same number of tokens: the length curricula ``dense-curriculum`` / ``nsa-curriculum`` (the same
model on windows 4x shorter, as many more per batch, then the full length) and ``dense-ladder`` /
``nsa-ladder`` (two steps: windows 16x, then 4x shorter, a quarter of the steps each; ``*-ladder-half``: half
the steps at 16x shorter) are one run each (``train.stop_at``, then a resume at the next length);
``dense-warm`` (the dense model first, then NSA) and the ``restart`` controls (``dense-phases``,
``*-ladder-restart``) start each phase as a run of its own from the last one's weights (``train.init_from``).
The held-out loss comes with its split by position in the window (``loss_by_position``,
:func:`nsa.eval.tasks.eval_loss`) and by window length (``loss_by_context``).
:func:`run_needle_arm` trains the same arm on single-needle retrieval (``nsa.bench.retrieval``) and
reports the accuracy curve and the first step at 50%.
"""

from __future__ import annotations

import csv
import io
import math
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from nsa.bench import fanout
from nsa.bench.progress import Eta
from nsa.bench.retrieval import RetrievalRecipe, learn_retrieval
from nsa.config import ResolvedConfig, load_run_config, parse_set
from nsa.data.retrieval import RetrievalTask
from nsa.data.tokenizers import get_tokenizer
from nsa.errors import ConfigError
from nsa.eval.tasks import eval_loss, eval_selection
from nsa.model.load import load_model
from nsa.rundir import RunDir
from nsa.rundir.records import SELECTION_FIELDS, Metrics
from nsa.train.events import PlainReporter
from nsa.train.trainer import Trainer


@dataclass(frozen=True)
class Arm:
    """A recipe: ``sets`` on top of the base config. ``warm``: phases before it, in order, each ``(share of
    the steps, window divisor)``: that share with windows that many times shorter (as many more per batch:
    the same tokens per step). The phases of one model are one run (``train.stop_at``, then a resume at the
    next length: one optimizer, one learning-rate schedule, the data read on); ``restart`` (and a phase of
    another model, ``warm_sets`` on top) makes each phase a run of its own from the last one's weights
    (fresh optimizer, schedule and data)."""

    name: str
    sets: tuple[str, ...] = ()
    warm: tuple[tuple[float, int], ...] = ()
    warm_sets: tuple[str, ...] = ()
    restart: bool = False

    @property
    def dense(self) -> bool:
        return "model.attention=dense" in self.sets

    def at_lr(self, lr: float) -> Arm:
        """This recipe at learning rate ``lr``, named ``<arm>@lr=<lr>`` (both phases of a warm start)."""
        return replace(self, name=f"{self.name}{LR_TAG}{lr:g}", sets=(*self.sets, f"optimizer.lr={lr:g}"))


LR_TAG = "@lr="  # an arm's name at one learning rate of a sweep: <arm>@lr=<lr>


ARMS: dict[str, Arm] = {
    "dense": Arm("dense", ("model.attention=dense",)),
    "nsa": Arm("nsa", ("model.attention=nsa",)),  # the config's stack (m7c-125m: the hybrid)
    "nsa-all": Arm("nsa-all", ("model.attention=nsa", "model.dense_layers=[]")),  # every block NSA
    # every other block dense
    "nsa-hybrid": Arm("nsa-hybrid", ("model.attention=nsa", "model.dense_layers=even")),
    # NSA in every third block
    "nsa-thirds": Arm("nsa-thirds", ("model.attention=nsa", "model.dense_layers=thirds")),
                        "nsa-half": Arm("nsa-half", ("model.attention=nsa", "nsa.gate_init=half")),
    "nsa-window": Arm("nsa-window", ("model.attention=nsa", "nsa.gate_init=window")),
    "nsa-uniform": Arm("nsa-uniform", ("model.attention=nsa", "nsa.gate_init=uniform")),
    "nsa-scorer": Arm("nsa-scorer", ("model.attention=nsa", "scorer.weight=0.1")),
    "dense-warm": Arm("dense-warm", ("model.attention=nsa",), warm=((0.25, 1),),
                      warm_sets=("model.attention=dense",)),
    "dense-curriculum": Arm("dense-curriculum", ("model.attention=dense",), warm=((0.25, 4),)),
    "nsa-curriculum": Arm("nsa-curriculum", ("model.attention=nsa",), warm=((0.25, 4),)),
    # two steps up to long windows (32k: a quarter of the steps at 2k, a quarter at 8k, then 32k)
    "dense-ladder": Arm("dense-ladder", ("model.attention=dense",), warm=((0.25, 16), (0.25, 4))),
    "nsa-ladder": Arm("nsa-ladder", ("model.attention=nsa",), warm=((0.25, 16), (0.25, 4))),
    # the same steps, longer at the short windows (32k: half the steps at 2k, a quarter at 8k, a quarter at
    # 32k)
    "dense-ladder-half": Arm("dense-ladder-half", ("model.attention=dense",), warm=((0.5, 16), (0.25, 4))),
    "nsa-ladder-half": Arm("nsa-ladder-half", ("model.attention=nsa",), warm=((0.5, 16), (0.25, 4))),
    # the ladder's phases as three runs (restarted schedule, optimizer and data) at one window length, and
    # the ladder so (how the rows before 2026-11-27 were measured): controls of the restarts' cost
    "dense-phases": Arm("dense-phases", ("model.attention=dense",), warm=((0.25, 1), (0.25, 1)),
                        restart=True),
    "dense-ladder-restart": Arm("dense-ladder-restart", ("model.attention=dense",),
                                warm=((0.25, 16), (0.25, 4)), restart=True),
    "nsa-ladder-restart": Arm("nsa-ladder-restart", ("model.attention=nsa",), warm=((0.25, 16), (0.25, 4)),
                              restart=True),
}


def parse_arm(text: str) -> Arm:
    """A name of :data:`ARMS`, or ``label=key=value;key=value`` (NSA plus those overrides), or
    ``label=<arm>;key=value;...`` (that arm of :data:`ARMS`, its curriculum or warm start kept, plus them)."""
    if text in ARMS:
        return ARMS[text]
    label, sep, rest = text.partition("=")
    if not sep or not label or not rest:
        raise ConfigError(f"arm {text!r} is neither one of {', '.join(ARMS)} nor label=key=value;key=value",
                          hint="e.g. --arms dense,nsa,'lr3=optimizer.lr=3e-3',"
                               "'nsa-curriculum-kl=nsa-curriculum;scorer.weight=0.1'")
    sets = tuple(s for s in rest.split(";") if s)
    base = ARMS.get(sets[0]) if sets else None
    for s in sets[1:] if base is not None else sets:
        parse_set(s)
    if base is not None:
        return replace(base, name=label, sets=(*base.sets, *sets[1:]))
    return Arm(label, ("model.attention=nsa", *sets))


@dataclass
class QualityRow:
    """One arm and seed: held-out loss, selection per layer, needle accuracy, the training-loss curve, wall
    time."""

    arm: str
    seed: int
    val_loss: float | None = None
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    recall_mean: float | None = None
    recall_min: float | None = None
    # recall's ceiling: a perfect block scorer's (selection.best_recall)
    recall_best_mean: float | None = None
    cmp_entropy_mean: float | None = None
    selection: list[dict[str, Any]] = field(default_factory=list)
    needle_acc: float | None = None
    needle_steps_to_target: int | None = None
    needle_curve: list[tuple[int, float]] = field(default_factory=list)
    loss_curve: list[tuple[int, float]] = field(default_factory=list)  # (step, training loss) at log steps
    loss_by_position: list[dict[str, Any]] = field(default_factory=list)  # held-out loss per window range
    loss_by_context: list[dict[str, Any]] = field(default_factory=list)  # the same tokens in shorter windows
    status: str = "completed"
    budget: str = "tokens"  # "tokens": every arm the same steps; "time": the same GPU time (BUDGETS)
    step_ms: float | None = None  # the arm's step as probed alone on its GPU (probe_step_ms; time budgets)

    @property
    def gpu_seconds(self) -> float | None:
        """``steps x step_ms``: the GPU time the budget gave this run (None without a probed step)."""
        return None if self.step_ms is None else self.steps * self.step_ms / 1e3

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gpu_seconds": self.gpu_seconds}

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> QualityRow:
        """A row as :meth:`to_dict` saved it (its derived ``gpu_seconds`` left out)."""
        return cls(**{k: v for k, v in saved.items() if k != "gpu_seconds"})


def loss_curve(run_dir: Path, offset: int = 0) -> list[tuple[int, float]]:
    """``(step + offset, loss)`` of a run's ``training.csv`` (its log steps)."""
    path = RunDir(run_dir).train_csv
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return [(int(r["step"]) + offset, float(r["loss"])) for r in csv.DictReader(f) if r.get("loss")]


def _resolve(config: str, sets: list[str]) -> ResolvedConfig:
    return load_run_config(config=config, sets=sets)


def _quiet_train(resolved: ResolvedConfig, log: Callable[[str], None] | None) -> Metrics:
    """Train ``resolved`` (its lines to ``log``, or nowhere) and return ``metrics.json``'s content."""
    buf = io.StringIO()
    result = Trainer(resolved, reporter=PlainReporter(buf)).fit()
    if log is not None:
        for line in buf.getvalue().splitlines():
            log(line)
    paused = result.status == "halted" and result.halted_by == "stop_at"  # a phase of a length curriculum
    if result.status != "completed" and not paused:
        raise ConfigError(f"arm run {resolved.config.train.out_dir} ended {result.status}: "
                          f"{result.metrics.get('error')}", hint="see its run directory")
    return result.metrics


# the final model also read with windows this many times shorter, on the same tokens
SHORTER_CONTEXTS = (16, 4)


@dataclass
class FinalMeasures:
    """A finished run's model on held-out batches: selection per layer (empty for dense), the loss by position
    in its training window, and the loss on the same tokens read in shorter windows (does context help?)."""

    selection: list[dict[str, Any]]
    loss_by_position: list[dict[str, Any]]
    # [{"context", "loss", "n"}], shortest first, the training length last
    loss_by_context: list[dict[str, Any]]


def final_measures(run_dir: Path, queries: int = 64, batches: int = 1) -> FinalMeasures:
    """A finished run's model at its training length S on ``batches`` held-out batches: the selection
    diagnostics per layer (``nsa eval --task selection``; empty for a dense model) and the held-out loss by
    position in the window (``nsa eval --task loss``); and the loss of the same held-out tokens read in
    windows of S/16 and S/4 (as many more per batch, the same number of scored tokens; a window reads one
    token more than it scores, so the tokens agree to within one per window), which tells a model that is
    worse from one that is hurt by its long context."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    loaded = load_model(run_dir, device=device)
    cfg = loaded.config
    tok = get_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)
    S, bs = cfg.train.seq_len, cfg.train.batch_size
    shorter = [S // d for d in SHORTER_CONTEXTS if S % d == 0 and S // d >= 64]
    by_context = []
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
        for c in shorter:
            (short,) = eval_loss(loaded.model, cfg, tok, [c], batches, batch_size=bs * (S // c),
                                 device=device)
            by_context.append({"context": c, "loss": short["loss"], "n": short["n"]})
        (loss,) = eval_loss(loaded.model, cfg, tok, [S], batches, batch_size=bs, device=device)
        by_context.append({"context": S, "loss": loss["loss"], "n": loss["n"]})
        if cfg.model.attention != "nsa":
            return FinalMeasures([], loss["by_position"], by_context)
        rows = eval_selection(loaded.model, cfg, tok, [S], batches, queries=queries, batch_size=bs,
                              device=device)
    selection = [{k: r[k] for k in ("layer", *SELECTION_FIELDS, "gates")} for r in rows]
    return FinalMeasures(selection, loss["by_position"], by_context)


def _shorter_windows(arm: Arm, train: Any, div: int) -> list[str]:
    """The overrides of a warm phase ``div`` times shorter: windows that much shorter, as many more per batch
    (the same tokens per step); none for ``div`` 1. ``ConfigError`` when ``train.seq_len`` does not split
    so."""
    if div <= 1:
        return []
    if train.seq_len % div:
        raise ConfigError(f"arm {arm.name}: train.seq_len={train.seq_len} does not split into {div} windows",
                          hint="pick a seq_len divisible by it")
    return [f"train.seq_len={train.seq_len // div}", f"train.batch_size={train.batch_size * div}"]


def run_text_arm(config: str, base_sets: list[str], arm: Arm, seed: int, out_dir: Path, *, steps: int,
                 queries: int = 64, log: Callable[[str], None] | None = None,
                 budget: str = "tokens") -> QualityRow:
    """Train ``arm`` for ``steps`` (one seed) into ``out_dir/<arm>/seed<seed>`` and measure it. The run is
    named ``<arm>-seed<seed>`` (a restarted phase ``<arm>-warm-seed<seed>``, ``<arm>-warm2-seed<seed>``, ...),
    so reports and charts of several runs tell them apart; a run of the equal-time budget is
    ``time-seed<seed>``."""
    tag = f"seed{seed}" if budget == "tokens" else f"{budget}-seed{seed}"
    run_dir = out_dir / arm.name / tag
    if run_dir.exists():
        shutil.rmtree(run_dir)
    common = [*base_sets, f"train.seed={seed}", "checkpoint.every=0", "train.resume=null"]
    row = QualityRow(arm.name, seed, steps=steps, budget=budget)
    train = _resolve(config, [*common, *arm.sets]).config.train if arm.warm else None
    restart = arm.restart or bool(arm.warm_sets)
    phases: list[list[str]] = []  # each phase's sets
    done = 0
    for i, (frac, div) in enumerate(arm.warm):
        phase_steps = max(1, round(steps * frac))
        shorter = _shorter_windows(arm, train, div) if train is not None else []
        part = "warm" if i == 0 else f"warm{i + 1}"
        if restart:
            phases.append([*arm.warm_sets, *shorter, f"train.steps={phase_steps}",
                           f"train.out_dir={run_dir / part}", f"train.run_name={arm.name}-{part}-{tag}"])
        else:
            phases.append([*shorter, f"train.steps={steps}", f"train.stop_at={done + phase_steps}"])
        done += phase_steps
    if steps - done < 1:
        raise ConfigError(f"arm {arm.name}: its warm phases take all {steps} steps", hint="raise --steps")
    main_dir = run_dir / "main" if restart and arm.warm else run_dir
    main = [f"train.steps={steps - done if restart else steps}",
            f"eval.every={steps - done if restart else steps}"]
    if restart:
        main.append(f"train.out_dir={main_dir}")
    seconds, at, tokens = 0.0, 0, 0
    before: Path | None = None  # the last phase's run directory
    for sets in [*([*p, "eval.every=0"] for p in phases), main]:
        if restart:  # from the last phase's weights
            start = [f"train.init_from={before}"] if before else []
        else:  # the same run directory, resumed
            start = [f"train.out_dir={run_dir}"] + (["train.resume=auto"] if before else [])
        resolved = _resolve(config, [*common, *arm.sets, f"train.run_name={arm.name}-{tag}", *sets, *start])
        m = _quiet_train(resolved, log)
        before = Path(resolved.config.train.out_dir)
        if restart:  # each phase its own run: its own clock, tokens and loss curve
            seconds += float(m.get("elapsed_s") or 0.0)
            tokens += int(m.get("tokens_seen") or 0)
            row.loss_curve += loss_curve(before, offset=at)
            at += resolved.config.train.steps
    if not restart:  # one run: its clock, tokens and curve span every phase
        seconds, tokens = float(m.get("elapsed_s") or 0.0), int(m.get("tokens_seen") or 0)
        row.loss_curve = loss_curve(run_dir, offset=0)
    row.val_loss = m.get("last_val_loss")
    row.tokens, row.seconds = tokens, seconds
    measures = final_measures(main_dir, queries, batches=resolved.config.eval.batches)
    row.selection, row.loss_by_position = measures.selection, measures.loss_by_position
    row.loss_by_context = measures.loss_by_context
    if row.selection:
        recalls = [r["recall"] for r in row.selection if r.get("recall") is not None]
        ents = [r["cmp_entropy"] for r in row.selection if r.get("cmp_entropy") is not None]
        row.recall_mean = sum(recalls) / len(recalls) if recalls else None
        row.recall_min = min(recalls) if recalls else None
        best = [r["recall_best"] for r in row.selection if r.get("recall_best") is not None]
        row.recall_best_mean = sum(best) / len(best) if best else None
        row.cmp_entropy_mean = sum(ents) / len(ents) if ents else None
    return row


def run_needle_arm(config: str, base_sets: list[str], arm: Arm, seed: int, *, seq_len: int, gap: int,
                   recipe: RetrievalRecipe, device: str | None = None, backend: str | None = None,
                   log: Callable[[str], None] | None = None) -> QualityRow:
    """Single-needle retrieval from scratch (``nsa.bench.retrieval``) with ``arm``'s model, gates and scorer
    loss; an arm with a warm phase trains without it here (the needle task has its own length)."""
    cfg = _resolve(config, [*base_sets, *arm.sets]).config
    task = RetrievalTask(seq_len, gap, vocab_size=cfg.model.vocab_size)

    def show(p: Any) -> None:
        if log is not None:
            log(f"{arm.name} seed {seed} step {p.step}: loss {p.loss:.3f} acc {p.accuracy:.3f} gates "
                f"{p.gates}")

    variant = "dense" if arm.dense else "nsa"
    curve = learn_retrieval(cfg.model, cfg.nsa, task, variant, recipe=recipe, seed=seed, device=device,
                            backend=backend, on_point=show, scorer=cfg.scorer)
    row = QualityRow(arm.name, seed, steps=recipe.steps)
    row.needle_acc = curve.final_accuracy
    row.needle_steps_to_target = curve.steps_to_target
    row.needle_curve = [(p.step, p.accuracy) for p in curve.points]
    row.seconds = curve.points[-1].seconds if curve.points else 0.0
    return row


def relative_to_dense(rows: list[QualityRow]) -> dict[str, float | None]:
    """Mean held-out loss of each arm over its seeds, relative to its dense arm's mean (:func:`baseline_of`;
    +0.036 = 3.6% worse; 0.0 for the dense arms themselves)."""
    by: dict[str, list[float]] = {}
    for r in rows:
        if r.val_loss is not None and math.isfinite(r.val_loss):
            by.setdefault(r.arm, []).append(r.val_loss)
    means = {a: sum(v) / len(v) for a, v in by.items()}
    names = set(means)
    out: dict[str, float | None] = {}
    for a, m in means.items():
        if _is_baseline(a, names):
            out[a] = 0.0
            continue
        base = baseline_of(a, names)
        out[a] = m / means[base] - 1.0 if base is not None and means[base] else None
    return out


def baseline_of(arm: str, names: set[str]) -> str | None:
    """The dense arm ``arm`` is compared with among ``names``: ``dense-<recipe>`` for ``nsa-<recipe>[-more]``
    where both ran (a length curriculum against dense under the same curriculum), else ``dense``, else the one
    other ``dense-*`` arm when just one ran; at one learning rate of a sweep, the baseline at the same rate.
    ``None`` when no such arm ran or ``arm`` is it."""
    base, tag, lr = arm.partition(LR_TAG)
    suffix = tag + lr
    parts = base[4:].split("-") if base.startswith("nsa-") else []
    for n in range(len(parts), 0, -1):  # nsa-curriculum-kl: dense-curriculum-kl, then dense-curriculum
        twin = "-".join(["dense", *parts[:n]]) + suffix
        if twin in names:
            return twin
    choice = f"dense{suffix}"
    if choice in names:
        return choice if choice != arm else None
    # no plain dense arm: the one other dense recipe that ran (dense-curriculum, the 8k baseline), if just one
    # did
    others = [n for n in names if n != arm and n.startswith("dense") and n.partition(LR_TAG)[1:] == (tag, lr)]
    return others[0] if len(others) == 1 else None


def _is_baseline(arm: str, names: set[str]) -> bool:
    return arm.partition(LR_TAG)[0] == "dense" or any(baseline_of(a, names) == arm for a in names)


@dataclass
class ArmSummary:
    """An arm's held-out loss over its seeds against dense attention's, paired by seed."""

    arm: str
    seeds: int
    mean: float
    sd: float | None  # sample standard deviation over the seeds (None with one seed)
    vs_dense: float | None = None  # mean over the shared seeds of (arm / dense - 1)
    vs_dense_sd: float | None = None  # its spread over those seeds
    paired_seeds: int = 0
    # arm / baseline - 1 on each shared seed, seeds ascending
    per_seed: list[float] = field(default_factory=list)
    baseline: str | None = None  # the dense arm it was paired with (:func:`baseline_of`)
    reading: str = ""  # "better", "worse", "within noise", "one seed", "dense" or "no dense arm"


def _sd(values: list[float]) -> float | None:
    if len(values) < 2:
        return None
    m = sum(values) / len(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def summarise_arms(rows: list[QualityRow]) -> list[ArmSummary]:
    """Mean and spread of each arm's held-out loss, and its difference from dense paired by seed (the dense
    arm of :func:`baseline_of`: ``dense-curriculum`` for ``nsa-curriculum``). The reading
    is "within noise" when the mean difference is no larger than the differences' spread over the seeds
    (one standard deviation): two seeds that disagree in sign cannot tell +1% from -1%."""
    by = _losses_by_seed(rows)
    names = set(by)
    out = []
    for arm, losses in by.items():
        base = baseline_of(arm, names)
        if _is_baseline(arm, names):
            s = _paired(arm, losses, None, {})
            s.reading = "dense"
        else:
            s = _paired(arm, losses, base, by[base] if base is not None else {})
        out.append(s)
    return out


def against(rows: list[QualityRow], baseline: str) -> list[ArmSummary]:
    """Every other arm of ``rows`` against ``baseline`` (one of them: any arm, dense or not), paired by seed,
    read as :func:`summarise_arms` reads an arm against dense. ``ValueError`` when ``baseline`` has no
    rows."""
    by = _losses_by_seed(rows)
    if baseline not in by:
        raise ValueError(f"no arm {baseline!r} among {', '.join(sorted(by))}")
    return [_paired(arm, losses, baseline, by[baseline], missing="no shared seed")
            for arm, losses in by.items() if arm != baseline]


def _losses_by_seed(rows: list[QualityRow]) -> dict[str, dict[int, float]]:
    by: dict[str, dict[int, float]] = {}
    for r in rows:
        if r.val_loss is not None and math.isfinite(r.val_loss):
            by.setdefault(r.arm, {})[r.seed] = r.val_loss
    return by


def _paired(arm: str, losses: dict[int, float], base: str | None, base_losses: dict[int, float],
            missing: str = "no dense arm") -> ArmSummary:
    """``arm``'s mean and spread, and its difference from ``base`` over the seeds both ran, with its reading
    (``missing`` when they share none)."""
    vals = list(losses.values())
    s = ArmSummary(arm, len(vals), sum(vals) / len(vals), _sd(vals))
    shared = sorted(set(losses) & set(base_losses))
    if not shared:
        s.reading = missing
        return s
    s.baseline = base
    diffs = [losses[k] / base_losses[k] - 1.0 for k in shared]
    s.vs_dense, s.vs_dense_sd, s.paired_seeds, s.per_seed = (sum(diffs) / len(diffs), _sd(diffs), len(shared),
                                                             diffs)
    if s.vs_dense_sd is None:
        s.reading = "one seed"
    elif abs(s.vs_dense) <= s.vs_dense_sd:
        s.reading = "within noise"
    else:
        s.reading = "better" if s.vs_dense < 0 else "worse"
    return s


def at_best_lr(rows: list[QualityRow]) -> tuple[list[QualityRow], dict[str, dict[str, Any]]]:
    """A learning-rate sweep read arm by arm: each arm's rows at its best rate (the lowest mean held-out
    loss over the seeds), renamed to the arm, and per arm ``{"best_lr", "mean_by_lr", "edge"}`` (``edge``:
    ``"lowest"``/``"highest"`` when the best rate is the sweep's smallest/largest of three or more, so the
    optimum may lie beyond it; else ``None``); rows outside a sweep pass through as they are."""
    means: dict[str, dict[float, list[float]]] = {}
    for r in rows:
        base, tag, lr = r.arm.partition(LR_TAG)
        if tag and r.val_loss is not None and math.isfinite(r.val_loss):
            means.setdefault(base, {}).setdefault(float(lr), []).append(r.val_loss)
    sweep: dict[str, dict[str, Any]] = {}
    for base, by_lr in means.items():
        mean_by_lr = {lr: sum(v) / len(v) for lr, v in sorted(by_lr.items())}
        best = min(mean_by_lr, key=lambda lr: mean_by_lr[lr])
        lrs = list(mean_by_lr)
        edge = (None if len(lrs) < 3 else "lowest" if best == lrs[0] else "highest" if best == lrs[-1]
                else None)
        sweep[base] = {"best_lr": best, "mean_by_lr": mean_by_lr, "edge": edge}
    out = []
    for r in rows:
        base, tag, lr = r.arm.partition(LR_TAG)
        if not tag:
            out.append(r)
        elif base in sweep and float(lr) == sweep[base]["best_lr"]:
            out.append(replace(r, arm=base))
    return out, sweep


BUDGETS = ("tokens", "time", "both")  # every arm the same steps; the same GPU time; both sets of runs


@dataclass(frozen=True)
class Run:
    """One training run of a benchmark: an arm (at one rate of a sweep), a seed, its steps and its budget."""

    seed: int
    arm: Arm
    steps: int
    budget: str = "tokens"


@dataclass
class QualitySpec:
    """One ``nsa bench quality``: every arm of ``arms`` trained once per seed on ``task`` (``text``: held-out
    loss and selection over ``steps``; ``needle``: single-needle retrieval; ``both``).

    ``budget`` (text only): ``tokens`` gives every arm ``steps``; ``time`` gives every arm the GPU time the
    reference arm (``time_reference``, else the slowest) spends on ``steps``: ``steps x its step time / the
    arm's`` steps, each arm's step time probed alone on its GPU first (``step_ms``, :func:`probe_step_ms`);
    ``both`` runs the two sets (the reference's equal-time run is its equal-token run)."""

    config: str
    sets: list[str]
    arms: list[Arm]
    seeds: list[int]
    steps: int
    out_dir: Path
    task: str = "text"
    queries: int = 64
    needle_seq_len: int = 2048
    needle_gap: int = 600
    needle_steps: int = 5000
    needle_batch: int = 16
    needle_eval_samples: int = 256
    device: str | None = None  # the needle runs' device (None: CUDA when available)
    # a learning-rate sweep: every arm at each (empty: the config's)
    lrs: list[float] = field(default_factory=list)
    parallel: int = 1  # runs at once, dealt over the GPUs (CPU: a share of the cores each)
    # arms every other arm is also read against, paired by seed
    against: list[str] = field(default_factory=list)
    budget: str = "tokens"
    time_reference: str | None = None  # the arm whose GPU time every arm gets (None: the slowest)
    step_ms: dict[str, float] = field(default_factory=dict)  # each arm's probed step (ms), by arm name
    probe_steps: int = 10  # timed steps of each probe

    def budgets(self) -> list[str]:
        return ["tokens", "time"] if self.budget == "both" else [self.budget]

    def reference(self) -> str:
        """The arm whose GPU time an equal-time run gets: ``time_reference``, else the slowest probed arm."""
        if self.time_reference is not None:
            return self.time_reference
        if not self.step_ms:
            raise ValueError("no step times probed yet")
        return max(self.step_ms, key=lambda a: self.step_ms[a])

    def time_steps(self) -> dict[str, int]:
        """Each arm's steps at equal GPU time: the reference's ``steps`` scaled by its step time over the
        arm's."""
        ref = self.step_ms[self.reference()]
        return {a: max(1, round(self.steps * ref / ms)) for a, ms in self.step_ms.items()}

    def runs(self) -> list[Run]:
        """Every training run, equal-token runs first; an equal-time run of the reference arm is left out
        under
        ``both`` (its equal-token run is the same run)."""
        out: list[Run] = []
        for budget in self.budgets():
            steps = self.time_steps() if budget == "time" else {}
            for seed in self.seeds:
                for arm in self.arms:
                    if budget == "time" and self.budget == "both" and arm.name == self.reference():
                        continue
                    n = steps.get(arm.name, self.steps)
                    for a in [arm.at_lr(lr) for lr in self.lrs] if self.lrs else [arm]:
                        out.append(Run(seed, a, n, budget))
        return out

    def steps_per_run(self) -> int:
        return (self.steps if self.task in ("text", "both") else 0) + (
            self.needle_steps if self.task in ("needle", "both") else 0)


def arm_phases(config: str, sets: list[str], arm: Arm) -> list[tuple[float, list[str]]]:
    """``(share of the steps, overrides)`` of each phase of ``arm``, the last phase (its own length) last:
    what its step costs is the shares' mean of the phases' steps."""
    train = _resolve(config, [*sets, *arm.sets]).config.train
    out: list[tuple[float, list[str]]] = []
    for frac, div in arm.warm:
        out.append((frac, [*arm.sets, *arm.warm_sets, *_shorter_windows(arm, train, div)]))
    out.append((1.0 - sum(f for f, _ in out), list(arm.sets)))
    return out


def _probe(config: str, sets: list[str], steps: int) -> float:
    """One phase's step (ms): the trainer's step (``nsa.bench.train.bench_train_step``) at the config's length
    and batch, compiled as the config says, timed in this process's turn on its GPU."""
    from nsa.bench.timing import device_turn
    from nsa.bench.train import bench_train_step

    cfg = _resolve(config, sets).config
    row = bench_train_step(cfg, attention=cfg.model.attention, seq_len=cfg.train.seq_len,
                           batch_size=cfg.train.batch_size, steps=steps, warmup=3, hold=device_turn)
    if row.error:
        raise ConfigError(f"probing {' '.join(sets)}: {row.error}", hint="lower train.batch_size")
    return row.step_ms


def probe_step_ms(spec: QualitySpec, tell: Callable[[str], None] | None = None) -> dict[str, float]:
    """Each arm's step time (ms; a warm arm's the mean over its phases by their shares), every phase probed in
    a process of its own, ``spec.parallel`` at a time: they compile side by side and time one at a time per
    GPU (:func:`nsa.bench.timing.device_turn`), so no probe shares its GPU with another's timing."""
    phases = {a.name: arm_phases(spec.config, spec.sets, a) for a in spec.arms}
    jobs: list[tuple[str, ...]] = []
    for parts in phases.values():
        for _, sets in parts:
            if tuple(sets) not in jobs:
                jobs.append(tuple(sets))
    times = fanout.spread(_probe, [(spec.config, [*spec.sets, *j], spec.probe_steps) for j in jobs],
                          max(1, min(spec.parallel, len(jobs))), on_start=tell)
    ms = dict(zip(jobs, times, strict=True))
    return {name: sum(frac * ms[tuple(sets)] for frac, sets in parts) for name, parts in phases.items()}


def _one_run(spec: QualitySpec, run: Run, log: Callable[[str], None] | None) -> QualityRow:
    """One run of ``spec``: its text run, needle run, or both in one row."""
    seed, arm = run.seed, run.arm
    row: QualityRow | None = None
    if spec.task in ("text", "both"):
        row = run_text_arm(spec.config, spec.sets, arm, seed, spec.out_dir, steps=run.steps,
                           queries=spec.queries, log=log, budget=run.budget)
        row.step_ms = spec.step_ms.get(arm.name.partition(LR_TAG)[0])
    if spec.task in ("needle", "both"):
        device = spec.device or ("cuda" if torch.cuda.is_available() else "cpu")
        recipe = RetrievalRecipe(steps=spec.needle_steps, batch_size=spec.needle_batch,
                                 eval_every=max(1, spec.needle_steps // 20),
                                 eval_samples=spec.needle_eval_samples)
        needle = run_needle_arm(spec.config, spec.sets, arm, seed, seq_len=spec.needle_seq_len,
                                gap=spec.needle_gap, recipe=recipe, device=device,
                                backend="torch" if device == "cpu" else None, log=log)
        if row is None:
            return needle
        row.needle_acc, row.needle_steps_to_target = needle.needle_acc, needle.needle_steps_to_target
        row.needle_curve = needle.needle_curve
    assert row is not None
    return row


def _describe(spec: QualitySpec, run: Run) -> str:
    what = []
    if spec.task in ("text", "both"):
        what.append(f"text, {run.steps} steps" + (" (equal GPU time)" if run.budget == "time" else ""))
    if spec.task in ("needle", "both"):
        what.append(f"needle S={spec.needle_seq_len} gap {spec.needle_gap}, {spec.needle_steps} steps")
    return f"{run.arm.name} seed {run.seed}: {'; '.join(what)}"


def _reference_copies(spec: QualitySpec, rows: list[QualityRow]) -> list[QualityRow]:
    """Under ``both``: the reference arm's equal-token rows again as its equal-time rows (the same runs)."""
    if spec.budget != "both":
        return []
    ref = spec.reference()
    return [replace(r, budget="time") for r in rows if r.budget == "tokens" and r.arm.partition(LR_TAG)[0]
            == ref]


def run_quality(spec: QualitySpec, say: Callable[[str], None] | None = None,
                log: Callable[[str], None] | None = None,
                on_row: Callable[[QualityRow], None] | None = None) -> list[QualityRow]:
    """Train every arm and seed of ``spec`` and measure them (one row per run, in ``spec.runs()`` order; under
    ``budget="both"`` the reference arm's equal-time rows, copies of its equal-token ones, last). ``say``
    hears a line per run with the benchmark's progress and ETA; ``log`` the trainers' lines; ``on_row`` each
    row as its run ends (so a sweep cut short keeps what finished). A time budget probes each arm's step first
    (:func:`probe_step_ms`) unless ``spec.step_ms`` holds them. ``spec.parallel > 1``: that many runs at once
    (:func:`run_parallel`)."""
    tell = say or (lambda _line: None)
    if spec.budget != "tokens" and not spec.step_ms:
        if spec.task != "text":
            raise ConfigError(f"--budget {spec.budget} applies to the text task, not {spec.task}",
                              hint="pass --task text, or --budget tokens")
        spec.step_ms = probe_step_ms(spec, tell)
        steps = spec.time_steps()
        for a in spec.arms:
            tell(f"{a.name}: step {spec.step_ms[a.name]:.1f} ms probed alone; {steps[a.name]} steps at equal "
                 f"GPU time (reference {spec.reference()}: {spec.steps} steps)")
    runs = spec.runs()
    if spec.parallel > 1 and len(runs) > 1:
        rows = run_parallel(spec, tell, log, on_row)
    else:
        total = sum(r.steps for r in runs) if spec.task == "text" else len(runs) * spec.steps_per_run()
        eta = Eta(total)
        rows, done = [], 0
        for i, run in enumerate(runs):
            tell(f"{_describe(spec, run)} [run {i + 1}/{len(runs)}, {eta.line(done)}]")
            rows.append(_one_run(spec, run, log))
            done += run.steps if spec.task == "text" else spec.steps_per_run()
            if on_row is not None:
                on_row(rows[-1])
    copies = _reference_copies(spec, rows)
    for r in copies:
        if on_row is not None:
            on_row(r)
    return rows + copies


def _work(spec: QualitySpec, run: Run) -> tuple[QualityRow, list[str]]:
    """One run in a worker process: its row and its trainers' lines."""
    lines: list[str] = []
    return _one_run(spec, run, lines.append), lines


def run_parallel(spec: QualitySpec, tell: Callable[[str], None], log: Callable[[str], None] | None,
                 on_row: Callable[[QualityRow], None] | None = None) -> list[QualityRow]:
    """``spec.parallel`` runs at once (:func:`nsa.bench.fanout.spread`: each in a process of its own, dealt
    over the GPUs); each run's lines reach ``log`` and its row ``on_row`` when it ends. The same runs, seeds
    and rows as one after another, in the same order."""
    runs = spec.runs()
    eta = Eta(len(runs))
    finished = 0

    def done(i: int, result: tuple[QualityRow, list[str]]) -> None:
        nonlocal finished
        finished += 1
        row, lines = result
        if log is not None:
            for line in lines:
                log(line)
        tell(f"{_describe(spec, runs[i])}: done in {row.seconds:.0f} s [{finished}/{len(runs)} runs, "
             f"{eta.line(finished)}]")
        if on_row is not None:
            on_row(row)

    results = fanout.spread(_work, [(spec, run) for run in runs], spec.parallel, on_start=tell, on_done=done)
    return [row for row, _ in results]


def of_budget(rows: list[QualityRow], budget: str) -> list[QualityRow]:
    """The rows of one budget (``tokens`` or ``time``)."""
    return [r for r in rows if r.budget == budget]


def _summaries(spec: QualitySpec, rows: list[QualityRow]) -> dict[str, Any]:
    """The readings of one budget's rows: against dense, the rate sweep, the ``--against`` arms."""
    return {"relative_to_dense": relative_to_dense(rows),
            "arms_summary": [asdict(a) for a in summarise_arms(rows)], **_sweep_payload(spec, rows),
            **({"against": {b: [asdict(a) for a in against(at_best_lr(rows)[0], b)] for b in spec.against}}
               if spec.against and rows else {})}


def quality_payload(spec: QualitySpec, rows: list[QualityRow], environment: dict[str, Any]) -> dict[str, Any]:
    """The JSON result of a quality benchmark (``--json``): the equal-token readings at the top level (those
    of the equal-time runs there when they are the only ones), and under ``equal_time`` the equal-time runs'
    with the probed step times and each arm's steps; every row says its ``budget``."""
    first = "time" if spec.budget == "time" else "tokens"
    payload = {"command": "bench quality", "config": spec.config, "sets": spec.sets, "steps": spec.steps,
               "task": spec.task, "budget": spec.budget,
               "arms": [{"name": a.name, "sets": list(a.sets), "warm": [list(w) for w in a.warm],
                         "warm_sets": list(a.warm_sets)} for a in spec.arms],
               "seeds": spec.seeds, "lrs": spec.lrs, **_summaries(spec, of_budget(rows, first))}
    if spec.budget != "tokens" and spec.step_ms:
        payload["equal_time"] = {
            "budget": "equal GPU time: each arm the reference's steps x its step time, over its own step "
                      "time",
            "reference": spec.reference(), "reference_steps": spec.steps, "step_ms": spec.step_ms,
            "steps": spec.time_steps(), "probe_steps": spec.probe_steps,
            **_summaries(spec, of_budget(rows, "time"))}
    return {**payload, "environment": environment, "rows": [r.to_dict() for r in rows]}


def _sweep_payload(spec: QualitySpec, rows: list[QualityRow]) -> dict[str, Any]:
    if not spec.lrs or not rows:
        return {}
    best, sweep = at_best_lr(rows)
    return {"lr_sweep": sweep, "arms_summary_at_best_lr": [asdict(a) for a in summarise_arms(best)]}


__all__ = [
    "ARMS",
    "BUDGETS",
    "LR_TAG",
    "Arm",
    "ArmSummary",
    "FinalMeasures",
    "QualityRow",
    "QualitySpec",
    "Run",
    "against",
    "arm_phases",
    "at_best_lr",
    "final_measures",
    "of_budget",
    "parse_arm",
    "probe_step_ms",
    "quality_payload",
    "relative_to_dense",
    "run_needle_arm",
    "run_parallel",
    "run_quality",
    "run_text_arm",
    "summarise_arms",
]
