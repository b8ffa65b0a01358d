"""Build a policy's pick chain, and say what can be chosen: the one place ext_proc loads plugins.

A policy is a preset name and its params (``inferlb_runtime/pick_chain.py``
validates both and expands them into a chain). Built-in plugins are built
from ``pick/policies.py``. A user plugin is named by an ``inferlb.policies`` entry
point (its class declares ``kind = "admit" | "filter" | "scorer"``) or by a
``module:attribute`` spec under a module prefix this registry's allowlist
names (ext_proc's own configuration, ``allowed_policy_modules``: none by
default). The control plane never imports a plugin for ext_proc: it sends
``{name, params}`` in EDS metadata and each ext_proc builds the chain here,
checking the allowlist again. User plugins run behind a guard
(``pick/guard.py``) reporting to this registry's failure observer.

ext_proc-local plugins come from ext_proc's own configuration, not from the
policy: ``slow_start`` (its window) is one instance, put in every chain built
here right after the ``model`` filter, so that its ramps outlive a policy switch
(unless the policy names ``slow_start`` itself).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from typing import Any

from inferlb_runtime import pick_chain, plugins
from inferlb_runtime.pick_chain import BUILTIN_PLUGINS, PRESETS, ChainSpec, PluginRef, SlowStartParams

from .chain import PickChain
from .guard import FailureObserver, GuardedPlugin
from .policies import BUILTIN_CLASSES, Sampler
from .slow_start import SlowStart


class PluginRegistry:
    """Loads plugins (built in, installed, or allowed by module prefix) and builds chains of them."""

    def __init__(self, allow: plugins.PolicyAllowlist = plugins.PolicyAllowlist(),
                 observer: FailureObserver | None = None, slow_start: SlowStart | None = None,
                 clock: Callable[[], float] = time.monotonic, **guard_options: Any) -> None:
        self.allow = allow
        self.clock = clock  # for the built-ins that measure time (``clocked``): the simulator's in ``inferlb sim``
        self.observer = observer  # told of every contained user-plugin failure
        self.slow_start = slow_start  # ext_proc's own, in every chain (None: no slow start)
        self._guard_options = guard_options

    @classmethod
    def with_slow_start(cls, window_s: float, allow: plugins.PolicyAllowlist = plugins.PolicyAllowlist(),
                        observer: FailureObserver | None = None) -> "PluginRegistry":
        """The registry of an ext_proc configured with a slow-start window (0: none)."""
        return cls(allow, observer, SlowStart(SlowStartParams(window_s=window_s)) if window_s > 0 else None)

    def spec(self, name: str, params: Mapping[str, Any] | None = None) -> ChainSpec:
        """The validated chain of a named policy (``PolicyNotFound`` / ``BadPolicyParams``, both ValueError)."""
        return pick_chain.chain_spec(name, params, self.allow)

    def build(self, name: str, params: Mapping[str, Any] | None = None) -> PickChain:
        """The chain of a named policy (its filters run after the router's routable and partition)."""
        spec = self.spec(name, params)
        filters = [self._plugin("filter", ref) for ref in spec.filters]
        if self.slow_start is not None and not any(ref.plugin == "slow_start" for ref in spec.filters):
            at = next((i + 1 for i, ref in enumerate(spec.filters) if ref.plugin == "model"), 0)
            filters.insert(at, self.slow_start)
        return PickChain(
            spec.policy,
            [self._plugin("admit", ref) for ref in spec.admit],
            filters,
            Sampler(spec.sample, random.Random(spec.sample.seed)),
            [(self._plugin("scorer", ref), ref.weight) for ref in spec.scorers],
            self._plugin("picker", spec.picker),
        )

    def _plugin(self, step: pick_chain.Step, ref: PluginRef) -> Any:
        builtin = ref.builtin
        if builtin is not None:
            cls = BUILTIN_CLASSES[builtin.name]
            if builtin.params is pick_chain.NoParams:
                return cls()
            params = plugins.parse_params(f"{step} {ref.plugin!r}", builtin.params, ref.params)
            return cls(params, clock=self.clock) if getattr(cls, "clocked", False) else cls(params)
        obj, _ = plugins.resolve(step, ref.plugin, self.allow)  # type: ignore[arg-type]
        plugin = plugins.instantiate(step, ref.plugin, obj, ref.params)  # type: ignore[arg-type]
        return GuardedPlugin(plugin, step, observer=self.observer, **self._guard_options)

    def describe(self) -> list[dict[str, Any]]:
        """Every policy and plugin that can be named: ``{name, kind, summary, params_schema, source}``, policies
        first, then built-in plugins, then installed ones."""
        described = [{"name": p.name, "kind": "pick", "summary": p.summary,
                      "params_schema": plugins.dataclass_schema(p.params), "source": "builtin"}
                     for p in sorted(PRESETS.values(), key=lambda p: p.name)]
        described += [{"name": p.name, "kind": p.step, "summary": p.summary,
                       "params_schema": plugins.dataclass_schema(p.params), "source": "builtin"}
                      for p in sorted(BUILTIN_PLUGINS.values(), key=lambda p: (p.step, p.name))]
        for step in pick_chain.USER_STEPS:
            described += [d for d in plugins.describe_entry_points(step) if d["name"] not in BUILTIN_PLUGINS]
        return described
