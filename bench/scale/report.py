"""Tables (markdown) and plots (matplotlib, Agg) of the simulation's summaries."""

from __future__ import annotations

import math
from pathlib import Path

COLUMNS = (  # key, header, format
    ("design", "design", "{}"), ("peers", "peers", "{}"), ("p_fail", "fail/round", "{:.0%}"),
    ("round_s_median", "round s (median)", "{:.1f}"), ("round_s_p90", "p90", "{:.1f}"),
    ("applied", "spans applied", "{:.3f}"), ("all_spans", "P(all spans)", "{:.2f}"),
    ("sent_mb", "MB sent/peer/round", "{:.1f}"), ("utilization", "utilization", "{:.1%}"),
    ("partners_max", "partners/peer (max)", "{:.0f}"), ("streams_max", "streams/peer (max)", "{:.0f}"),
    ("partners_per_level", "partners per level", "{:.0f}"), ("matchmaking_s", "matchmaking s (median)", "{:.1f}"),
    ("group", "largest group", "{:.0f}"), ("levels", "levels", "{}"), ("exposure", "(1-p)^M", "{:.2f}"),
    ("status", "round statuses", "{}"),
)


def fmt(key: str, value, pattern: str) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "-"
    if key == "status":
        return ", ".join(f"{k} {v}" for k, v in value.items())
    return pattern.format(value)


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(h for _, h, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(k, r[k], f) for k, _, f in COLUMNS) + " |")
    return "\n".join(lines)


def largest_at(rows: list[dict], design: str, p_fail: float, links: str, goal: float = 0.95) -> int:
    """The largest simulated size whose utilization meets ``goal`` with every smaller size meeting it too (0: none)."""
    best = 0
    for r in sorted((r for r in rows if r["design"] == design and r["p_fail"] == p_fail and r["links"] == links),
                    key=lambda r: r["peers"]):
        if r["utilization"] < goal or r["applied"] < 0.5:
            break
        best = r["peers"]
    return best


def plots(rows: list[dict], out_dir: Path, prefix: str = "scale") -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    styles = {"flat": ("tab:red", "o"), "bounded": ("tab:blue", "s")}
    series = sorted({(r["design"], r["p_fail"], r["links"]) for r in rows})
    made = []
    panels = (("utilization", "compute utilization", (0, 1.05)), ("applied", "share of spans applied", (0, 1.05)),
              ("round_s_median", "round wall time s (median)", None), ("matchmaking_s", "matchmaking s (median)", None))
    fig, axes = plt.subplots(2, 2, figsize=(9, 6.5))
    for ax, (key, label, ylim) in zip(axes.ravel(), panels):
        for design, p, links in series:
            # a round that applies nothing (GroupError) has no utilization worth plotting
            pts = sorted((r["peers"], r[key] if key != "utilization" or r["applied"] >= 0.5 else math.nan)
                         for r in rows if (r["design"], r["p_fail"], r["links"]) == (design, p, links))
            color, marker = styles.get(design, ("gray", "x"))
            dash = {0.0: ":", 0.01: "-", 0.05: "--"}.get(p, "-.")
            ax.plot([x for x, _ in pts], [y for _, y in pts], dash, color=color, marker=marker,
                    alpha=1 if links != "home" else 0.45, label=f"{design} p={p:.0%} {links}")
        if key == "utilization":
            ax.axhline(0.95, color="k", lw=0.6)
        ax.set_xscale("log")
        ax.set_xlabel("peers")
        ax.set_ylabel(label)
        if ylim:
            ax.set_ylim(*ylim)
    axes[0, 0].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    path = out_dir / f"{prefix}-rounds.png"
    fig.savefig(path, dpi=70)
    plt.close(fig)
    made.append(path)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for design in ("flat", "bounded"):
        pts = sorted({(r["peers"], r["partners_max"], r["partners_per_level"]) for r in rows if r["design"] == design
                      and r["links"] == "fixed:100" and r["p_fail"] == 0.0})
        color, marker = styles[design]
        axes[0].plot([x for x, _, _ in pts], [y for _, y, _ in pts], color=color, marker=marker,
                     label=f"{design}: all levels")
        if design == "bounded":
            axes[0].plot([x for x, _, _ in pts], [z for _, _, z in pts], ":", color=color, marker=marker,
                         label="bounded: per level")
    axes[0].set(xscale="log", yscale="log", xlabel="peers", ylabel="distinct partners per peer (max)")
    axes[0].legend(fontsize=7)
    sizes = [16, 32, 64, 128, 256, 512, 1000]
    for p, dash in ((0.01, "-"), (0.05, "--")):
        axes[1].plot(sizes, [(1 - p) ** m for m in sizes], dash, color="tab:red", label=f"(1-p)^M, p={p:.0%}")
        pts = sorted((r["peers"], r["all_spans"]) for r in rows if r["design"] == "flat" and r["p_fail"] == p
                     and r["links"] == "fixed:100")
        axes[1].plot([x for x, _ in pts], [y for _, y in pts], dash, color="k", marker="o", ms=3,
                     label=f"simulated P(all spans), flat, p={p:.0%}")
    axes[1].set(xscale="log", xlabel="group size M", ylabel="P(every span of a round)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / f"{prefix}-exposure.png"
    fig.savefig(path, dpi=70)
    plt.close(fig)
    made.append(path)
    return made
