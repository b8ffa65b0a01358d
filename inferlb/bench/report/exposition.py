"""Reading the services' Prometheus text expositions in the benches: one metric summed by one label.

Why one helper: the benches ask ext_proc's ``/metrics`` the same question again and again (decisions by
policy, sheds by step, policy switches by result), and each asking wrote the parsing loop again.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def sums_by_label(metrics_text: str, sample_name: str, label: str) -> dict[str, float]:
    """``sample_name``'s samples summed by the value of ``label`` ("?" when a sample lacks it)."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == sample_name:
                key = sample.labels.get(label, "?")
                sums[key] = sums.get(key, 0.0) + sample.value
    return sums
