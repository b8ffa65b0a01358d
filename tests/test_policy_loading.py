"""Loading user policies: ``module:attribute`` specs, the ``inferlb.policies`` entry-point group, parameter
validation, clear errors, and the descriptions ``GET /v1/policy`` lists. No servers."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from control_plane.policies.contract import EndpointView, FleetView
from control_plane.policies.registry import WeightPolicyRegistry, make_weight_policy
from control_plane.policies.builtins import CapacityWeightPolicy
from examples.policies.canary_weights import CanaryParams, CanaryWeightPolicy
from examples.policies.sticky_session import SessionAffinity, SessionAffinityParams
from ext_proc.pick.guard import GuardedPlugin
from ext_proc.pick.policies import CompletionTime
from ext_proc.pick.registry import PluginRegistry
from inferlb_runtime import plugins
from inferlb_runtime.plugins import BadPolicyParams, PolicyAllowlist, PolicyNotFound

ROOT = Path(__file__).resolve().parents[1]
CANARY = "examples.policies.canary_weights:CanaryWeightPolicy"
CANARY_FILTER = "examples.policies.canary:CanaryFilter"
STICKY = "examples.policies.sticky_session:SessionAffinity"
EXAMPLES = PolicyAllowlist(("examples",))

USER_MODULE = '''
"""User policies for the loading tests."""
from dataclasses import dataclass


class DoubleWeight:
    """Every endpoint at twice its current weight (capped)."""
    kind = "weight"
    name = "double"

    def __init__(self, cap: int = 1000, floor: float = 1.0):
        self.cap, self.floor = cap, floor

    def compute(self, view):
        return {e.id: min(self.cap, e.weight * 2) for e in view.endpoints}


class FirstPick:
    """The first candidate, always."""
    kind = "scorer"
    name = "first"

    def score(self, request, candidates):
        return [1.0] + [0.0] * (len(candidates) - 1)


@dataclass(frozen=True)
class BoostParams:
    boost: int = 2
    mode: str = "fast"


class Boost:
    """A weight policy with a Params dataclass."""
    kind = "weight"
    Params = BoostParams

    def __init__(self, params):
        self.params = params

    def compute(self, view):
        return {e.id: 100 * self.params.boost for e in view.endpoints}


def make_first(**params):
    """A factory: not a policy class, so never called."""
    raise AssertionError("a factory was called")


class Nameless:
    def score(self, request, candidates):
        return [0.0] * len(candidates)


class Shed:
    """Sheds nothing: an admit plugin that lets every request through."""
    kind = "admit"
    name = "shed"

    def admit(self, request, endpoints):
        return None


class NoMethods:
    kind = "weight"


class NoKind:
    def compute(self, view):
        return {}


ready_made = FirstPick()
'''


@pytest.fixture()
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """``userpol`` importable from a temporary directory (and a module that fails to import)."""
    name = f"userpol_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    (tmp_path / f"{name}_broken.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


@pytest.fixture()
def allow(user_module: str) -> PolicyAllowlist:
    return PolicyAllowlist(("examples", user_module, f"{user_module}_broken"))


@pytest.fixture()
def entry_points(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, user_module: str) -> str:
    """A real distribution on sys.path (a dist-info directory) registering policies in ``inferlb.policies``."""
    dist = tmp_path / "inferlb_test_policies-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: inferlb-test-policies\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent(f"""\
        [inferlb.policies]
        my_double = {user_module}:DoubleWeight
        my_boost = {user_module}:Boost
        my_first = {user_module}:FirstPick
        my_sticky = {STICKY}
        my_canary = {CANARY_FILTER}
        my_shed = {user_module}:Shed
        not_loadable = {user_module}_missing:Nothing
        no_kind = {user_module}:NoKind
        """))
    return user_module


def make_pick_plugin(spec: str, params: object = None, allow: PolicyAllowlist = PolicyAllowlist()):  # type: ignore[no-untyped-def]
    """The scorer ``spec`` as ext_proc loads a plugin a pick policy names (guarded, params validated)."""
    chain = PluginRegistry(allow).build("least_completion_time",
                                        {"scorers": [{"plugin": spec, "params": params or {}}]})
    return chain.scorers[-1][0]


def make_pick_policy(name: str, params: object = None):  # type: ignore[no-untyped-def]
    return PluginRegistry().build(name, params)  # type: ignore[arg-type]


def fleet(*ids: str, weight: int = 100) -> FleetView:
    return FleetView(tuple(EndpointView(id=i, weight=weight) for i in ids), now=0.0)


# --- module:attribute -----------------------------------------------------------------------------


def test_a_weight_policy_loads_from_module_attribute_with_validated_params() -> None:
    policy = make_weight_policy(CANARY, {"endpoint": "10.0.0.1:8000", "share": 0.1}, EXAMPLES)
    assert isinstance(policy, CanaryWeightPolicy)
    assert policy.params == CanaryParams(endpoint="10.0.0.1:8000", share=0.1)
    assert policy.name == "canary"
    weights = policy.compute(fleet("10.0.0.1:8000", "10.0.0.2:8000"))
    assert weights == {"10.0.0.1:8000": 11, "10.0.0.2:8000": 100}


def test_a_pick_policy_loads_from_module_attribute_contained_with_json_ish_params() -> None:
    # Numbers in xDS metadata arrive as doubles: 1.0 is a fine integer, 2 a fine float.
    policy = make_pick_plugin(STICKY, {"load_factor": 2, "header": "x-user"}, EXAMPLES)
    assert isinstance(policy, GuardedPlugin)
    assert isinstance(policy.inner, SessionAffinity)
    assert policy.params == SessionAffinityParams(header="x-user", load_factor=2.0)
    assert policy.name == "session_affinity"
    d = make_pick_policy("least_completion_time", {"d": 8.0}).sampler.params.d
    assert d == 8 and type(d) is int
    # Built-ins are not wrapped: their hot path is unchanged.
    assert type(make_pick_policy("least_completion_time").scorers[0][0]) is CompletionTime


def test_classes_and_instances_load(user_module: str, allow: PolicyAllowlist) -> None:
    double = make_weight_policy(f"{user_module}:DoubleWeight", {"cap": 150.0}, allow)
    assert double.compute(fleet("a:1")) == {"a:1": 150} and double.cap == 150
    boost = make_weight_policy(f"{user_module}:Boost", {"boost": 3}, allow)
    assert boost.params.boost == 3 and boost.params.mode == "fast"
    ready = make_pick_plugin(f"{user_module}:ready_made", allow=allow)
    assert ready.inner.name == "first"
    nameless = make_pick_plugin(f"{user_module}:Nameless", allow=allow)
    assert nameless.name == f"{user_module}:Nameless"  # labelled by its spec in metrics and logs
    with pytest.raises(PolicyNotFound, match=r"not a scorer policy: a class whose instances have score\(\)"):
        make_pick_plugin(f"{user_module}:make_first", {"anything": "goes"}, allow)  # a factory is never called


def test_nothing_outside_the_allowlist_is_imported_or_called(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             user_module: str) -> None:
    """Before: any importable callable was imported and called with the caller's params (os:system ran)."""
    marker = tmp_path / "ran"
    with pytest.raises(PolicyNotFound, match=r"module 'os' is not under a module prefix the operator allows; "
                                             r"allowed: built in capacity, equal; .*no module:attribute specs"):
        make_weight_policy("os:system", {"command": f"touch {marker}"})
    assert not marker.exists()
    # A module that would announce its import: refused on the string, never imported.
    (tmp_path / "loud_policy.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass P:\n    def score(self, r, c): ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PolicyNotFound, match=r"not under a module prefix"):
        make_pick_plugin("loud_policy:P", allow=PolicyAllowlist(("loud",)))  # a prefix is whole components
    assert not marker.exists() and "loud_policy" not in sys.modules
    # Allowed, a function is still not a policy: checked before it is called.
    with pytest.raises(PolicyNotFound, match=r"not a weight policy: a class whose instances have compute\(\)"):
        make_weight_policy("os:system", {"command": f"touch {marker}"}, PolicyAllowlist(("os",)))
    assert not marker.exists()
    with pytest.raises(PolicyNotFound, match=r"not a scorer policy"):
        make_pick_plugin("os.path:join", allow=PolicyAllowlist(("os",)))
    with pytest.raises(ValueError, match=r"not a dotted module name"):
        PolicyAllowlist(("os system",))


def test_the_allowlist_matches_whole_module_components() -> None:
    allow = PolicyAllowlist(("acme.lb",))
    assert allow.allows("acme.lb:P") and allow.allows("acme.lb.weights:P")
    assert not allow.allows("acme.lbx:P") and not allow.allows("acme:P") and not allow.allows("acme.l:P")
    assert not PolicyAllowlist().allows("acme.lb:P")


@pytest.mark.parametrize("spec, params, error, message", [
    ("no_such_package.policies:Policy", {}, PolicyNotFound, r"'no_such_package.policies' is not under a module"),
    ("examples.policies.nope:Policy", {}, PolicyNotFound, r"no module named 'examples.policies.nope'"),
    ("examples_evil:Policy", {}, PolicyNotFound, r"module 'examples_evil' is not under a module prefix"),
    ("examples.policies.canary_weights:Nope", {}, PolicyNotFound, r"module 'examples.policies.canary_weights' has no attribute 'Nope'"),
    (STICKY, {}, PolicyNotFound, r"is a scorer policy, not a weight policy"),
    ("json:JSONDecodeError", {}, PolicyNotFound, r"'json' is not under a module prefix"),
    ("fastest", {}, PolicyNotFound, r"unknown weight policy 'fastest'.*capacity, equal.*inferlb.policies"),
    ("not a spec:", {}, PolicyNotFound, r"unknown weight policy"),
    (CANARY, {}, BadPolicyParams, r"missing required parameter\(s\) endpoint"),
    (CANARY, {"endpoint": "a:1", "shar": 0.1}, BadPolicyParams, r"unknown parameter\(s\) shar; accepted: endpoint, share"),
    (CANARY, {"endpoint": "a:1", "share": "big"}, BadPolicyParams, r"'share': expected a finite number"),
    (CANARY, {"endpoint": "a:1", "share": float("nan")}, BadPolicyParams, r"'share': expected a finite number"),
    (CANARY, {"endpoint": "a:1", "share": 0.9}, BadPolicyParams, r"share must be in \(0, 0.5\]"),
    (CANARY, {"endpoint": 7}, BadPolicyParams, r"'endpoint': expected a string"),
    (CANARY, ["endpoint"], BadPolicyParams, r"params must be an object"),
    ("capacity", {"max_step": 1.0}, BadPolicyParams, r"max_step"),
])
def test_bad_weight_specs_say_what_is_wrong(spec: str, params: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        make_weight_policy(spec, params, EXAMPLES)  # type: ignore[arg-type]
    assert issubclass(error, ValueError)  # callers that catch ValueError keep working


def test_bad_user_modules_say_what_is_wrong(user_module: str, allow: PolicyAllowlist) -> None:
    with pytest.raises(PolicyNotFound, match=r"importing '.*_broken' failed: RuntimeError: boom at import"):
        make_weight_policy(f"{user_module}_broken:Policy", allow=allow)
    with pytest.raises(PolicyNotFound, match=r"json:JSONDecodeError is not a weight policy: class JSONDecodeError "
                                             r"has no compute\(\)"):
        make_weight_policy("json:JSONDecodeError", allow=PolicyAllowlist(("json",)))
    with pytest.raises(PolicyNotFound, match=r"NoMethods has no compute\(\)"):
        make_weight_policy(f"{user_module}:NoMethods", allow=allow)
    with pytest.raises(BadPolicyParams, match=r"unexpected keyword argument 'speed'.*accepted: cap, floor"):
        make_weight_policy(f"{user_module}:DoubleWeight", {"speed": 2}, allow=allow)
    with pytest.raises(BadPolicyParams, match=r"'boost': expected an integer, got 2.5"):
        make_weight_policy(f"{user_module}:Boost", {"boost": 2.5}, allow=allow)
    with pytest.raises(BadPolicyParams, match=r"'boost': expected an integer, got True"):
        make_weight_policy(f"{user_module}:Boost", {"boost": True}, allow=allow)
    with pytest.raises(BadPolicyParams, match=r"ready-made instance and takes no parameters"):
        make_pick_plugin(f"{user_module}:ready_made", {"x": 1}, allow=allow)
    with pytest.raises(PolicyNotFound, match=r"is a weight policy, not a scorer policy"):
        make_pick_plugin(f"{user_module}:Boost", allow=allow)
    with pytest.raises(PolicyNotFound, match=r"pick policy 'nope' is unknown; allowed: built in least_completion_time"):
        make_pick_policy("nope")
    with pytest.raises(BadPolicyParams, match=r"least_completion_time'?: parameter 'd' must be >= 1"):
        make_pick_policy("least_completion_time", {"d": 0})


# --- entry points ---------------------------------------------------------------------------------


def test_policies_load_by_entry_point_name(entry_points: str) -> None:
    double = make_weight_policy("my_double", {"cap": 120})
    assert double.compute(fleet("a:1")) == {"a:1": 120}
    assert make_weight_policy("my_boost", {"boost": 4}).params.boost == 4
    first = make_pick_plugin("my_first")
    assert isinstance(first, GuardedPlugin) and first.name == "first"
    sticky = make_pick_plugin("my_sticky", {"load_factor": 3})
    assert sticky.params.load_factor == 3.0
    # Filters and admit plugins load by entry-point name the same way, each in its own step.
    chain = PluginRegistry().build("least_completion_time", {
        "filters": [{"plugin": "my_canary", "params": {"endpoint": "10.0.0.1:8000", "share": 0.1}}],
        "admit": [{"plugin": "my_shed"}]})
    canary, shed = chain.filters[-1], chain.admit[-1]
    assert isinstance(canary, GuardedPlugin) and canary.step == "filter" and canary.name == "canary"
    assert canary.params.share == 0.1
    assert isinstance(shed, GuardedPlugin) and shed.step == "admit" and shed.name == "shed"
    with pytest.raises(PolicyNotFound, match=r"unknown plugin 'my_canary'"):  # a filter is not a scorer
        make_pick_plugin("my_canary", {"endpoint": "10.0.0.1:8000"})
    # A built-in name always means the built-in.
    assert isinstance(make_weight_policy("capacity"), CapacityWeightPolicy)


def test_entry_point_errors_are_clear(entry_points: str) -> None:
    with pytest.raises(PolicyNotFound, match=r"entry point 'my_first' .* declares kind='scorer', not 'weight'"):
        make_weight_policy("my_first")
    with pytest.raises(PolicyNotFound, match=r"entry point 'not_loadable' .* failed to load: ModuleNotFoundError"):
        make_weight_policy("not_loadable")
    with pytest.raises(PolicyNotFound, match=r"entry point 'no_kind' .* declares kind=None"):
        make_weight_policy("no_kind")
    with pytest.raises(BadPolicyParams, match=r"weight policy 'my_boost': unknown parameter\(s\) turbo"):
        make_weight_policy("my_boost", {"turbo": 1})


def test_descriptions_list_builtins_and_entry_points_with_schemas(entry_points: str) -> None:
    weight = {d["name"]: d for d in WeightPolicyRegistry().describe()}
    assert list(weight)[:2] == ["capacity", "equal"]
    assert weight["capacity"]["source"] == "builtin"
    assert weight["capacity"]["params_schema"]["additionalProperties"] is False
    assert weight["capacity"]["params_schema"]["properties"]["max_step"]["default"] == 1.5
    assert weight["my_boost"]["source"] == "entry_point"
    assert weight["my_boost"]["summary"] == "A weight policy with a Params dataclass."
    assert weight["my_boost"]["params_schema"]["properties"]["boost"] == {"default": 2, "title": "Boost",
                                                                           "type": "integer"}
    assert weight["my_double"]["params_schema"]["properties"]["cap"] == {"type": "integer", "default": 1000}
    assert {"my_first", "my_sticky", "my_canary", "my_shed", "not_loadable", "no_kind"}.isdisjoint(weight)
    pick = {d["name"]: d for d in PluginRegistry().describe()}
    assert {"least_completion_time", "round_robin", "least_outstanding", "p2c_tokens"} <= set(pick)
    assert pick["least_completion_time"]["params_schema"]["properties"]["d"]["default"] == 4
    assert pick["my_sticky"]["params_schema"]["properties"]["load_factor"]["default"] == 1.25
    assert pick["least_completion_time"]["kind"] == "pick" and pick["least_completion_time"]["source"] == "builtin"
    assert pick["completion_time"]["kind"] == "scorer" and pick["my_first"]["kind"] == "scorer"
    assert pick["rotate"]["kind"] == "filter" and pick["max_score"]["kind"] == "picker"
    assert pick["my_canary"]["kind"] == "filter" and pick["my_canary"]["source"] == "entry_point"
    assert pick["my_canary"]["params_schema"]["required"] == ["endpoint"]
    assert pick["my_shed"]["kind"] == "admit" and pick["my_shed"]["summary"].startswith("Sheds nothing")
    # Entry-point plugins can be listed without ext_proc (the control plane checks names this way).
    assert [d["name"] for d in plugins.describe_entry_points("scorer")] == ["my_first", "my_sticky"]
    assert [d["name"] for d in plugins.describe_entry_points("filter")] == ["my_canary"]
    assert [d["name"] for d in plugins.describe_entry_points("admit")] == ["my_shed"]
    json.dumps([*weight.values(), *pick.values()])  # all JSON


def test_a_spec_describes_itself() -> None:
    described = plugins.describe("weight", CANARY, plugins.resolve("weight", CANARY, EXAMPLES)[0], "spec")
    assert described["params_schema"]["required"] == ["endpoint"]
    assert described["summary"].startswith("One canary worker at a fixed share")


# --- the services stay apart ----------------------------------------------------------------------


@pytest.mark.subprocess
def test_loading_keeps_the_services_apart() -> None:
    """The control plane may import a pick policy's module (to describe it) without importing ext_proc."""
    code = textwrap.dedent(f"""
        import sys
        import control_plane.policies.registry, control_plane.controller
        from inferlb_runtime import plugins
        allow = plugins.PolicyAllowlist(("examples",))
        plugins.describe("scorer", {STICKY!r}, plugins.resolve("scorer", {STICKY!r}, allow)[0], "spec")
        assert not [m for m in sys.modules if m.split(".")[0] == "ext_proc"], "control plane imported ext_proc"
    """)
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
    code = textwrap.dedent("""
        import sys
        import ext_proc.pick.registry, ext_proc.server, ext_proc.metrics
        assert not [m for m in sys.modules if m.split(".")[0] == "control_plane"], "ext_proc imported control_plane"
    """)
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


@pytest.mark.subprocess
def test_the_control_plane_command_takes_a_spec_and_refuses_bad_params() -> None:
    bad = subprocess.run([sys.executable, "-m", "control_plane", "--weight-policy", CANARY,
                          "--allow-policy-module", "examples.policies"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "missing required parameter(s) endpoint" in bad.stderr
    refused = subprocess.run([sys.executable, "-m", "control_plane", "--weight-policy", CANARY], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "is not under a module prefix the operator allows" in refused.stderr
