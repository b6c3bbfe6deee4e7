"""Logs as JSON lines (or plain text for a terminal): one object per record, with the fields a
request's line carries (request id, tenant, model, status, tokens, latency) as top-level keys.

Nothing secret goes in: no API key or admin token, no prompt or completion text. Request lines
come from the request middleware, which knows only ids, names and counts.
"""

from __future__ import annotations

import json
import logging
import sys
import time

REQUEST_LOGGER = "loraplex.requests"
# a record's own attributes, and uvicorn's terminal-coloured copy of its message
_NOT_FIELDS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "color_message"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in _NOT_FIELDS})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(level: str, log_format: str) -> None:
    """Route every logger (uvicorn's too) to stderr in the chosen format."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    for name in ("loraplex", "uvicorn"):
        logging.getLogger(name).setLevel(level.upper())
    logging.getLogger(REQUEST_LOGGER).setLevel(logging.INFO)  # a line per request, always
