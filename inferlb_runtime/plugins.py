"""Loading user policies: ``module:attribute`` specs and the ``inferlb.policies`` entry-point group.

Both services use this module (it imports neither of them): the control plane
for weight policies, ext_proc for the plugins of its pick chain.

**Only what the operator installed can be named.** A policy name comes from
the admin API or from EDS metadata, so it is untrusted: it may name an entry
point of the ``inferlb.policies`` group (installed by the operator), or a
``module:attribute`` spec whose module lies under a prefix the operator's
:class:`PolicyAllowlist` names (none by default). The spec string is checked
before anything is imported; the attribute path may not pass through a
module, and a class must be defined under an allowed prefix (not imported
into one), so a spec cannot reach past the modules the operator named. The
object is checked before anything is constructed or called: a class whose
instances have the kind's method, or such an instance. A function such as
``os:system`` is never called.

What it knows of a policy is duck-typed:

* **kind**: ``"weight"`` (has ``compute(view)``: the control plane), or a
  step of ext_proc's pick chain: ``"admit"`` (has ``admit``), ``"filter"``
  (has ``filter``) or ``"scorer"`` (has ``score``). An entry point's object
  must declare it as a ``kind`` attribute (that is how one group serves both
  services); a ``module:attribute`` spec may.
* **construction**: the object is a class. If it has a ``Params``
  attribute that is a dataclass, the raw parameters are validated into it
  (known names, right types; the dataclass's own ``__post_init__`` checks
  ranges) and it is constructed with that one value; otherwise with the
  parameters as keywords, checked against its signature. An object that
  already is a policy instance is used as is (no parameters).

Every failure is a ``ValueError`` with a message an operator can act on:
``PolicyNotFound`` (unknown name, module or attribute, not a policy of that
kind, not allowed) or ``BadPolicyParams`` (unknown or ill-typed parameters, a
range check).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import logging
import math
import re
import time
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

GROUP = "inferlb.policies"
Kind = Literal["weight", "admit", "filter", "scorer", "stage"]
# The method that makes an object a plugin of each kind: a control-plane weight policy, a step of ext_proc's
# pick chain (inferlb_runtime/pick_chain.py), or an operator's request stage in ext_proc (ext_proc/stages/).
METHODS: Mapping[str, str] = {"weight": "compute", "admit": "admit", "filter": "filter", "scorer": "score",
                              "stage": "on_request"}

_IDENT = r"[A-Za-z_]\w*"
SPEC = re.compile(rf"^{_IDENT}(?:\.{_IDENT})*:{_IDENT}(?:\.{_IDENT})*$")
_MODULE = re.compile(rf"^{_IDENT}(?:\.{_IDENT})*$")

log = logging.getLogger("inferlb.plugins")


class PolicyNotFound(ValueError):
    """The name or spec does not lead to a policy of the wanted kind (an HTTP 400)."""


class BadPolicyParams(ValueError):
    """The policy exists; its parameters are wrong (an HTTP 422)."""


@dataclass(frozen=True)
class PolicyAllowlist:
    """The ``module:attribute`` policies the operator allows: those whose module is one of
    ``module_prefixes`` or lies under one, by whole dotted components (``acme.lb`` allows ``acme.lb`` and
    ``acme.lb.weights``, not ``acme.lbx``). Empty, the default: no spec is allowed. Entry points of the
    ``inferlb.policies`` group are always allowed (installing a package is the operator's act)."""

    module_prefixes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for prefix in self.module_prefixes:
            if not isinstance(prefix, str) or not _MODULE.match(prefix):
                raise ValueError(f"policy module prefix {prefix!r} is not a dotted module name (e.g. acme.policies)")

    def allows(self, spec: str) -> bool:
        return self.allows_module(spec.split(":", 1)[0])

    def allows_module(self, module: str) -> bool:
        return any(module == p or module.startswith(p + ".") for p in self.module_prefixes)

    def describe(self) -> str:
        if not self.module_prefixes:
            return "no module:attribute specs (the operator allows none)"
        return f"module:attribute specs under {', '.join(self.module_prefixes)}"


def is_spec(name: object) -> bool:
    """``package.module:attribute`` (the attribute may be dotted: ``module:Class.factory``)."""
    return isinstance(name, str) and SPEC.match(name) is not None


# --- objects --------------------------------------------------------------------------------------


def load_object(spec: str) -> Any:
    """Import ``module`` and return ``attribute`` of ``module:attribute``; ``PolicyNotFound`` saying what failed
    (also when the attribute path passes through a module: the module part alone says where code comes from)."""
    if not is_spec(spec):
        raise PolicyNotFound(f"{spec!r} is not a module:attribute spec (for example mypkg.policies:MyPolicy)")
    module_name, attribute = spec.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise PolicyNotFound(f"{spec}: no module named {exc.name!r} (is it installed, or on PYTHONPATH?)") \
                from None
        raise PolicyNotFound(f"{spec}: importing {module_name!r} failed: {exc}") from None
    except Exception as exc:  # a syntax error, or the module raising at import
        raise PolicyNotFound(f"{spec}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from None
    obj: Any = module
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PolicyNotFound(f"{spec}: module {module_name!r} has no attribute {attribute!r}") from None
        if isinstance(obj, types.ModuleType):  # mypkg:os.system would leave the module the allowlist checked
            raise PolicyNotFound(f"{spec}: {part!r} is a module; name a module before the colon, an attribute "
                                 "after it")
    return obj


def _declared_kind(obj: Any) -> str | None:
    kind = getattr(obj, "kind", None)
    return kind if isinstance(kind, str) else None


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    return list(importlib.metadata.entry_points(group=GROUP))


def entry_point_objects(kind: Kind) -> dict[str, Any]:
    """Every loadable entry point of ``kind`` by name (the first of a duplicated name wins); broken ones are
    logged and skipped."""
    found: dict[str, Any] = {}
    for ep in _entry_points():
        if ep.name in found:
            continue
        try:
            obj = ep.load()
        except Exception as exc:
            log.warning("policy entry point cannot be loaded", extra={"entry_point": ep.name, "value": ep.value,
                                                                      "error": f"{type(exc).__name__}: {exc}"})
            continue
        if _declared_kind(obj) == kind:
            found[ep.name] = obj
    return found


def find_entry_point(kind: Kind, name: str) -> Any | None:
    """The object of entry point ``name`` of ``kind``; None when there is none by that name;
    ``PolicyNotFound`` when there is one but it does not load or is of another kind."""
    matches = [ep for ep in _entry_points() if ep.name == name]
    if not matches:
        return None
    errors = []
    for ep in matches:
        try:
            obj = ep.load()
        except Exception as exc:
            errors.append(f"entry point {name!r} ({ep.value}) failed to load: {type(exc).__name__}: {exc}")
            continue
        declared = _declared_kind(obj)
        if declared == kind:
            return obj
        errors.append(f"entry point {name!r} ({ep.value}) declares kind={declared!r}, not {kind!r}")
    raise PolicyNotFound("; ".join(errors))


def resolve(kind: Kind, name: str, allow: PolicyAllowlist = PolicyAllowlist()) -> tuple[Any, str]:
    """A user policy's object and where it came from (``"entry_point"`` or ``"spec"``); ``PolicyNotFound``.

    A spec outside ``allow`` is refused before its module is imported; the object is checked to be a
    policy of ``kind`` before anyone constructs or calls it.
    """
    if not isinstance(name, str) or not name:
        raise PolicyNotFound(f"a {kind} policy name must be a non-empty string, got {name!r}")
    if ":" not in name:
        obj = find_entry_point(kind, name)
        if obj is None:
            raise PolicyNotFound(f"unknown {kind} policy {name!r}")
        check_kind(kind, name, obj)
        return obj, "entry_point"
    if not is_spec(name):
        raise PolicyNotFound(f"unknown {kind} policy {name!r}")
    if not allow.allows(name):
        raise PolicyNotFound(f"{name}: module {name.split(':', 1)[0]!r} is not under a module prefix the operator "
                             "allows")
    obj = load_object(name)
    check_origin(name, obj, allow)
    check_kind(kind, name, obj)
    return obj, "spec"


def check_origin(spec: str, obj: Any, allow: PolicyAllowlist) -> None:
    """``PolicyNotFound`` unless a class ``spec`` leads to is defined under an allowed prefix, not merely
    imported into one (``mypkg:Popen`` after ``from subprocess import Popen``). An instance the allowed
    module made is its own choice and passes; :func:`load_object` already refused a path through a module."""
    if inspect.isclass(obj):
        defined_in = getattr(obj, "__module__", None)
        if not isinstance(defined_in, str) or not allow.allows_module(defined_in):
            raise PolicyNotFound(f"{spec}: class {obj.__name__} is defined in module {defined_in!r}, which is not "
                                 "under a module prefix the operator allows")


def allowed_names(kind: Kind, builtins: Iterable[str], allow: PolicyAllowlist) -> str:
    """What may be named as a ``kind`` policy, for the error an operator reads: built-ins, installed entry
    points, the allowed module prefixes."""
    entry_points = sorted(entry_point_objects(kind))
    return (f"allowed: built in {', '.join(sorted(builtins))}; entry points ({GROUP}) "
            f"{', '.join(entry_points) or 'none installed'}; {allow.describe()}")


def check_kind(kind: Kind, name: str, obj: Any) -> None:
    """``PolicyNotFound`` unless ``obj`` is a class whose instances have the kind's method, or such an instance
    (never a function, a module or a class of another kind: nothing here calls it to find out)."""
    method = METHODS[kind]
    declared = _declared_kind(obj)
    if declared is not None and declared != kind:
        raise PolicyNotFound(f"{name} is a {declared} policy, not a {kind} policy")
    if inspect.isclass(obj):
        if not callable(getattr(obj, method, None)):
            raise PolicyNotFound(f"{name} is not a {kind} policy: class {obj.__name__} has no {method}() method")
        return
    if isinstance(obj, types.ModuleType) or inspect.isroutine(obj) or not _is_policy(kind, obj):
        raise PolicyNotFound(f"{name} is not a {kind} policy: a class whose instances have {method}(), or such an "
                             f"instance, got {type(obj).__name__}")


def _is_policy(kind: Kind, obj: Any) -> bool:
    return not inspect.isclass(obj) and callable(getattr(obj, METHODS[kind], None))


# --- parameters -----------------------------------------------------------------------------------


def params_class(obj: Any) -> type | None:
    """The policy's frozen parameters dataclass, if it declares one as ``Params``."""
    cls = getattr(obj, "Params", None)
    return cls if inspect.isclass(cls) and dataclasses.is_dataclass(cls) else None


def _coerce(where: str, field: str, hint: Any, value: Any) -> Any:
    """``value`` (JSON-ish: xDS metadata numbers are doubles) as ``hint``; unknown hints pass it through."""
    what = f"{where}: parameter {field!r}"
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce_annotated(where, field, option, value)
            except BadPolicyParams as exc:
                errors.append(str(exc))
        raise BadPolicyParams(errors[0] if len(errors) == 1 else f"{what}: {value!r} matches none of {hint}")
    if origin is Literal:
        allowed = typing.get_args(hint)
        match = [a for a in allowed if a == value and isinstance(a, bool) == isinstance(value, bool)]
        if not match:
            raise BadPolicyParams(f"{what}: expected one of {', '.join(map(repr, allowed))}, got {value!r}")
        return match[0]
    if hint is bool:
        if not isinstance(value, bool):
            raise BadPolicyParams(f"{what}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                (isinstance(value, float) and not value.is_integer()):
            raise BadPolicyParams(f"{what}: expected an integer, got {value!r}")
        return int(value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise BadPolicyParams(f"{what}: expected a finite number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise BadPolicyParams(f"{what}: expected a string, got {value!r}")
        return value
    return value


def _hints(obj: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(obj, include_extras=True)
    except Exception:  # an annotation that does not resolve: no coercion, the policy checks itself
        return {}


_BOUNDS = (("ge", "must be >=", lambda v, b: v >= b), ("gt", "must be >", lambda v, b: v > b),
           ("le", "must be <=", lambda v, b: v <= b), ("lt", "must be <", lambda v, b: v < b))


def _check_bounds(where: str, field: str, constraints: Iterable[Any], value: Any) -> None:
    """``annotated_types`` bounds (``Annotated[int, Ge(0), Le(2)]``): declared once, checked here and shown
    in the JSON schema (pydantic reads the same annotations)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    for constraint in constraints:
        for attr, says, ok in _BOUNDS:
            bound = getattr(constraint, attr, None)
            if bound is not None and not ok(value, bound):
                raise BadPolicyParams(f"{where}: parameter {field!r} {says} {bound}, got {value!r}")


def _coerce_annotated(where: str, field: str, hint: Any, value: Any) -> Any:
    if typing.get_origin(hint) is typing.Annotated:
        base, *constraints = typing.get_args(hint)
        coerced = _coerce(where, field, base, value)
        _check_bounds(where, field, constraints, coerced)
        return coerced
    return _coerce(where, field, hint, value)


def parse_params(where: str, cls: type, raw: Mapping[str, Any] | None) -> Any:
    """``raw`` validated into the dataclass ``cls``: known names, right types, its own checks."""
    raw = _mapping(where, raw)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    names = [f.name for f in fields]
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise BadPolicyParams(f"{where}: unknown parameter(s) {', '.join(unknown)}; accepted: "
                              f"{', '.join(names) or 'none'}")
    missing = [f.name for f in fields if f.name not in raw and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise BadPolicyParams(f"{where}: missing required parameter(s) {', '.join(missing)}")
    hints = _hints(cls)
    values = {k: _coerce_annotated(where, k, hints.get(k, Any), v) for k, v in raw.items()}
    try:
        return cls(**values)
    except (ValueError, TypeError) as exc:
        raise BadPolicyParams(f"{where}: {exc}") from None


def _mapping(where: str, raw: Any) -> Mapping[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise BadPolicyParams(f"{where}: params must be an object, got {type(raw).__name__}")
    return raw


def _bind_keywords(where: str, obj: Any, raw: Mapping[str, Any]) -> None:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without a signature: let the call decide
        return
    try:
        signature.bind(**raw)
    except TypeError as exc:
        accepted = [p.name for p in signature.parameters.values()
                    if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        raise BadPolicyParams(f"{where}: {exc}; accepted: {', '.join(accepted) or 'none'}") from None


def validate_params(kind: Kind, name: str, obj: Any, raw: Mapping[str, Any] | None) -> Any:
    """Check ``raw`` against the policy's schema without building it; the parsed ``Params`` (or ``raw``)."""
    where = f"{kind} policy {name!r}"
    raw = _mapping(where, raw)
    cls = params_class(obj)
    if cls is not None:
        return parse_params(where, cls, raw)
    if _is_policy(kind, obj):
        if raw:
            raise BadPolicyParams(f"{where} is a ready-made instance and takes no parameters")
        return raw
    _bind_keywords(where, obj, raw)
    return raw


def instantiate(kind: Kind, name: str, obj: Any, raw: Mapping[str, Any] | None = None) -> Any:
    """Build the policy from its object and raw parameters; checks the result has the kind's method."""
    where = f"{kind} policy {name!r}"
    check_kind(kind, name, obj)  # never call what is not a policy class
    parsed = validate_params(kind, name, obj, raw)
    if _is_policy(kind, obj):
        return obj
    try:
        policy = obj(parsed) if params_class(obj) is not None else obj(**parsed)
    except (ValueError, TypeError) as exc:
        raise BadPolicyParams(f"{where}: {exc}") from None
    except Exception as exc:
        raise PolicyNotFound(f"{where}: constructing it failed: {type(exc).__name__}: {exc}") from None
    if not callable(getattr(policy, METHODS[kind], None)):
        raise PolicyNotFound(f"{where} is not a {kind} policy: {type(policy).__name__} has no "
                             f"{METHODS[kind]}() method")
    if not isinstance(getattr(policy, "name", None), str):
        try:  # metrics and logs label decisions with it
            policy.name = name
        except Exception:
            pass
    return policy


def build(kind: Kind, name: str, params: Mapping[str, Any] | None = None,
          allow: PolicyAllowlist = PolicyAllowlist()) -> Any:
    """A user policy (entry point or allowed ``module:attribute``) built with validated ``params``."""
    obj, _ = resolve(kind, name, allow)
    return instantiate(kind, name, obj, params)


# --- description (GET /v1/policy) -----------------------------------------------------------------

_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}


def dataclass_schema(cls: type) -> dict[str, Any]:
    """The JSON schema of a parameters dataclass (pydantic's), closed to unknown names."""
    try:
        from pydantic import TypeAdapter

        schema = TypeAdapter(cls).json_schema()
    except Exception:
        schema = {"type": "object", "properties": {f.name: {} for f in dataclasses.fields(cls) if f.init}}
    schema.pop("title", None)
    schema["additionalProperties"] = False
    return schema


def params_schema(obj: Any) -> dict[str, Any]:
    """A JSON schema of the policy's parameters: from its ``Params`` dataclass, else its signature."""
    cls = params_class(obj)
    if cls is not None:
        return dataclass_schema(cls)
    if any(_is_policy(kind, obj) for kind in METHODS):
        return {"type": "object", "properties": {}, "additionalProperties": False}
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return {"type": "object"}
    hints = _hints(obj.__init__ if inspect.isclass(obj) else obj)
    properties: dict[str, Any] = {}
    required = []
    extra = False
    for p in signature.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            extra = True
            continue
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            continue
        prop: dict[str, Any] = {}
        json_type = _JSON_TYPES.get(hints.get(p.name))
        if json_type:
            prop["type"] = json_type
        if p.default is p.empty:
            required.append(p.name)
        elif p.default is None or isinstance(p.default, (bool, int, float, str)):
            prop["default"] = p.default
        properties[p.name] = prop
    schema: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": extra}
    if required:
        schema["required"] = required
    return schema


def summary(obj: Any) -> str:
    """The first paragraph of the object's docstring, on one line."""
    doc = inspect.getdoc(obj) or ""
    return " ".join(doc.split("\n\n", 1)[0].split()) or getattr(obj, "__name__", type(obj).__name__)


def describe(kind: Kind, name: str, obj: Any, source: str) -> dict[str, Any]:
    """``{name, kind, summary, params_schema, source}`` of one policy."""
    return {"name": name, "kind": kind, "summary": summary(obj), "params_schema": params_schema(obj),
            "source": source}


def describe_entry_points(kind: Kind) -> list[dict[str, Any]]:
    """Every registered policy of ``kind`` (importing their modules), sorted by name."""
    return [describe(kind, name, obj, "entry_point") for name, obj in sorted(entry_point_objects(kind).items())]


# --- containment helpers --------------------------------------------------------------------------


class LogLimiter:
    """At most one log line per key per ``interval_s``; counts what it held back in between."""

    def __init__(self, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last: dict[Any, float] = {}
        self._held: dict[Any, int] = {}

    def allow(self, key: Any) -> int | None:
        """None: stay quiet; else the number of occurrences held back since the last line (log now)."""
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._held[key] = self._held.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._held.pop(key, 0)


class FailureStreak:
    """A contained policy's failure record: counts per reason, reports to an observer,
    suspends the policy after ``max_consecutive`` failures in a row for ``cooldown_s``,
    and logs at most once per reason per interval.

    Shared by the control plane's weight-policy guard and ext_proc's pick-policy wrapper.
    """

    def __init__(self, name: str, *, what: str, max_consecutive: int, cooldown_s: float, log_interval_s: float,
                 clock: Callable[[], float], logger: logging.Logger) -> None:
        self.name = name
        self.what = what  # "weight" or "pick", for the log lines
        self.max_consecutive = max_consecutive
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._log = LogLimiter(log_interval_s, clock)
        self._logger = logger
        self.failures: dict[str, int] = {}  # reason -> count (also sent to the observer)
        self.consecutive = 0
        self.suspended_until = -math.inf

    @property
    def suspended(self) -> bool:
        return self._clock() < self.suspended_until

    def succeeded(self) -> None:
        self.consecutive = 0

    def failed(self, reason: str, detail: str, report: Callable[[str, str], None] | None, message: str) -> None:
        """Record one failure; ``message`` is the log line when this reason may be logged again."""
        self.failures[reason] = self.failures.get(reason, 0) + 1
        if report is not None:
            try:
                report(self.name, reason)
            except Exception:
                self._logger.exception("policy failure observer failed")
        self.consecutive += 1
        suspend = self.consecutive >= self.max_consecutive
        if suspend:
            self.consecutive = 0
            self.suspended_until = self._clock() + self.cooldown_s
        held = self._log.allow(reason)
        if held is not None:
            self._logger.error(message, extra={"policy": self.name, "reason": reason, "detail": detail,
                                               "similar_failures_not_logged": held,
                                               "suspended_for_s": self.cooldown_s if suspend else 0})
        elif suspend and self._log.allow(("suspended",)) is not None:
            self._logger.error(f"{self.what} policy suspended after failing in a row; the default policy decides",
                               extra={"policy": self.name, "reason": reason, "suspended_for_s": self.cooldown_s})


def describe_exception(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


__all__ = ["GROUP", "BadPolicyParams", "FailureStreak", "LogLimiter", "PolicyAllowlist", "PolicyNotFound", "build",
           "allowed_names", "check_kind", "check_origin", "dataclass_schema", "describe",
           "describe_entry_points", "entry_point_objects", "find_entry_point", "instantiate", "is_spec",
           "load_object", "params_class", "params_schema", "parse_params", "resolve", "summary",
           "validate_params"]
