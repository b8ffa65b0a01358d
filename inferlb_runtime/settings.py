"""Layered settings for pydantic-settings classes: defaults < a TOML file's table
< environment variables < explicit overrides (command-line flags)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Mapping, TypeVar

from pydantic import AfterValidator, BeforeValidator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
)

from .plugins import PolicyAllowlist

S = TypeVar("S", bound=BaseSettings)


def _split_commas(value: Any) -> Any:
    return [part.strip() for part in value.split(",") if part.strip()] if isinstance(value, str) else value


def _module_prefixes(value: list[str]) -> list[str]:
    PolicyAllowlist(tuple(value))  # ValueError naming a bad prefix
    return value


# A list given as a TOML array, or comma-separated in an environment variable.
CommaList = Annotated[list[str], NoDecode, BeforeValidator(_split_commas)]
# The module prefixes under which module:attribute policies may load (a PolicyAllowlist's).
PolicyModules = Annotated[CommaList, AfterValidator(_module_prefixes)]


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
