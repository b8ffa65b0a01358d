"""Start the providers the config asks for, each as a task applying its snapshots to the controller."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Mapping, Protocol

from ..config import ControlPlaneConfig, parse_endpoint
from .dns import DnsProvider
from .kubernetes import KubernetesProvider, KubernetesTarget
from .model import DiscoverySnapshot, DiscoverySource
from .reconcile import Override
from .runner import DiscoveryObserver, Provider, run_provider


class DiscoveryTarget(Protocol):
    """What discovery drives (the controller); a protocol, so discovery never imports the controller."""

    def seed_discovery_overrides(self, source: DiscoverySource, overrides: Mapping[str, Override]) -> None: ...

    def sync_source(self, snapshot: DiscoverySnapshot) -> object: ...


def configured_providers(config: ControlPlaneConfig) -> list[Provider]:
    """DNS when ``discovery_dns`` lists names, Kubernetes when ``kubernetes_service`` is set (both may run)."""
    providers: list[Provider] = []
    if config.discovery_dns:
        providers.append(DnsProvider([parse_endpoint(t) for t in config.discovery_dns], config.discovery_interval_s))
    if config.kubernetes_service:
        providers.append(KubernetesProvider(
            KubernetesTarget.parse(config.kubernetes_service, config.kubernetes_port), config.kubernetes_kubeconfig))
    return providers


def start_discovery(config: ControlPlaneConfig, controller: DiscoveryTarget, observer: DiscoveryObserver | None,
                    stored_overrides: Mapping[str, Override] | None = None) -> list[asyncio.Task[None]]:
    """One task per provider. ``stored_overrides`` (id -> pinned_weight/draining, from the store) apply to
    discovered endpoints when they appear: at startup none of them is known yet."""
    overrides = dict(stored_overrides or {})
    tasks = []
    for provider in configured_providers(config):
        controller.seed_discovery_overrides(provider.source, overrides)
        tasks.append(asyncio.create_task(run_provider(provider, controller.sync_source, observer),
                                         name=f"discovery-{provider.source}"))
    return tasks


async def stop_discovery(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
