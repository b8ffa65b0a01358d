"""Layered settings for pydantic-settings classes: defaults < a TOML file's table
< environment variables < explicit overrides (command-line flags)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Mapping, TypeVar

from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
)

S = TypeVar("S", bound=BaseSettings)


def load_layered(
    settings_cls: type[S], table: str, config_file: Path | None = None, overrides: Mapping[str, Any] | None = None
) -> S:
    """Merge the sources; raises pydantic's ValidationError (or OSError) saying what is wrong.

    ``overrides`` set to None are ignored (a flag that was not given).
    """
    values: dict[str, Any] = {}
    if config_file is not None:
        with open(config_file, "rb") as fh:
            values = tomllib.load(fh).get(table, {})
    flags = {k: v for k, v in (overrides or {}).items() if v is not None}

    class _Merged(settings_cls):  # type: ignore[valid-type, misc]
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return init_settings, env_settings, InitSettingsSource(settings_cls, init_kwargs=values)

    merged = _Merged(**flags)
    return settings_cls.model_construct(**{name: getattr(merged, name) for name in settings_cls.model_fields})
