"""Kept for the providers' imports: the backoff lives in ``inferlb.runtime.backoff`` (shared by every retry)."""

from inferlb.runtime.backoff import Backoff

__all__ = ["Backoff"]
