"""One JSON object per log line on stderr, for every logger of a service (uvicorn's included)."""

from __future__ import annotations

import logging.config
from typing import Iterable

UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


def configure_json_logging(component: str, level: str, quiet: Iterable[str] = ("httpx",)) -> None:
    """``component`` is stamped on every line; loggers in ``quiet`` log warnings only."""
    logging.config.dictConfig({
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {
            "()": "pythonjsonlogger.json.JsonFormatter",
            "fmt": "{asctime}{levelname}{name}{message}",
            "style": "{",
            "rename_fields": {"asctime": "ts", "levelname": "level", "name": "logger", "message": "msg"},
            "static_fields": {"component": component},
        }},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}},
        "root": {"handlers": ["stderr"], "level": level.upper()},
        "loggers": {
            **{name: {"handlers": [], "propagate": True} for name in UVICORN_LOGGERS},
            **{name: {"level": "WARNING"} for name in quiet},
        },
    })
