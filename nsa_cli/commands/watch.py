"""``nsa watch``: a live dashboard over a run directory; alarms (record, notify) and, with ``--halt-on``, a
watchdog that writes ``.HALT``. On a terminal a Rich live view; otherwise one plain (or JSON) line per
refresh, so the output is a log of what it saw."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nsa_cli import options
from nsa_cli.compat import command_class
from nsa_cli.errors import EXIT_OK, user_errors
from nsa_cli.render import Output
from nsa_cli.render import watch as view

EPILOG = """\
Examples:

  nsa watch artifacts/tiny                          # live dashboard; waits for the run to start

  nsa watch artifacts/tiny --once                   # one snapshot (cron, scripts)

  nsa watch artifacts/tiny --once --json

  nsa watch artifacts/tiny > watch.log              # not a terminal: one line per refresh

  nsa watch artifacts/tiny --json | jq .status      # JSON lines, one object per refresh

  nsa watch artifacts/m7c-125m --halt-on all        # watchdog: writes .HALT when a rule fires

  nsa watch artifacts/m7c-125m --alert-on all,stale=60 --halt-on nonfinite,stale=600

  nsa watch artifacts/m7c-125m --notify 'curl -fsS --data-binary @- https://hooks.example.com/nsa'

Rules (thresholds default to the run's monitor config): {rules}.
The watch follows a run across resumes: after an end event, while a new `nsa train --resume` holds the
run lock, it waits for the new session. Alarms are kept with the run (RUN/alarms.jsonl; nsa report
judges them).
Exit code: live: 1 when the run crashed or failed, 3 when this watchdog's .HALT stopped it, else 0;
--once: 1 when an alarm fires or the run failed/crashed; 2 bad input (not a run directory, or the run did
not start within --timeout).
"""

def watch(
    run_dir: Annotated[Path, options.run_dir()],
    as_json: Annotated[bool, options.json_flag("the state (one object with --once, else one per refresh: "
                                               "JSON lines)")] = False,
    **fields: str,
) -> None:
    """Live dashboard: identity, progress/ETA, loss, tokens/s and grad-norm sparklines, lr, fetch p50/p95,
    memory, per-GPU utilisation/memory/temperature/power (NVML), gate health, selection recall and compressed
    entropy of the last evaluation, fallbacks, last checkpoint,
    heartbeat age, anomalies, halts and alarms. Exits when the run ends or crashes."""
    once = bool(fields.get("once"))
    out = Output(as_json and once)
    try:
        with user_errors():
            from nsa.runs.watch import open_watch

            req = options.request(_request(), {**fields, "run_dir": run_dir})
            w = open_watch(req, say=lambda line: out.say(line, err=as_json, wrap=False),
                           warn=lambda msg: out.say(f"warning: {msg}", err=True, wrap=False))
            if once:  # a bad monitor config or an unwritable .HALT: one line
                result = w.once()
                if not as_json:
                    view.once(w, result, out.console)
                raise typer.Exit(out.result(result))
            mode = "json" if as_json else ("live" if out.console.is_terminal else "lines")
            snap = view.follow(w, mode, out.console)
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_OK) from None
    view.ended(w, snap, mode, out.console)
    raise typer.Exit(w.exit_code(snap))


def _request() -> type:
    from nsa.runs.watch import WatchRequest

    return WatchRequest


def _rules() -> dict[str, str]:
    from nsa.runs.rules import synopsis

    return {"{rules}": synopsis()}  # the rules from their declarations (nsa.runs.rules.RULES)


def register(app: typer.Typer) -> None:
    cls = command_class(texts=_rules, request=_request, first=False)
    app.command("watch", epilog=EPILOG, cls=cls)(watch)
