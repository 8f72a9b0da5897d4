"""The monitoring app over run directories: incremental heartbeat/CSV reader, watch rules, the watchdog,
halt writer, verdict and report builder (the format itself is ``nsa.rundir``)."""

from nsa.runs.reader import RunReader, RunState, check_run_dir, is_run_dir, read_run

__all__ = ["RunReader", "RunState", "check_run_dir", "is_run_dir", "read_run"]
