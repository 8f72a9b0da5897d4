"""Reading run directories: incremental heartbeat/CSV reader, watch rules, halt writer, report builder."""

from nsa.runs.reader import RunReader, RunState, check_run_dir, is_run_dir, read_run

__all__ = ["RunReader", "RunState", "build_report", "check_run_dir", "halt_run", "is_run_dir", "read_run"]


def __getattr__(name: str):
    if name == "build_report":
        from nsa.runs.report import build_report

        return build_report
    if name == "halt_run":
        from nsa.runs.halt import halt_run

        return halt_run
    raise AttributeError(name)
