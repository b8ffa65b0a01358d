"""Every shell command in README.md and docs/*.md runs against the code as it is (no servers).

The checker is tests/docs_commands.py; the first tests feed it commands that must fail, so a checker
that silently passes everything fails here too.
"""

from __future__ import annotations

from pathlib import Path

from .docs_commands import ALLOWLIST, Command, broken_links, check, check_docs, commands_in, doc_files, split_commands


def errors_of(line: str) -> list[str]:
    return [error for words in split_commands(line) for error in check(Command("test", 1, tuple(words)))]


def test_a_stale_flag_or_subcommand_fails() -> None:
    assert errors_of("inferlb status --json") == []
    assert any("no flag --jsn" in e for e in errors_of("inferlb status --jsn"))
    assert any("no flag --workerz" in e for e in errors_of(".venv/bin/inferlb up --workerz 2"))
    assert any("no subcommand 'stauts'" in e for e in errors_of("inferlb stauts"))
    assert any("no flag --bogus" in e for e in errors_of("inferlb bench run --bogus 1"))
    assert any("no flag --sim-slot" in e for e in errors_of("python -m workers --simulate --sim-slot 2"))  # a prefix
    assert any("no flag --nope" in e for e in errors_of("python -m control_plane --nope"))
    assert any("no flag --nope" in e for e in errors_of("python -m ext_proc --nope"))
    assert any("invalid choice" in e for e in errors_of("inferlb up --dataplane haproxy"))  # the full parse
    assert errors_of("inferlb sim --scenario scenarios/overload.toml [--shed-slo-ms 0] ...") == []  # usage notation
    assert any("no flag --shed-slo" in e for e in errors_of("inferlb sim [--shed-slo 0]"))


def test_other_commands_are_checked_or_must_be_allowlisted() -> None:
    assert errors_of("make up && make test") == []
    assert any("no target 'upp'" in e for e in errors_of("make upp"))
    assert any("no such path in the repository: scenarios/nope.toml" in e
               for e in errors_of("inferlb bench run --scenario scenarios/nope.toml"))
    assert errors_of("inferlb bench run --scenario scenarios/default.toml --out docs/bench/new") == []
    assert any("python -m nomodule" in e for e in errors_of("python -m nomodule --x"))
    assert any("not in the allowlist" in e for e in errors_of("helm install inferlb"))
    assert errors_of("kubectl apply -k deploy/kubernetes") == []
    assert all(reason for reason in ALLOWLIST.values())


def test_curl_urls_name_routes_the_services_declare() -> None:
    assert errors_of("curl -s 127.0.0.1:8080/v1/endpoints/127.0.0.1:8101/weight -XPUT") == []
    assert errors_of("curl -s -XPOST http://127.0.0.1:8080/v1/rollouts/all-MiniLM-L6-v2/rollback") == []
    assert errors_of("curl -s http://127.0.0.1:10000/v1/embeddings -d '{\"input\": \"hi\"}'") == []
    assert any("no service declares the route /v1/endpointz" in e
               for e in errors_of("curl -s 127.0.0.1:8080/v1/endpointz"))
    assert any("no URL" in e for e in errors_of("curl -s"))


def test_commands_are_split_as_the_shell_would(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("text\n\n```sh\nT=$(cat .inferlb/admin-token); A=\"x\"\ncurl -s 127.0.0.1:8080/v1/policy \\\n"
                   "  -H \"$A\" | head  # a comment\nOTEL_X=1 inferlb up --simulate\n```\n\n```console\n"
                   "$ inferlb status\ninferlb stack: ...\n```\n\n```python\nimport os\n```\n")
    found = [(c.line, c.words[0]) for c in commands_in(doc, tmp_path)]
    assert found == [(5, "curl"), (5, "head"), (7, "inferlb"), (11, "inferlb")]  # $(...) is one unknown word


def test_an_unlabelled_block_is_read_when_it_holds_only_commands(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("```\ninferlb bench hogs   # a comment\n# a comment line\nmake up\n```\n\n"
                   "```\nclient -> Envoy :10000 -> worker\ninferlb up\n```\n")
    assert [c.words[0] for c in commands_in(doc, tmp_path)] == ["inferlb", "make"]  # not the diagram


def test_a_broken_link_fails(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# Top\n\n## A section: with (punctuation)\n\n"
                                        "[ok](docs/a.md#a-heading) [ok](#a-section-with-punctuation) "
                                        "[bad](docs/a.md#nope) [bad](docs/b.md)\n")
    (tmp_path / "docs" / "a.md").write_text("# A heading\n")
    assert broken_links(tmp_path) == ["README.md: (docs/a.md#nope): no heading #nope in docs/a.md",
                                      "README.md: (docs/b.md): no such file"]


def test_every_documented_command_matches_the_code() -> None:
    assert sum(len(commands_in(path)) for path in doc_files()) > 50, "the docs' commands were found"
    assert check_docs() == []


def test_every_link_between_the_docs_resolves() -> None:
    assert broken_links() == []


def test_every_python_example_in_the_docs_parses() -> None:
    import ast
    import re

    for path in doc_files():
        for block in re.findall(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M):
            ast.parse(block, filename=str(path))
