"""The ``monitor`` section of the run config: watchdog rule thresholds and report limits.

Saved with the run (``config.yaml``), so ``nsa watch`` and ``nsa report`` judge a run by the limits it
was started with; a hardware profile's ``monitor:`` block sets them per machine. Defaults are the older
runbooks' alert conditions and expectations: heartbeat stale > 3 min, gate entropy above 0.5 early on and
above 0.3 later, collapsed-gate fraction not above 0.1, throughput down 50% for 10 minutes, fetch > 2 s,
no loss plateau over 1k steps, flat memory, no rising fallback counters, no GPU memory errors.
"""

from __future__ import annotations

from pydantic import Field

from nsa.config.section import ConfigSection


class MonitorConfig(ConfigSection):
    """Thresholds of the watch rules (``nsa.runs.rules``) and limits of the report's verdict."""

    def entropy_min_at(self, step: int | None) -> float:
        """The gate entropy minimum that applies at ``step`` (the early one before
        ``gate_entropy_early_steps``)."""
        early = step is not None and step < self.gate_entropy_early_steps
        return self.gate_entropy_early_min if early else self.gate_entropy_min

    # watch rules
    stale_s: float = Field(180.0, gt=0,
                           description="a rank's heartbeat older than this (s) and no end: stale")
    gate_entropy_min: float = Field(0.3, ge=0,
                                    description="mean gate entropy (nats) below this after the early steps: "
                                                "alarm")
    gate_entropy_early_min: float = Field(0.5, ge=0, description="... and below this during the early steps")
    gate_entropy_early_steps: int = Field(1000, ge=0,
                                          description="the early steps (gate_entropy_early_min applies)")
    gate_collapse_max: float = Field(0.1, ge=0, le=1,
                                     description="collapsed-gate fraction above this for 3 points")
    grad_spike_ratio: float = Field(10.0, gt=1,
                                    description="grad norm above this x the median of the last 20 points")
    plateau_steps: int = Field(1000, ge=1, description="steps over which the loss must fall")
    plateau_min_drop: float = Field(0.01, ge=0,
                                    description="relative loss drop over plateau_steps below this: plateau")
    memory_creep_ratio: float = Field(1.2, gt=1,
                                      description="reserved/RSS memory grown by this factor since warm-up")
    throughput_drop_ratio: float = Field(0.5, gt=0, lt=1,
                                         description="tokens/s below this x the run's median")
    throughput_window_s: float = Field(600.0, gt=0, description="... for this long (s)")
    throughput_tail_min_s: float = Field(
        10.0, ge=0,
                                         description="report: a slow tail shorter than this (s) is a WARN (a "
                                                     "brief slowdown), not a FAIL")
    fetch_stall_ms: float = Field(2000.0, gt=0, description="data fetch p95 above this (ms)")
    notify: str | None = Field(None, description="command run with each alarm as JSON on stdin (nsa watch)")
    # report verdict limits (None: not judged)
    min_tokens_per_s: float | None = Field(
        None, ge=0,
                                           description="report: tokens/s floor of the median and of the "
                                                       "slowest window (the run's tail included)")
    max_fetch_p95_ms: float | None = Field(None, gt=0, description="report: fetch p95 ceiling (ms)")
    max_memory_gib: float | None = Field(None, gt=0, description="report: peak GPU memory ceiling (GiB)")
    min_eval_accuracy: float | None = Field(None, ge=0, le=1,
                                            description="report: lowest needle/mqar accuracy")
    min_selection_recall: float | None = Field(
        None, ge=0,
                                               description="report: mean selection recall of the last "
                                                           "evaluation (NSA models) below this: FAIL")
