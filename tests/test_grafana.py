"""deploy/grafana: the alert rules pass ``promtool check rules``, fire on synthetic series and stay quiet
otherwise (``promtool test rules``), and the dashboard and the rules name only metrics the services export.

The metric names come from live processes (tests/exposition.py: the control plane, ext_proc, simulated workers
and Envoy after traffic, plus a real worker), Envoy's from its admin /stats/prometheus. Expressions are parsed
with promql-parser (Rust's promql-parser crate, the parser GreptimeDB uses), not by regex."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from .conftest import FIXTURES, ROOT, WorkerProcess
from .exposition import exercised_gateway, run_promtool, scrape
from .stack import Gateway, http

GRAFANA = ROOT / "deploy" / "grafana"
RULES = GRAFANA / "alerts.yml"
RULE_TESTS = GRAFANA / "alerts_test.yml"
DASHBOARD = GRAFANA / "inferlb-dashboard.json"
# Series Prometheus makes itself for every target, not any service's /metrics.
PROMETHEUS_SERIES = {"up"}
# Labels Prometheus attaches at scrape time.
TARGET_LABELS = {"job", "instance"}
# The series a family of each type writes (counters and gauges: their own name).
SERIES_OF_TYPE = {"histogram": ("_bucket", "_count", "_sum"), "summary": ("", "_count", "_sum")}


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> list[str]:
    """Every PromQL of the dashboard: panel targets and the query variables' label_values() selectors."""
    exprs = [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]
    for var in dashboard()["templating"]["list"]:
        if var["type"] == "query":
            match = re.fullmatch(r"label_values\((.+), *\w+\)", var["query"]["query"])
            assert match, f"variable {var['name']}: expected label_values(selector, label)"
            exprs.append(match.group(1))
    return exprs


def grafana_to_promql(expr: str) -> str:
    """Grafana's variables replaced as Grafana would: intervals by a duration, the rest (job, instance, model
    with All = ``.*``) by a regex that matches everything."""
    expr = re.sub(r"\$__(rate_interval|interval|range)\b", "5m", expr)
    return re.sub(r"\$\{?\w+\}?", ".*", expr)


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric name, label names matched) of every selector in ``expr``, by walking the parsed AST."""
    found: list[tuple[str, set[str]]] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            matchers = node.matchers.matchers
            name = node.name or next((m.value for m in matchers if m.name == "__name__"
                                      and m.op == promql_parser.MatchOp.Equal), None)
            assert name, f"a selector without a literal metric name in {expr!r}"
            found.append((name, {m.name for m in matchers} - {"__name__"}))

    promql_parser.walk(promql_parser.parse(expr), pre_visit=visit)
    return found


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with exercised_gateway(tmp_path_factory.mktemp("grafana"), "grafana") as gw:
        yield gw


def exposed_names(text: str) -> dict[str, set[str]]:
    """Sample name -> label names, as written on the wire. Names come from the text itself: the sample lines,
    and the ``# TYPE`` lines (a family without samples yet, a labelled counter nothing incremented, gives the
    names its type implies). prometheus_client's parser would do, but it adds ``_total`` to counters that lack
    it (Envoy's), so it only supplies the labels."""
    names: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            for suffix in SERIES_OF_TYPE.get(kind, ("",)):
                names.setdefault(name + suffix, set())
        elif line and not line.startswith("#"):
            names.setdefault(re.split(r"[{\s]", line, maxsplit=1)[0], set())
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name if s.name in names else s.name.removesuffix("_total")
            names[name].update(s.labels)
    return names


@pytest.fixture(scope="module")
def exported(gateway: Gateway, worker: WorkerProcess) -> dict[str, set[str]]:
    """What every component exposes: the control plane, ext_proc, a simulated and a real worker, Envoy."""
    with http() as client:
        assert client.post(f"{worker.url}/v1/embeddings", json={"input": "count me"}).status_code == 200
    texts = [scrape(f"{gateway.cp.admin_url}/metrics"), scrape(f"{gateway.ext_proc.metrics_url}/metrics"),
             scrape(f"{gateway.workers[0].url}/metrics"), scrape(f"{worker.url}/metrics"),
             scrape(f"{gateway.envoy.admin_url}/stats/prometheus")]
    names: dict[str, set[str]] = {}
    for text in texts:
        for name, labels in exposed_names(text).items():
            names.setdefault(name, set()).update(labels)
    return names


def test_exposed_names_are_the_wire_names() -> None:
    text = ("# TYPE envoy_rq counter\nenvoy_rq{envoy_cluster_name=\"workers\"} 3\n"
            "# TYPE x_total counter\n# TYPE h histogram\nh_bucket{le=\"+Inf\",model=\"m\"} 1\n")
    names = exposed_names(text)
    assert names["envoy_rq"] == {"envoy_cluster_name"} and "envoy_rq_total" not in names
    assert names["x_total"] == set()
    assert names["h_bucket"] == {"le", "model"} and {"h_count", "h_sum"} <= names.keys()


# --- the rules ------------------------------------------------------------------------------------------------


@pytest.mark.promtool
def test_the_rules_pass_promtool_check_rules() -> None:
    done = run_promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules())} rules found" in done.stdout


@pytest.mark.promtool
def test_each_alert_fires_on_its_synthetic_series_and_stays_quiet_otherwise() -> None:
    done = run_promtool("test", "rules", str(RULE_TESTS))
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_is_unit_tested_both_ways() -> None:
    """alerts_test.yml checks each alert quiet (an eval with no alert) and firing (an eval with one)."""
    quiet, firing = set(), set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for check in case["alert_rule_test"]:
            (firing if check["exp_alerts"] else quiet).add(check["alertname"])
    names = {r["alert"] for r in rules()}
    assert names - quiet == set() and names - firing == set(), (names - quiet, names - firing)


@pytest.mark.promtool
def test_the_rule_tests_can_fail(tmp_path: Path) -> None:
    """A rule that fires on the healthy value instead is caught by alerts_test.yml."""
    broken = RULES.read_text().replace("inferlb_cp_endpoint_healthy == 0", "inferlb_cp_endpoint_healthy == 1")
    assert broken != RULES.read_text()
    (tmp_path / "alerts.yml").write_text(broken)
    (tmp_path / "alerts_test.yml").write_text(RULE_TESTS.read_text())
    done = run_promtool("test", "rules", str(tmp_path / "alerts_test.yml"))
    assert done.returncode != 0
    assert "InferlbWorkerDown" in done.stdout + done.stderr


def test_every_alert_has_a_for_a_severity_and_a_runbook() -> None:
    for rule in rules():
        assert "for" in rule, rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert rule["annotations"]["summary"] and len(rule["annotations"]["description"]) > 80, rule["alert"]
    names = {r["alert"] for r in rules()}
    readme = (GRAFANA / "README.md").read_text()
    assert {n for n in names if f"`{n}`" not in readme} == set(), "every alert is explained in the README"
    required = {"InferlbWorkerDown", "InferlbP99OverSLO", "InferlbExtProcFailingOpen", "InferlbXdsNacks",
                "InferlbShedding"}
    assert required <= names


# --- the dashboard --------------------------------------------------------------------------------------------


def test_the_dashboard_is_a_grafana_dashboard_with_unique_panels() -> None:
    board = dashboard()
    assert board["schemaVersion"] >= 39 and board["uid"] and board["title"]
    panels = board["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert {"job", "instance"} <= variables.keys()
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
            assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & mine, f"{panel['title']} overlaps another panel"
        cells |= mine


def test_every_panel_query_filters_by_job_and_instance() -> None:
    for expr in (t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])):
        for name, labels in selectors(grafana_to_promql(expr)):
            assert TARGET_LABELS <= labels, f"{name} in {expr!r} is not filtered by $job and $instance"


# --- against what the services export ----------------------------------------------------------------------------


@pytest.mark.slow
def test_the_dashboard_and_the_rules_name_only_exported_metrics(exported: dict[str, set[str]]) -> None:
    exprs = [grafana_to_promql(e) for e in dashboard_exprs()] + [r["expr"] for r in rules()]
    referenced = {name for e in exprs for name, _ in selectors(e)}
    missing = referenced - exported.keys() - PROMETHEUS_SERIES
    assert not missing, f"not exported by any component: {sorted(missing)}"
    # Every family of the main areas is there, including Envoy's.
    for prefix in ("inferlb_cp_", "inferlb_ext_proc_", "inferlb_worker_", "inferlb_autoscale_", "envoy_cluster_",
                   "envoy_http_"):
        assert any(n.startswith(prefix) for n in referenced), prefix


@pytest.mark.slow
def test_the_labels_they_match_on_exist(exported: dict[str, set[str]]) -> None:
    """A label matcher on a label the metric does not have matches nothing, silently; checked where the live
    metric has samples to read its labels from."""
    exprs = [grafana_to_promql(e) for e in dashboard_exprs()] + [r["expr"] for r in rules()]
    wrong = set()
    for expr in exprs:
        for name, labels in selectors(expr):
            seen = exported.get(name)
            if seen:
                wrong |= {(name, label) for label in labels - TARGET_LABELS - seen}
    assert not wrong, sorted(wrong)


def test_the_name_check_sees_through_functions_and_operators() -> None:
    """The extraction the checks above rely on finds every selector (inside rate, aggregations, both sides of
    binary operators, subqueries), and Grafana's variables become valid PromQL."""
    expr = grafana_to_promql('histogram_quantile(0.99, sum by (le) (rate(a_bucket{job=~"$job"}[$__rate_interval])))'
                             ' / on () group_left b > 2 or max_over_time(c[10m:1m]) and {__name__="d", x="1"}')
    assert {n for n, _ in selectors(expr)} == {"a_bucket", "b", "c", "d"}
    assert ("d", {"x"}) in selectors(expr)
    with pytest.raises(ValueError):
        selectors("rate(a[5m")


# --- Prometheus configuration and the Compose override ---------------------------------------------------------


@pytest.mark.promtool
def test_the_example_prometheus_config_passes_promtool_and_loads_the_rules() -> None:
    done = run_promtool("check", "config", str(GRAFANA / "prometheus.yml"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 1 rule files found" in done.stdout


def test_the_monitoring_compose_file_is_valid_and_scrapes_the_stacks_services() -> None:
    """compose.yml validates against the Compose schema (tests/test_compose.py's fixture file), mounts files that
    exist, and prometheus.yml's targets are docker-compose.yml's services on the ports they expose."""
    overlay = yaml.safe_load((GRAFANA / "compose.yml").read_text())
    schema = json.loads((FIXTURES / "compose-spec.json").read_text())
    errors = [e.message for e in jsonschema.Draft7Validator(schema).iter_errors(overlay)]
    assert not errors, errors
    for service in overlay["services"].values():
        for volume in service.get("volumes", []):
            assert (ROOT / volume.split(":")[0]).exists(), volume
    stack = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    config = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())
    targets = [t for job in config["scrape_configs"] for sc in job.get("static_configs", []) for t in sc["targets"]]
    targets += [f"{name}:{sd['port']}" for job in config["scrape_configs"] for sd in job.get("dns_sd_configs", [])
                for name in sd["names"]]
    for target in targets:
        host, port = target.rsplit(":", 1)
        assert host in stack, target
        if host != "envoy":  # Envoy's admin port is not exposed (README: Scraping)
            assert port in stack[host]["expose"], target
    provider = yaml.safe_load((GRAFANA / "provisioning/dashboards/inferlb.yaml").read_text())["providers"][0]
    mounts = [v.split(":") for v in overlay["services"]["grafana"]["volumes"]]
    assert [f"{provider['options']['path']}/{DASHBOARD.name}", "ro"] in [m[1:] for m in mounts]
    datasource = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yaml").read_text())["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090" and "prometheus" in overlay["services"]
