"""The docs' figures: their results files hold exactly the documented tables' numbers, and
`benchmarks/figures.py` draws every figure the pages show from them, the same bytes each
time."""

import glob
import json
import os
import re
import xml.etree.ElementTree as ET

import pytest

from benchmarks import figures

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
RESULTS_FILES = sorted(glob.glob(os.path.join(figures.RESULTS, "*.json")))
# A results file of benchmarks.lm_network's own format (histories), not a table's copy.
TABLE_FILES = [p for p in RESULTS_FILES if os.path.basename(p) != "lm_network.json"]
_NUMBER = re.compile(r"[−-]?\d[\d,]*(?:\.\d+)?")


def section_tables(text: str, section: str) -> list[tuple[list[str], list[list[str]]]]:
  """(header, rows) of each markdown table under the heading `section`, up to the next
  heading (code fences skipped)."""
  lines = text.splitlines()
  heading = re.compile(r"#+\s+" + re.escape(section) + r"\s*$")
  starts = [i for i, line in enumerate(lines) if heading.match(line)]
  assert len(starts) == 1, f"{len(starts)} headings {section!r}"
  tables, table, fenced = [], None, False
  for line in lines[starts[0] + 1 :]:
    if line.startswith("```"):
      fenced = not fenced
    if fenced:
      continue
    if re.match(r"#+\s", line):
      break
    if not line.startswith("|"):
      table = None
      continue
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if table is None:
      table = (cells, [])
      tables.append(table)
    elif not set("".join(cells)) <= set("-: "):
      table[1].append(cells)
  return tables


def numbers(cell: str) -> list[float]:
  """The numbers a table cell shows, in order ("125 (1.00x; −7%)": 125, 1.0, -7)."""
  return [float(n.replace("−", "-").replace(",", "")) for n in _NUMBER.findall(cell)]


@pytest.mark.parametrize("path", TABLE_FILES, ids=os.path.basename)
def test_results_are_the_documented_tables(path):
  """Every row of the page's tables is in the file with the same numbers, and no other:
  a method added to a table but not to its results file fails here."""
  data = figures.load(figures.RESULTS, os.path.basename(path))
  assert data["commands"] and all(isinstance(c, str) and c for c in data["commands"])
  with open(os.path.join(ROOT, data["page"]), encoding="utf-8") as f:
    documented = section_tables(f.read(), data["section"])
  for table in data["tables"]:
    header, rows = documented[table["table"]]
    assert table["columns"] == header, f"{data['section']}: the table's columns changed"
    key = table["key"]
    doc_rows = {tuple(r[header.index(k)] for k in key): r for r in rows}
    kept = {tuple(r[k] for k in key): r for r in table["rows"]}
    assert set(kept) == set(doc_rows), (
      f"{data['section']}, table {table['table']}: rows only in the page "
      f"{sorted(set(doc_rows) - set(kept))}, only in {path} {sorted(set(kept) - set(doc_rows))}"
    )
    for name, row in kept.items():
      assert list(row) == header, name
      for column, cell in zip(header, doc_rows[name]):
        value = row[column]
        if column in key:
          assert value == cell
        else:
          want = [] if value is None else value if isinstance(value, list) else [value]
          assert numbers(cell) == want, (name, column, cell)


def _svg_text(path: str) -> str:
  root = ET.parse(path).getroot()  # well-formed SVG
  assert root.tag.endswith("svg")
  return " ".join(t for el in root.iter() for t in [el.text] if t)


def _methods(name: str) -> set[str]:
  with open(os.path.join(figures.RESULTS, name), encoding="utf-8") as f:
    return {r["method"] for t in json.load(f)["tables"] for r in t["rows"]}


def test_figures_draw_from_the_kept_results(tmp_path):
  paths = figures.draw(out=str(tmp_path))
  drawn = {os.path.splitext(os.path.basename(p))[0]: _svg_text(p) for p in paths}
  assert set(figures.FIGURES) - set(figures.OPTIONAL) <= set(drawn)
  # Axis labels, and every method of the results in the legend (dense on the landing page).
  labels = {
    "demo_accuracy_vs_bytes": ["test accuracy (%)", "bytes received per device per step"],
    "method_map": ["test accuracy − dense's (points)", "validation loss above dense's (%)"],
    "network_speedup": ["step-time speed-up over dense", "link rate"],
    "two_level_speedup": ["step-time speed-up over dense", "link rate"],
  }
  for name, want in labels.items():
    for label in want:
      assert label in drawn[name], (name, label)
  for method in _methods("demo.json"):
    assert re.search(rf"\b{method}\b", drawn["demo_accuracy_vs_bytes"]), method
    assert re.search(rf"\b{method}\b", drawn["method_map"]), method
  for method in _methods("lm_quality.json"):
    assert re.search(rf"\b{method}\b", drawn["method_map"]), method
  for method in _methods("two_level.json"):
    assert re.search(rf"\b{method}\b", drawn["two_level_speedup"]), method
  for method in _methods("network_params2m.json") | _methods("network_params2m_peers.json"):
    assert re.search(rf"\b{method}\b", drawn["network_speedup"]), method


def test_figures_are_the_same_bytes_each_time(tmp_path):
  a = figures.draw(out=str(tmp_path / "a"), only=["demo_accuracy_vs_bytes", "method_map"])
  b = figures.draw(out=str(tmp_path / "b"), only=["demo_accuracy_vs_bytes", "method_map"])
  for pa, pb in zip(a, b):
    with open(pa, "rb") as fa, open(pb, "rb") as fb:
      assert fa.read() == fb.read(), pa


def test_a_missing_results_file_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="demo.json: missing"):
    figures.draw(results=str(tmp_path), out=str(tmp_path / "out"), only=["method_map"])
  with pytest.raises(ValueError, match="unknown figures"):
    figures.draw(out=str(tmp_path / "out"), only=["accuracy"])


def test_lm_loss_vs_time_reads_lm_networks_results(tmp_path):
  """The optional figure, drawn from a file in benchmarks.lm_network's results.json layout
  (made up here: no such run is kept yet), and skipped by default while there is none."""
  history = {"step": [10, 20], "val_loss": [3.0, 2.5], "time_s": [1.0, 2.0], "train_loss": [3, 2]}
  runs = {
    "100mbit": {"results": {"results": {m: {"history": history} for m in ("dense", "qsgd4")}}}
  }
  with open(tmp_path / "lm_network.json", "w") as f:
    json.dump({"runs": runs, "target": {"val_loss": 2.6}}, f)
  (path,) = figures.draw(results=str(tmp_path), out=str(tmp_path), only=["lm_loss_vs_time"])
  text = _svg_text(path)
  for want in ("validation loss (nats/byte)", "training time (s)", "dense", "qsgd4"):
    assert want in text
  with open(tmp_path / "lm_network.json", "w") as f:
    json.dump({"runs": {"1gbit": {}}}, f)
  with pytest.raises(ValueError, match="no run at 100mbit"):
    figures.draw(results=str(tmp_path), out=str(tmp_path), only=["lm_loss_vs_time"])
  if not os.path.exists(os.path.join(figures.RESULTS, "lm_network.json")):
    drawn = [os.path.basename(p) for p in figures.draw(out=str(tmp_path / "all"))]
    assert "lm_loss_vs_time.svg" not in drawn


def test_pages_show_the_figures_with_alt_text():
  """Each figure a page shows is one the script draws, with alt text; each drawn figure
  (but the optional ones) is shown."""
  shown = {}
  for path in glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True):
    with open(path, encoding="utf-8") as f:
      for name, options in re.findall(r"```\{figure\} _figures/(\w+)\.svg\n((?::.*\n)*)", f.read()):
        shown[name] = os.path.relpath(path, ROOT)
        assert re.search(r"^:alt: \S.{40,}", options, re.M), f"{path}: {name} has no alt text"
  assert set(shown) <= set(figures.FIGURES), shown
  assert set(figures.FIGURES) - set(figures.OPTIONAL) <= set(shown)
  assert shown["demo_accuracy_vs_bytes"] == "docs/index.md"
  assert shown["method_map"] == "docs/choosing_a_method.md"
