"""Traces of measured runs (JSON Lines) and the tools that read them."""

from autopar.traces.record import (
    OUTCOMES,
    TRACE_SCHEMA_VERSION,
    TraceProblem,
    TraceRecord,
    append_record,
    current_versions,
    model_entry,
    read_records,
    run_record,
)

__all__ = ["OUTCOMES", "TRACE_SCHEMA_VERSION", "TraceProblem", "TraceRecord", "append_record",
           "current_versions", "model_entry", "read_records", "run_record"]
