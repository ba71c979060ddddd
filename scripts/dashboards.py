"""Generate the chart's operator dashboard (charts/shardwise/dashboards/shardwise-operator.json)
with grafana-foundation-sdk, so the JSON is well-formed by construction.

    .venv/bin/python scripts/dashboards.py          # write the JSON
    .venv/bin/python scripts/dashboards.py --check  # exit 1 when the committed JSON differs

tests/test_observability_dashboards.py checks that the committed file equals this
output and that every query names only metrics the operator or the workers export (or a
recording rule of charts/shardwise/rules/shardwise-alerts.yaml).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import (
    bargauge,
    common,
    dashboard,
    prometheus,
    stat,
    timeseries,
)
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (
    BarGaugeDisplayMode,
    VizOrientation,
)
from grafana_foundation_sdk.models.dashboard import (
    DataSourceRef,
    DynamicConfigValue,
    GridPos,
    VariableRefresh,
)

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "charts" / "shardwise" / "dashboards" / "shardwise-operator.json"
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = 'namespace="$namespace", job="$job"'


def query(expr: str, legend: str = "", ref: str = "A", instant: bool = False) -> Any:
    q = prometheus.Dataquery().expr(expr).ref_id(ref).datasource(DS)
    if legend:
        q = q.legend_format(legend)
    if instant:
        q = q.instant()
    return q


def pos(x: int, y: int, w: int, h: int) -> GridPos:
    return GridPos(h=h, w=w, x=x, y=y)


def build() -> dict[str, Any]:
    """The dashboard as a JSON-ready dict."""
    per_rank = (
        bargauge.Panel()
        .title("Embedding cost per rank: predicted vs measured")
        .description(
            "Per GPU (rank): the plan's predicted cost (operator) beside the workers' "
            "measured cost, per iteration. A rank's cost counts every shard it holds: its "
            "slices of row-wise tables and its copies of data-parallel ones too, with their "
            "collectives (reduce-scatter, all-gather, gradient all-reduce)."
        )
        .datasource(DS)
        .unit("s")
        .min(0)
        .display_mode(BarGaugeDisplayMode.GRADIENT)
        .orientation(VizOrientation.HORIZONTAL)
        .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .with_target(
            query(
                f'shardwise_predicted_embedding_cost_seconds{{{SEL}, phase="total"}}',
                "rank {{rank}} predicted",
                "A",
                instant=True,
            )
        )
        .with_target(
            query(
                f'max by (rank) (shardwise_embedding_cost_seconds{{{SEL}, phase="total"}})',
                "rank {{rank}} measured",
                "B",
                instant=True,
            )
        )
        .grid_pos(pos(0, 0, 12, 10))
    )
    ratio = (
        timeseries.Panel()
        .title("Measured / predicted per rank")
        .description("Above 1.5 for 30 minutes fires ShardwiseCostModelStale: re-profile.")
        .datasource(DS)
        .unit("none")
        .with_target(
            query(
                f"shardwise:embedding_cost_measured_over_predicted:ratio{{{SEL}}}",
                "rank {{rank}}",
            )
        )
        .grid_pos(pos(12, 0, 12, 10))
    )
    imbalance = (
        timeseries.Panel()
        .title("Imbalance over time (1 - mean/max)")
        .datasource(DS)
        .unit("percentunit")
        .min(0)
        .max(1)
        .with_target(query(f"shardwise_plan_imbalance_ratio{{{SEL}}}", "predicted (plan)", "A"))
        .with_target(query(f"shardwise:embedding_cost_imbalance:ratio{{{SEL}}}", "measured", "B"))
        .grid_pos(pos(0, 10, 12, 8))
    )
    planning = (
        timeseries.Panel()
        .title("Planning time")
        .datasource(DS)
        .unit("s")
        .with_target(
            query(
                "histogram_quantile(0.9, sum by (le) "
                f"(rate(shardwise_planning_duration_seconds_bucket{{{SEL}}}[1h])))",
                "p90 over 1h",
                "A",
            )
        )
        .with_target(
            query(
                f"rate(shardwise_planning_duration_seconds_sum{{{SEL}}}[1h]) / "
                f"rate(shardwise_planning_duration_seconds_count{{{SEL}}}[1h])",
                "mean over 1h",
                "B",
            )
        )
        .grid_pos(pos(12, 10, 12, 8))
    )
    freshness = (
        stat.Panel()
        .title("Cost model age per GPU type")
        .description("Profiling freshness: compare with the jobs' spec.profiling.maxAge.")
        .datasource(DS)
        .unit("s")
        .with_target(
            query(
                'shardwise_cost_model_age_seconds{namespace="$namespace"}',
                "{{gpu_type}}",
                instant=True,
            )
        )
        .grid_pos(pos(0, 18, 8, 6))
    )
    profiling = (
        timeseries.Panel()
        .title("Profiling runs and failures (per hour)")
        .datasource(DS)
        .unit("short")
        .with_target(
            query(
                "sum by (gpu_type) "
                '(increase(shardwise_profiling_runs_total{namespace="$namespace"}[1h]))',
                "{{gpu_type}} runs",
                "A",
            )
        )
        .with_target(
            query(
                "sum by (gpu_type) "
                '(increase(shardwise_profiling_failures_total{namespace="$namespace"}[1h]))',
                "{{gpu_type}} failures",
                "B",
            )
        )
        .grid_pos(pos(8, 18, 8, 6))
    )
    phases = (
        timeseries.Panel()
        .title("DLRMJobs by phase")
        .datasource(DS)
        .unit("short")
        .with_target(
            query(
                'sum by (phase) (shardwise_job_phase{namespace="$namespace"})',
                "{{phase}}",
            )
        )
        .grid_pos(pos(16, 18, 8, 6))
    )
    errors = (
        timeseries.Panel()
        .title("Reconcile errors and reshards (per 5m)")
        .datasource(DS)
        .unit("short")
        .with_target(
            query(
                f"increase(shardwise_reconcile_errors_total{{{SEL}}}[5m])",
                "reconcile errors",
                "A",
            )
        )
        .with_target(
            query(
                f"sum by (reason) (increase(shardwise_reshards_total{{{SEL}}}[5m]))",
                "reshards: {{reason}}",
                "B",
            )
        )
        .grid_pos(pos(0, 24, 24, 6))
    )
    live = (
        timeseries.Panel()
        .title("Measured imbalance (max/mean) and predicted reshard gain")
        .description(
            "From the workers' live summary: the slowest rank's embedding compute over the "
            "ranks' mean (1: even; above 1.3 for 15 minutes fires ShardwiseJobImbalanced), "
            "the predicted gain of the reshard-on-imbalance loop's last re-plan and its "
            "decisions per 15 minutes (right axis)."
        )
        .datasource(DS)
        .unit("none")
        .with_target(query(f"shardwise_measured_imbalance{{{SEL}}}", "measured max/mean", "A"))
        .with_target(
            query(f"shardwise_predicted_reshard_gain{{{SEL}}}", "predicted reshard gain", "B")
        )
        .with_target(
            query(
                f"sum by (decision) (increase(shardwise_imbalance_decisions_total{{{SEL}}}[15m]))",
                "decisions: {{decision}}",
                "C",
            )
        )
        .override_by_query(
            "B",
            [
                DynamicConfigValue(id_val="unit", value="percentunit"),
                DynamicConfigValue(id_val="custom.axisPlacement", value="right"),
            ],
        )
        .override_by_query(
            "C",
            [
                DynamicConfigValue(id_val="unit", value="short"),
                DynamicConfigValue(id_val="custom.axisPlacement", value="right"),
                DynamicConfigValue(id_val="custom.drawStyle", value="bars"),
            ],
        )
        .grid_pos(pos(0, 30, 24, 8))
    )
    kinds = (
        stat.Panel()
        .title("Tables by sharding kind")
        .description(
            "The current plan's tables per kind (status.plan.kinds): row_wise, "
            "table_row_wise and grid tables (larger than one GPU, or read hard enough to "
            "spread) put a slice on many GPUs, data_parallel ones a copy on every GPU."
        )
        .datasource(DS)
        .unit("short")
        .with_target(query(f"shardwise_plan_tables{{{SEL}}} > 0", "{{kind}}", instant=True))
        .grid_pos(pos(0, 38, 24, 4))
    )
    reshards = (
        dashboard.AnnotationQuery()
        .name("Reshards")
        .datasource(DS)
        .enable(True)
        .icon_color("orange")
        .expr(f"changes(shardwise_reshards_total{{{SEL}}}[2m]) > 0")
    )
    ns_var = (
        dashboard.QueryVariable("namespace")
        .label("Namespace")
        .datasource(DS)
        .query("label_values(shardwise_job_phase, namespace)")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
    )
    job_var = (
        dashboard.QueryVariable("job")
        .label("DLRMJob")
        .datasource(DS)
        .query('label_values(shardwise_job_phase{namespace="$namespace"}, job)')
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
    )
    board = (
        dashboard.Dashboard("Shardwise: plans, cost model and operator")
        .uid("shardwise-operator")
        .description(
            "Predicted vs measured embedding cost per rank, imbalance, planning time, "
            "profiling freshness, reshards, job phases, the reshard-on-imbalance loop and "
            "the plan's sharding kinds (docs/observability.md)."
        )
        .tags(["shardwise"])
        .editable()
        .refresh("30s")
        .time("now-6h", "now")
        .with_variable(
            dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus")
        )
        .with_variable(ns_var)
        .with_variable(job_var)
        .annotation(reshards)
        .with_panel(per_rank)
        .with_panel(ratio)
        .with_panel(imbalance)
        .with_panel(planning)
        .with_panel(freshness)
        .with_panel(profiling)
        .with_panel(phases)
        .with_panel(errors)
        .with_panel(live)
        .with_panel(kinds)
    )
    out: dict[str, Any] = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    return out


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description="Generate the chart's operator dashboard.")
    parser.add_argument("--check", action="store_true", help="fail when the file differs")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            sys.exit(f"{OUT} is out of date: run python scripts/dashboards.py")
        return
    OUT.write_text(text)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
