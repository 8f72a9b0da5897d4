"""Inputs of earlier versions, mapped to today's settings (``docs/migrating.md``): the older system's YAML
keys, its ``NSA_*`` knobs (hints that depend on the value set) and its ``CONFIG=path`` variable; and this
toolkit's own keys that moved or went away (deprecated, read until nsa.deprecation.PRE_RELEASE_UNTIL).

An old key becomes today's key with a one-line note (``train.accumulate_grad_batches: 2`` ->
``train.accum=2``; ``train.lr`` -> ``optimizer.lr``), or is dropped with a note saying why
(``runtime.sel_triton_min_L``: the dispatcher picks per call); a value with no equivalent is refused, all
such keys in one message. A config saved by a run (``config.yaml``, a checkpoint) is mapped silently, and
keys that went away are dropped whatever their value (the run it describes did not use them).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from nsa.deprecation import READ_UNTIL
from nsa.errors import ConfigError


def deprecated_spelling(old: str, new: str, why: str = "") -> str:
    """The one stderr line of one of this toolkit's deprecated command-line spellings (``-p`` for
    ``--prompt``,
    ``--json PATH``), read until the same date as its moved keys."""
    return f"warning: {old} is deprecated ({READ_UNTIL}): use {new}" + (f"; {why}" if why else "")


CONFIG_VAR = "CONFIG"  # the older system's config path variable (CONFIG=configs/x.yaml python train.py)

Change = tuple[dict[str, Any], str]  # ({today's dotted key: value}, one-line note)


def _yaml(value: Any) -> str:
    """A YAML value as it was written (``true``, ``2``, ``cosine``)."""
    return json.dumps(value) if isinstance(value, bool) or value is None else str(value)


def _truthy(value: Any) -> bool | None:
    """``value`` as the older system read a switch (``1/0``, ``true/false``, ``on/off``); None when
    neither."""
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", "", "none", "null"):
        return False
    return None


def _accum(value: Any) -> Change:
    return {"train.accum": value}, f"train.accumulate_grad_batches={value} -> train.accum={value}"


_WINDOW_KERNEL = "the window branch's kernel comes with runtime.attn_backend (Triton on CUDA)"


def _use_flash(value: Any) -> Change:
    return {}, (f"runtime.use_flash={value} dropped: dense attention uses torch SDPA's own backend choice "
                f"and {_WINDOW_KERNEL}")


def _use_triton_sel(value: Any) -> Change:
    on = _truthy(value)
    if on is None:
        raise ValueError("expected true or false")
    backend = "triton" if on else "torch"
    why = "the Triton kernels" if on else "Triton kept out; auto would pick Triton on CUDA"
    return ({"runtime.attn_backend": backend},
            f"runtime.use_triton_sel={value} -> runtime.attn_backend={backend} ({why})")


def _sel_triton_min_len(value: Any) -> Change:
    return {}, f"runtime.sel_triton_min_L={value} dropped: one dispatcher picks the selection path per call"


def _lr_schedule(value: Any) -> Change:
    name = str(value).strip().lower()
    if name in ("cosine", "warmup_cosine", "cos"):
        return {}, (f"train.lr_schedule={value} dropped: the schedule is always linear warmup, then cosine "
                    "to schedule.min_lr_ratio")
    if name in ("constant", "const", "none"):
        return {"schedule.min_lr_ratio": 1.0}, (f"train.lr_schedule={value} -> schedule.min_lr_ratio=1.0 "
                                                "(warmup, then the peak rate throughout)")
    raise ValueError("no equivalent: the schedule is linear warmup then cosine (schedule.min_lr_ratio sets "
                     "its floor; 1.0 keeps the rate constant)")


def _fa2_enabled(value: Any) -> Change:
    if _truthy(value):
        return {}, f"runtime.fa2_enabled={value} dropped: flash-attn is not used; {_WINDOW_KERNEL}"
    return {}, f"runtime.fa2_enabled={value} dropped: flash-attn is not used by default"


def _fa2_min_len(key: str) -> Callable[[Any], Change]:
    def translate(value: Any) -> Change:
        return {}, f"runtime.{key}={value} dropped: the dispatcher picks the window path per call"

    return translate


# old dotted key -> translator (value -> changes and note; ValueError: no equivalent for that value)
OLD_KEYS: dict[str, Callable[[Any], Change]] = {
    "train.accumulate_grad_batches": _accum,
    "train.lr_schedule": _lr_schedule,
    "runtime.use_flash": _use_flash,
    "runtime.use_triton_sel": _use_triton_sel,
    "runtime.sel_triton_min_L": _sel_triton_min_len,
    "runtime.fa2_enabled": _fa2_enabled,
    "runtime.fa2_min_len_win": _fa2_min_len("fa2_min_len_win"),
    "runtime.fa2_min_len_cmp": _fa2_min_len("fa2_min_len_cmp"),
}


# This toolkit's keys that moved when ``train`` was split into one section per component (deprecated: read,
# with a note, until nsa.deprecation.PRE_RELEASE_UNTIL). old dotted key -> today's dotted key
MOVED_KEYS: dict[str, str] = {
    "train.lr": "optimizer.lr",
    "train.weight_decay": "optimizer.weight_decay",
    "train.beta1": "optimizer.beta1",
    "train.beta2": "optimizer.beta2",
    "train.grad_clip": "optimizer.grad_clip",
    "train.warmup_steps": "schedule.warmup_steps",
    "train.min_lr_ratio": "schedule.min_lr_ratio",
    "train.save_every": "checkpoint.every",
    "train.keep_last": "checkpoint.keep_last",
    "train.log_every": "logging.every",
    "train.heartbeat_every": "logging.heartbeat_every",
    "train.mfu_peak_tflops": "logging.mfu_peak_tflops",
    "train.eval_every": "eval.every",
    "train.eval_batches": "eval.batches",
}


def _window_backend(value: Any) -> Change:
    if str(value).strip().lower() == "auto":
        return {}, f"runtime.window_backend={value} dropped: {_WINDOW_KERNEL}"
    raise ValueError(f"removed: {_WINDOW_KERNEL}; set runtime.attn_backend instead")


def _fault_nan_at_step(value: Any) -> Change:
    if value is None or str(value).strip().lower() in ("", "null", "none"):
        return {}, "train.fault_nan_at_step=null dropped: fault injection is a test's Trainer(step_hook=...)"
    raise ValueError("removed: tests inject faults through Trainer(step_hook=...)")


# This toolkit's keys that went away (a config saved by an earlier version holds them): old dotted key ->
# translator (ValueError: refused, a value that asked for something)
REMOVED_KEYS: dict[str, Callable[[Any], Change]] = {
    "runtime.window_backend": _window_backend,
    "train.fault_nan_at_step": _fault_nan_at_step,
}


def _moved(new: str) -> Callable[[Any], Change]:
    def translate(value: Any) -> Change:
        return {new: value}, ""

    return translate


def translate_old_keys(tree: dict[str, Any], origin: str, *, saved: bool = False) -> tuple[dict[str, Any],
    list[str]]:
    """``tree`` (a config's sections) with earlier keys replaced by today's, and one note per key. An old key
    whose value has no equivalent raises ``ConfigError`` naming every such key at once; a key set both ways
    (``accumulate_grad_batches`` and ``accum``, ``train.lr`` and ``optimizer.lr``) keeps today's and says so.
    ``saved``: a config written by a run (``config.yaml``, a checkpoint): keys that went away are dropped
    whatever their value."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in tree.items()}
    notes: list[str] = []
    refused: list[str] = []
    table: list[tuple[str, Callable[[Any], Change], str]] = [
        *((old, fn, "older system's key") for old, fn in OLD_KEYS.items()),
        *((old, _moved(new), "") for old, new in MOVED_KEYS.items()),
        *((old, fn, "removed key") for old, fn in REMOVED_KEYS.items()),
    ]
    for old, translate, kind in table:
        section, key = old.split(".")
        sec = out.get(section)
        if not isinstance(sec, dict) or key not in sec:
            continue
        value = sec.pop(key)
        if saved and old in REMOVED_KEYS:
            continue
        try:  # a moved key keeps its value as written (a boolean for a number is refused as such)
            changes, note = translate(_yaml(value) if isinstance(value, bool) and kind else value)
        except ValueError as exc:
            refused.append(f"{old}={_yaml(value)} ({exc})")
            continue
        if not note:  # a moved key
            new = next(iter(changes))
            note = f"{old} is deprecated, use {new} (the old key is {READ_UNTIL})"
        for dotted, new_value in changes.items():
            s2, k2 = dotted.split(".")
            target = out.setdefault(s2, {})
            if k2 in target and target[k2] != new_value:
                note = f"{old}={_yaml(value)} ignored: {dotted}={_yaml(target[k2])} is also set"
                continue
            target[k2] = new_value
        notes.append(f"{origin}: {note}" + (f" ({kind})" if kind else ""))
    if refused:
        raise ConfigError(f"{origin}: key(s) without an equivalent: {'; '.join(refused)}",
                          hint="remove them (docs/migrating.md maps every older key)")
    for section, keys in tree.items():  # a section that held only old keys is gone, not an empty leaf
        if isinstance(keys, dict) and keys and out.get(section) == {}:
            del out[section]
    return out, ([] if saved else notes)


# ---- NSA_* knobs of the older system: hints that depend on the value ---------------------------------

_NOTHING = "nothing to set"


def _switch(on: str, off: str) -> Callable[[str | None], str]:
    def hint(value: str | None) -> str:
        state = _truthy(value) if value is not None else None
        if state is True:
            return on
        if state is False:
            return off
        return f"=1: {on}; =0: {off}"

    return hint


def _fixed(text: str) -> Callable[[str | None], str]:
    return lambda value: text


def _prefetch(value: str | None) -> str:
    if value is not None and value.strip().isdigit():
        return f"replaced by NSA_PREFETCH_DEPTH={int(value)} (data.prefetch_depth)"
    return "replaced by NSA_PREFETCH_DEPTH (data.prefetch_depth; 0 turns prefetch off)"


def _timeout(value: str | None) -> str:
    shown = f"={value}" if value else ""
    return f"replaced by NSA_LOADER_TIMEOUT{shown} (data.timeout_s, seconds)"


_FA2_ON = ("gone: flash-attn is not used; the window branch's kernel comes with NSA_ATTN_BACKEND "
           "(runtime.attn_backend; Triton on CUDA)")
_FA2_OFF = f"{_NOTHING}: flash-attn is not used"
_BACKEND_FAST = "nothing to set: the dispatcher picks the fastest exact path per call (NSA_ATTN_BACKEND=auto)"
_DEBUG_OFF = f"{_NOTHING}: off is the default"

LEGACY_VARS: dict[str, Callable[[str | None], str]] = {
    "NSA_USE_FA2": _switch(_FA2_ON, _FA2_OFF),
    "NSA_USE_FA2_WIN": _switch(_FA2_ON, _FA2_OFF),
    "NSA_USE_FA2_CMP": _fixed("gone: the compressed branch has its own kernel on every backend"),
    "NSA_FA2_MIN_LEN_WIN": _fixed("gone: the dispatcher picks the window path per call"),
    "NSA_FA2_MIN_LEN_CMP": _fixed("gone: the compressed branch has its own kernel on every backend"),
    "NSA_SDPA_NO_FLASH": _fixed("gone: dense attention uses torch's SDPA backend choice"),
    "NSA_SEL_RANGES_V2": _switch(_BACKEND_FAST, f"{_NOTHING}: the selection ranges have one exact "
                                 "implementation per backend (NSA_ATTN_BACKEND=triton|torch|reference)"),
    "NSA_SEL_RANGES_V2_MIN_S": _fixed("gone: the dispatcher picks the selection path per call"),
    "NSA_USE_SEL_PACK": _switch("replaced by NSA_ATTN_BACKEND=triton (packed, varlen selection kernels)",
                                f"{_NOTHING}: NSA_ATTN_BACKEND=torch keeps the Triton kernels out"),
    "NSA_USE_SEL_VARLEN": _switch("replaced by NSA_ATTN_BACKEND=triton (packed, varlen selection kernels)",
                                  f"{_NOTHING}: NSA_ATTN_BACKEND=torch keeps the Triton kernels out"),
    "NSA_USE_SEL_MASK": _switch("replaced by NSA_ATTN_BACKEND=torch (the masked vectorised path)",
                                _BACKEND_FAST),
    "NSA_FORCE_SEL_MASK": _switch("replaced by NSA_ATTN_BACKEND=torch (the masked vectorised path)",
                                  _BACKEND_FAST),
    "NSA_USE_TRITON_SEL": _switch("replaced by NSA_ATTN_BACKEND=triton", "replaced by NSA_ATTN_BACKEND=torch "
                                  "(keeps Triton out)"),
    "NSA_FORCE_PARITY": _switch("replaced by NSA_ATTN_BACKEND=reference (the float64-exact reference)",
                                _BACKEND_FAST),
    "NSA_PREFILL_BATCHED": _fixed("gone: prefill is always one batched pass (nsa.model.cache)"),
    "NSA_PREFILL_TILE": _fixed("gone: prefill is always one batched pass (nsa.model.cache)"),
    "NSA_FWE_Q": _prefetch,
    "NSA_FWE_PREFETCH": _switch("replaced by NSA_PREFETCH_DEPTH (data.prefetch_depth; on by default)",
                                "replaced by NSA_PREFETCH_DEPTH=0 (no prefetch thread)"),
    "NSA_FWE_DOC_BATCH": _fixed("gone: the loader streams documents; tune NSA_PREFETCH_DEPTH"),
    "NSA_FWE_WARMUP_BATCHES": _fixed("gone: the first batch is prefetched during set-up and its time "
                                     "reported"),
    "NSA_FWE_WARMUP_TIMEOUT": _timeout,
    "NSA_SDPA_AUDIT": _switch("gone: nsa smoke checks every fast path against the reference", _DEBUG_OFF),
    "NSA_DEBUG_COMPARE": _switch("gone: nsa smoke checks every fast path against the reference", _DEBUG_OFF),
    "NSA_DEBUG_TIMING": _switch("replaced by nsa bench attention|train and the heartbeat's step/fetch times",
                                _DEBUG_OFF),
    "NSA_STRICT_ASSERTS": _switch("gone: the spec's checks run in the test suite and nsa smoke, not at train "
                                  "time", _DEBUG_OFF),
    "NSA_ENV_STATIC": _fixed("gone: settings are read once at start and recorded in env.json"),
    "NSA_ROPE_SCALE": _fixed("gone: set model.rope_theta instead"),
}

# ``NSA_*`` variables of earlier versions of this toolkit, with what replaced them
REMOVED_VARS: dict[str, Callable[[str | None], str]] = {
    "NSA_WINDOW_BACKEND": _fixed("removed: the window branch's kernel comes with NSA_ATTN_BACKEND "
                                 "(runtime.attn_backend; Triton on CUDA)"),
}


def legacy_hint(name: str, value: str | None = None) -> str | None:
    """What replaced the older system's ``NSA_*`` knob ``name`` given the value it is set to (None: not
    one of them). ``NSA_USE_FA2=0`` says there is nothing to set, ``=1`` how to ask for flash-attn."""
    fn = LEGACY_VARS.get(name.upper())
    return None if fn is None else fn(value)


def removed_hint(name: str, value: str | None = None) -> str | None:
    """What replaced an ``NSA_*`` variable this toolkit read before (None: not one of them)."""
    fn = REMOVED_VARS.get(name.upper())
    return None if fn is None else fn(value)
