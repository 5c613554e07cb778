"""The docs' figures, drawn from the results kept in the repository (docs/results/*.json).

Each results file holds the numbers of one table of docs/benchmarks.md (columns named as
the table's), with its command, machine and date; tests/test_figures.py checks them
against the table. The docs build (docs/conf.py) calls :func:`draw`, so a changed results
file redraws its figures into docs/_figures/ (not tracked). Each figure's function says
what it shows; docs/index.md, docs/choosing_a_method.md and docs/benchmarks.md show them.

  python -m benchmarks.figures                   # all figures into docs/_figures/
  python -m benchmarks.figures --out /tmp/figs --only demo_accuracy_vs_bytes
"""

from __future__ import annotations

import argparse
import io
import json
import os
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never a window (the docs build runs headless)
from matplotlib import pyplot as plt  # noqa: E402  (after the backend is chosen)
from matplotlib import ticker  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "results")
OUT = os.path.join(ROOT, "docs", "_figures")

# One colour and marker per method, the same in every figure; dense black.
_METHODS = (
  "dense", "dense_flat", "qsgd4", "qsgd2", "onebit", "dgc", "wangni", "mipd", "powersgd",
  "ef_signsgd", "onebit_adam", "diloco", "diloco_qsgd4", "sparseloco", "demo",
)  # fmt: skip
_COLORS = ("black", "dimgray", *plt.get_cmap("tab10").colors, "saddlebrown", "darkcyan", "crimson")
_MARKERS = ("*", "P", "o", "s", "^", "v", "D", "X", "<", ">", "h", "p", "d", "8", "H")
STYLE = {m: {"color": c, "marker": k} for m, c, k in zip(_METHODS, _COLORS, _MARKERS)}
RATE_LABELS = {100: "100 Mbit/s", 1000: "1 Gbit/s", 10000: "10 Gbit/s", None: "unthrottled"}


def load(results: str, name: str) -> dict[str, Any]:
  """A results file, checked for the fields the figures read."""
  path = os.path.join(results, name)
  if not os.path.exists(path):
    raise FileNotFoundError(
      f"{path}: missing. It holds the numbers of a table of docs/benchmarks.md; restore it "
      "from git, or copy the table's rows into it (see the other files there)."
    )
  with open(path, encoding="utf-8") as f:
    data = json.load(f)
  for field in ("section", "commands", "tables"):
    if field not in data:
      raise ValueError(f"{path}: no {field!r} field")
  return data


def _style(method: str) -> dict[str, Any]:
  base = method.removeprefix("flat_").removeprefix("two_level_")
  if base not in STYLE:
    raise ValueError(f"no style for method {method!r}: add it to benchmarks/figures.py")
  return STYLE[base]


def _figure(ncols: int, width: float = 6.4):
  fig, axes = plt.subplots(1, ncols, figsize=(width * ncols if ncols > 1 else width, 4.2))
  return fig, list(axes) if ncols > 1 else [axes]


def demo_accuracy_vs_bytes(results: str):
  """Test accuracy against bytes received per device per step (log): seed 0 filled,
  seed 1 hollow, joined; dense is the black star and the dotted line at its seed 0."""
  (table,) = load(results, "demo.json")["tables"]
  fig, (ax,) = _figure(1, width=7.0)
  for row in table["rows"]:
    m, x = row["method"], row["bytes recv/device/step"]
    s0, s1 = row["test acc (%), seed 0"], row["seed 1"]
    st = _style(m)
    ax.plot([x, x], [s0, s1], color=st["color"], lw=1, zorder=1)
    size = 13 if m == "dense" else 7
    ax.plot(x, s0, ls="", ms=size, label=m, **st)
    ax.plot(x, s1, ls="", ms=size, mfc="white", **st)
    if m == "dense":
      ax.axhline(s0, color="black", ls=":", lw=1, zorder=0)
  ax.set(xscale="log", xlabel="bytes received per device per step (log scale)")
  ax.set(ylabel="test accuracy (%)", title="MNIST-1D demo, 8 devices: filled seed 0, hollow seed 1")
  ax.legend(fontsize=8, ncol=2, loc="lower right")
  ax.grid(True, which="both", alpha=0.3)
  return fig


def method_map(results: str):
  """Left: the demo, accuracy gap to dense (mean of the two seeds; bar: the seeds' span)
  against dense's bytes over the method's. Right: the LM, validation-loss gap to dense
  (mean ± SD over three seeds) against the same ratio; one point per table row."""
  (demo,) = load(results, "demo.json")["tables"]
  (lm,) = load(results, "lm_quality.json")["tables"]
  fig, (left, right) = _figure(2, width=5.6)
  dense = next(r for r in demo["rows"] if r["method"] == "dense")
  dense_acc = (dense["test acc (%), seed 0"] + dense["seed 1"]) / 2
  for row in demo["rows"]:
    seeds = (row["test acc (%), seed 0"], row["seed 1"])
    gap = sum(seeds) / 2 - dense_acc
    span = [[gap - (min(seeds) - dense_acc)], [max(seeds) - dense_acc - gap]]
    left.errorbar(row["ratio vs dense"], gap, yerr=span, ls="", capsize=2, label=row["method"],
                  **_style(row["method"]))  # fmt: skip
  left.set(ylabel="test accuracy − dense's (points)", title="MNIST-1D demo (2 seeds)")
  for row in lm["rows"]:
    gap, sd = row["vs dense"] or (0.0, 0.0)
    hollow = {"mfc": "white"} if row["setting"] not in ("", "buckets of 128 (default)") else {}
    label = row["method"] + (f" ({row['setting'].replace('`', '')})" if row["setting"] else "")
    right.errorbar(row["ratio vs dense"], gap, yerr=sd, ls="", capsize=2, label=label,
                   **_style(row["method"]), **hollow)  # fmt: skip
  right.set(
    ylabel="validation loss above dense's (%)", title="Transformer LM, 200 updates (3 seeds)"
  )
  right.invert_yaxis()  # better is up in both panels
  for ax in (left, right):
    ax.set(xscale="log", xlabel="bytes per step, dense / method (log scale)")
    ax.axhline(0, color="black", ls=":", lw=1)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
  return fig


def _speedup_panel(ax, series: dict[str, dict[Any, float]], title: str):
  rates = [r for r in RATE_LABELS if any(r in s for s in series.values())]
  for method, points in series.items():
    xs = [i for i, r in enumerate(rates) if r in points]
    dashed = method.startswith("flat_") or method == "dense_flat"
    ax.plot(xs, [points[rates[i]] for i in xs], ls="--" if dashed else "-", label=method,
            **_style(method))  # fmt: skip
  ax.axhline(1, color="black", ls=":", lw=1, label="dense")
  ax.set_xticks(range(len(rates)), [RATE_LABELS[r] for r in rates])
  ax.set_yscale("log", base=2)
  ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}×"))
  ax.yaxis.set_minor_formatter(ticker.NullFormatter())
  ax.set(xlabel="link rate", ylabel="step-time speed-up over dense (log scale)")
  ax.set_title(title, fontsize=10)
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=7)


def network_speedup(results: str):
  """Speed-up over dense of each method's mean step, against the link rate: the ~2M
  parameter MLP as 2 processes over the throttled veth (the two tables, one a panel)."""
  files = ("network_params2m.json", "network_params2m_peers.json")
  fig, axes = _figure(len(files), width=5.6)
  for ax, name in zip(axes, files):
    data = load(results, name)
    (table,) = data["tables"]
    series = {
      row["method"]: {rate: row[col][1] for col, rate in table["rates_mbit"].items()}
      for row in table["rows"]
      if row["method"] != "dense"
    }
    _speedup_panel(ax, series, f"MLP, 2 processes: {data['section'].split(', ', 1)[1]}")
  return fig


def two_level_speedup(results: str):
  """Speed-up over dense of each exchange's median step against the link rate, two nodes
  of four devices; dashed: flat over all 8 devices, solid: two-level."""
  tables = load(results, "two_level.json")["tables"]
  models = list(dict.fromkeys(t["model"] for t in tables))
  fig, axes = _figure(len(models), width=5.6)
  for ax, model in zip(axes, models):
    series: dict[str, dict[Any, float]] = {}
    for t in (t for t in tables if t["model"] == model):
      for row in t["rows"]:
        if row["method"] != "dense":
          series.setdefault(row["method"], {})[t["rate_mbit"]] = row["vs dense"]
    _speedup_panel(ax, series, f"{model}, 2 nodes × 4 devices")
  return fig


def lm_loss_vs_time(results: str):
  """Validation loss against training time (evaluation and compilation excluded), one
  panel per link rate kept (100 Mbit/s always, 10 Mbit/s where run), from a
  ``benchmarks.lm_network`` results.json kept as docs/results/lm_network.json."""
  path = os.path.join(results, "lm_network.json")
  with open(path, encoding="utf-8") as f:
    data = json.load(f)
  if "100mbit" not in data.get("runs", {}):
    raise ValueError(f"{path}: no run at 100mbit (benchmarks.lm_network --rates 100mbit,...)")
  rates = [r for r in ("10mbit", "100mbit") if r in data["runs"]]
  fig, axes = _figure(len(rates), width=7.0 if len(rates) == 1 else 5.6)
  target = data.get("target", {}).get("val_loss")
  for ax, rate in zip(axes, rates):
    for method, r in data["runs"][rate]["results"]["results"].items():
      h = r["history"]
      ax.plot(h["time_s"], h["val_loss"], label=method, **_style(method))
    if target is not None:
      ax.axhline(target, color="black", ls=":", lw=1, label="target: dense's loss")
      ax.set_ylim(target - 0.1, target + 1.2)  # the approach to the target, not the start
    ax.set(xlabel="training time (s)", ylabel="validation loss (nats/byte)")
    ax.set_title(f"Transformer LM, 2 processes over {rate.replace('mbit', ' Mbit/s')}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
  return fig


_DRAWN = (demo_accuracy_vs_bytes, method_map, network_speedup, two_level_speedup, lm_loss_vs_time)
FIGURES = {fn.__name__: fn for fn in _DRAWN}
OPTIONAL = {"lm_loss_vs_time": "lm_network.json"}  # drawn only where its results are kept


def draw(results: str = RESULTS, out: str = OUT, only: list[str] | None = None) -> list[str]:
  """Draws the figures (all, or `only`) as SVG into `out`; returns their paths.

  The SVG is the same bytes for the same results and matplotlib (no date, a fixed id
  salt, text kept as text), and a file is rewritten only when it changed, so a rebuild
  of the docs does not see new images.
  """
  unknown = set(only or ()) - set(FIGURES)
  if unknown:
    raise ValueError(f"unknown figures {sorted(unknown)}; known: {sorted(FIGURES)}")
  os.makedirs(out, exist_ok=True)
  paths = []
  for name, fn in FIGURES.items():
    optional_absent = name in OPTIONAL and not os.path.exists(os.path.join(results, OPTIONAL[name]))
    if (name not in only) if only else optional_absent:
      continue
    with plt.rc_context({"svg.hashsalt": "jaxcomp", "svg.fonttype": "none"}):
      fig = fn(results)
      fig.tight_layout()
      buf = io.BytesIO()
      fig.savefig(buf, format="svg", metadata={"Date": None})
    plt.close(fig)
    path = os.path.join(out, name + ".svg")
    old = open(path, "rb").read() if os.path.exists(path) else None
    if buf.getvalue() != old:
      tmp = f"{path}.{os.getpid()}.tmp"  # concurrent builds each replace it whole
      with open(tmp, "wb") as f:
        f.write(buf.getvalue())
      os.replace(tmp, path)
    paths.append(path)
  return paths


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--results", default=RESULTS, help="results directory (docs/results)")
  p.add_argument("--out", default=OUT, help="where the SVGs go (docs/_figures)")
  p.add_argument("--only", default="", help=f"comma-separated, of {','.join(FIGURES)}")
  args = p.parse_args(argv)
  for path in draw(args.results, args.out, [n for n in args.only.split(",") if n] or None):
    print(path)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
