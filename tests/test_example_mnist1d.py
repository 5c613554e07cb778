"""Smoke test of the MNIST-1D example: the real train_and_evaluate on the quick config."""

import dataclasses
import json
import math
import os

import pytest

pytest.importorskip("flax")
pytest.importorskip("mnist1d")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from examples.mnist1d import train  # noqa: E402
from examples.mnist1d.configs import quick  # noqa: E402


@pytest.mark.once
def test_quick_run_writes_results(tmp_path):
  config = quick.get_config()
  workdir = str(tmp_path)
  results = train.train_and_evaluate(config, workdir)

  assert list(results) == list(train.METHODS)
  for method, r in results.items():
    assert 0.0 <= r["test_accuracy"] <= 1.0, method
    assert math.isfinite(r["test_accuracy"]), method
    assert len(r["history"]["step"]) == len(r["history"]["test_accuracy"])
    assert r["history"]["step"][-1] == config.num_steps
    assert r["train_time_s"] > 0 and r["compile_time_s"] > 0
    # ||w_T - w_0|| / ||w_0|| per parameter: every kernel moved; zero-init biases: NaN.
    change = r["layer_change"]
    kernels = [p for p in change if p.endswith("['kernel']")]
    assert kernels and len(change) == len(results["dense"]["layer_change"]), method
    assert all(math.isfinite(change[p]) and change[p] > 0 for p in kernels), (method, change)
    assert all(math.isnan(v) for p, v in change.items() if p.endswith("['bias']")), method

  # Bytes per device per step: the dense pmean is its own baseline; each codec sends
  # fewer bytes than the one before. Quick model: 16,384 of its 17,274 parameters are
  # compressed, the rest (890, 32 bits each) go dense, so the ratios are
  # 17274*32 / (16384*b + 890*32) with b = 4 + 32/512 bits (qsgd4: 5.8x),
  # 2 + 32/128 (qsgd2: 8.5x) and 1 + 64/1024 (onebit: 12.0x).
  ratio = {m: r["ratio"] for m, r in results.items()}
  assert ratio["dense"] == pytest.approx(1.0)
  assert all(r["dense_bytes"] == results["dense"]["bytes_received"] for r in results.values())
  assert 5 < ratio["qsgd4"] < ratio["qsgd2"] < ratio["onebit"]
  assert ratio["onebit"] > 10
  # All-gathered sparse payloads: DGC sends 9 (value, uint16 index) pairs per kernel per
  # step; Wangni (5%) a capacity of 538 indices + signs and 103 values per kernel.
  assert ratio["dgc"] > ratio["onebit"]
  assert 3 < ratio["wangni"] < ratio["qsgd4"]

  for name in ("results.md", "results.json", "accuracy.png"):
    assert os.path.getsize(os.path.join(workdir, name)) > 0
  with open(os.path.join(workdir, "results.md")) as f:
    table = f.read()
  assert all(f"| {m} |" in table for m in train.METHODS)
  with open(os.path.join(workdir, "results.json")) as f:
    saved = json.load(f)
  assert saved["num_devices"] == 8
  assert saved["results"]["onebit"]["ratio"] == pytest.approx(ratio["onebit"])


def test_config_by_name_or_path(tmp_path):
  from examples.mnist1d import configs  # pylint: disable=import-outside-toplevel
  from examples.mnist1d import main  # pylint: disable=import-outside-toplevel

  assert main.get_config(main.parse_args(["--quick"])) == quick.get_config()
  path = tmp_path / "tiny.py"
  path.write_text(
    "from examples.mnist1d.configs import quick\ndef get_config():\n  return quick.get_config()\n"
  )
  config = main.get_config(main.parse_args(["--config", str(path), "--steps", "2"]))
  assert config.num_steps == 2 and config.hidden == quick.get_config().hidden
  with pytest.raises(ValueError, match="unknown 'params2m'"):  # a benchmark's, not here
    configs.load("params2m")
  (tmp_path / "empty.py").write_text("")
  with pytest.raises(ValueError, match="no get_config"):
    configs.load(str(tmp_path / "empty.py"))


def test_quick_run_diloco(tmp_path):
  """The demo's DiLoCo method: params per device, evaluated at the anchor, which every
  replica sits on after the last step (a sync: 10 steps, syncs every 5); bytes are
  4-bit QSGD's over sync_every."""
  config = dataclasses.replace(quick.get_config(), diloco_sync_every=5)
  mesh, data, model, init_params = train.setup(config, str(tmp_path))
  common = dict(model=model, init_params=init_params, data=data, mesh=mesh)
  r = train.train_method("diloco_qsgd4", config, **common)
  assert r["history"]["step"][-1] == config.num_steps
  assert 0.0 <= r["test_accuracy"] <= 1.0
  kernels = [p for p in r["layer_change"] if p.endswith("['kernel']")]
  assert kernels and all(r["layer_change"][p] > 0 for p in kernels)
  qsgd = train.wire_report(train.make_tx("qsgd4", config), init_params, mesh.size)
  assert r["bytes_received"] == pytest.approx(qsgd.bytes_received / 5)
