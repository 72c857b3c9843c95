"""Serve's buffered request-path logging (RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE, set by AppArgs.serve_env)
puts a MemoryHandler in front of the replica's log file that flushes only when 1000 records have piled up
or at ERROR: a router's warnings (admission actor unreachable, metrics push failed) then never reached its
log file in a short run. Warnings flush at once here; access logs stay buffered."""

import logging
import logging.handlers

SERVE_LOGGER = "ray.serve"


def flush_at_warning() -> None:
    for handler in logging.getLogger(SERVE_LOGGER).handlers:
        if isinstance(handler, logging.handlers.MemoryHandler):
            handler.flushLevel = min(handler.flushLevel, logging.WARNING)
