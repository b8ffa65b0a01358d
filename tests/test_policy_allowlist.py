"""A ``module:attribute`` spec cannot reach past the modules the operator allowed.

The allowlist checks the module part of a spec on the string, before any import. Before the origin checks,
the attribute part could still walk out of it: ``mypkg:other.Policy`` (through a module ``mypkg`` imports)
or ``mypkg:Policy`` after ``from other import Policy`` constructed a class from a module nobody allowed, with
the caller's parameters. Each test below uses a class whose construction leaves a marker file, and checks
the marker is never written.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from control_plane.policies.registry import make_weight_policy
from ext_proc.pick.registry import PluginRegistry
from inferlb_runtime.plugins import PolicyAllowlist, PolicyNotFound


def make_pick_plugin(spec: str, params: dict | None = None, allow: PolicyAllowlist = PolicyAllowlist()):  # type: ignore[no-untyped-def]
    """The pick chain's scorer ``spec``, loaded as ext_proc loads a plugin named in a policy's params."""
    chain = PluginRegistry(allow).build("least_completion_time",
                                        {"scorers": [{"plugin": spec, "params": params or {}}]})
    return chain.scorers[-1][0]


@pytest.fixture()
def marker(tmp_path: Path) -> Path:
    return tmp_path / "constructed"


@pytest.fixture()
def packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, marker: Path) -> str:
    """``<name>_allowed`` (the operator's, allowed) imports from ``<name>_other`` (not allowed), whose
    policy classes write ``marker`` when constructed. Unique names: nothing is cached in sys.modules."""
    name = f"allowlist_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}_other.py").write_text(textwrap.dedent(f"""\
        class Loud:
            def __init__(self, **params):
                open({str(marker)!r}, "w").close()

            def compute(self, view):
                return {{}}

            def score(self, request, candidates):
                return []
        """))
    (tmp_path / f"{name}_allowed.py").write_text(textwrap.dedent(f"""\
        import {name}_other
        from {name}_other import Loud


        class Own:
            def __init__(self, **params):
                self.params = params

            def compute(self, view):
                return {{}}

            def score(self, request, candidates):
                return []


        ready = Own()
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


@pytest.mark.parametrize("attribute, refusal", [
    # a class imported into the allowed module (from other import Loud)
    ("Loud", r"class Loud is defined in module '{p}_other', which is not under a module prefix the operator allows"),
    # an attribute path through a module the allowed one imports (import other)
    ("{p}_other.Loud", r"'{p}_other' is a module; name a module before the colon, an attribute after it"),
])
def test_a_spec_cannot_reach_past_the_allowed_module(packages: str, marker: Path, attribute: str,
                                                     refusal: str) -> None:
    allow = PolicyAllowlist((f"{packages}_allowed",))
    spec = f"{packages}_allowed:{attribute.format(p=packages)}"
    with pytest.raises(PolicyNotFound, match=refusal.format(p=packages)):
        make_weight_policy(spec, {"x": 1}, allow)
    with pytest.raises(PolicyNotFound, match=refusal.format(p=packages)):
        make_pick_plugin(spec, {"x": 1}, allow)
    assert not marker.exists()


def test_a_pick_policy_name_is_never_a_spec(packages: str, marker: Path) -> None:
    """A pick policy is one of the built-in chains: a ``module:attribute`` name is refused on the string, even
    under an allowed prefix (user code enters the chain only as a plugin), and nothing is imported."""
    allow = PolicyAllowlist((f"{packages}_allowed", f"{packages}_other"))
    for name in (f"{packages}_allowed:Own", f"{packages}_allowed:Loud", "os:system"):
        with pytest.raises(PolicyNotFound, match=r"is not allowed: a pick policy is one of the built-in chains"):
            PluginRegistry(allow).build(name, {"x": 1})
    assert f"{packages}_allowed" not in sys.modules and f"{packages}_other" not in sys.modules
    assert not marker.exists()


def test_what_the_allowed_module_defines_still_loads(packages: str, marker: Path) -> None:
    allow = PolicyAllowlist((f"{packages}_allowed",))
    assert make_weight_policy(f"{packages}_allowed:Own", {"x": 1}, allow).params == {"x": 1}
    assert make_pick_plugin(f"{packages}_allowed:ready", allow=allow).inner.score(None, []) == []
    # Allowing the other module too lets its class load: the operator named both.
    both = PolicyAllowlist((f"{packages}_allowed", f"{packages}_other"))
    make_weight_policy(f"{packages}_allowed:Loud", {}, both)
    assert marker.exists()
