"""Render per-rank predicted vs measured embedding cost, as queried from a real
Prometheus, to a PNG (the dashboard's bar-gauge panel needs Grafana; this is the same
queries' data with matplotlib).

The data comes from tests/test_observability.py's real-Prometheus test:

    SHARDWISE_OBSERVABILITY_JSON=/tmp/obs.json .venv/bin/pytest \
        tests/test_observability.py -k real_prometheus
    .venv/bin/python scripts/render_metrics_png.py /tmp/obs.json \
        docs/observability-predicted-vs-measured.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def render(data: dict[str, Any], out: Path) -> None:
    """Bars per rank: predicted (operator) and measured (workers), with the ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    predicted = {int(k): float(v) for k, v in data["predicted"].items()}
    measured = {int(k): float(v) for k, v in data["measured"].items()}
    ratio = {int(k): float(v) for k, v in data["ratio"].items()}
    ranks = sorted(predicted)
    width = 0.38
    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=120)
    xs = list(range(len(ranks)))
    ax.bar(
        [x - width / 2 for x in xs],
        [1e3 * predicted[r] for r in ranks],
        width,
        label="predicted (shardwise_predicted_embedding_cost_seconds)",
        color="#7aa6d6",
    )
    bars = ax.bar(
        [x + width / 2 for x in xs],
        [1e3 * measured[r] for r in ranks],
        width,
        label="measured (shardwise_embedding_cost_seconds)",
        color="#e08a4c",
    )
    for bar, r in zip(bars, ranks, strict=True):
        ax.annotate(
            f"{ratio[r]:.2f}×",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=9,
            color="#b00020" if ratio[r] > 1.5 else "black",
        )
    ax.set_xticks(xs, [f"rank {r}" for r in ranks])
    ax.set_ylabel("embedding cost per iteration (ms)")
    ax.set_title(
        f"DLRMJob {data['namespace']}/{data['job']}: predicted vs measured per rank\n"
        f"(queried from Prometheus {data.get('prometheus', '')}; label: measured/predicted; "
        "> 1.5× fires ShardwiseCostModelStale)",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="upper left")
    ax.set_ylim(0, 1.25e3 * max([*predicted.values(), *measured.values()]))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", type=Path, help="JSON written by the real-Prometheus test")
    parser.add_argument(
        "out",
        type=Path,
        nargs="?",
        default=Path("docs/observability-predicted-vs-measured.png"),
    )
    args = parser.parse_args()
    render(json.loads(args.data.read_text()), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
