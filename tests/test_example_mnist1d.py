"""The MNIST-1D example: the demo's full-length run (the README's command) and its
quality bar, a run that diverges, and the quick config's DiLoCo."""

import dataclasses
import json
import math
import os

import pytest

pytest.importorskip("flax")
pytest.importorskip("mnist1d")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from examples import common  # noqa: E402
from examples.mnist1d import main  # noqa: E402
from examples.mnist1d import train  # noqa: E402
from examples.mnist1d.configs import default  # noqa: E402
from examples.mnist1d.configs import quick  # noqa: E402

# The demo's quality bar: every method ends within this many points of dense's test
# accuracy. A seed or a change of float rounding moves one run by up to about a point
# (docs/guides/demo.md), so 2 points separate a method that trains from noise.
QUALITY_POINTS = 2.0


@pytest.mark.xla_optimized
@pytest.mark.slow
@pytest.mark.once
def test_demo_full_length(tmp_path):
  """What the README's command runs (default config, every default method, 600 steps):
  every method ends finite and within QUALITY_POINTS of dense, and the results are
  written. (It replaces a run of the quick config, which stopped before a method could
  diverge.)"""
  config = main.get_config(main.parse_args([]))
  assert config == default.get_config()
  workdir = str(tmp_path)
  results = train.train_and_evaluate(config, workdir)

  assert list(results) == list(train.METHODS)
  dense = 100 * results["dense"]["test_accuracy"]
  failed = {
    method: f"diverged at step {r['nonfinite_step']}"
    if r["diverged"]
    else f"{100 * r['test_accuracy']:.1f}% vs dense {dense:.1f}%"
    for method, r in results.items()
    if r["diverged"] or 100 * r["test_accuracy"] < dense - QUALITY_POINTS
  }
  assert not failed, failed
  for method, r in results.items():
    assert r["exchanged"], method
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
  # fewer bytes than the one before. 97,536 of the model's 98,186 parameters are in the
  # five compressed kernels; the first convolution's (160 values) and the biases go dense.
  ratio = {m: r["ratio"] for m, r in results.items()}
  assert ratio["dense"] == pytest.approx(1.0)
  assert all(r["dense_bytes"] == results["dense"]["bytes_received"] for r in results.values())
  assert 5 < ratio["qsgd4"] < ratio["qsgd2"] < ratio["onebit"]
  assert ratio["onebit"] > 10
  # DGC sends 0.1% of each kernel as (value, index) pairs; Wangni (5%) a capacity of
  # indices and signs per kernel, above the 5% of its values.
  assert ratio["dgc"] > ratio["onebit"]
  assert 3 < ratio["wangni"] < ratio["qsgd4"]

  for name in ("results.md", "results.json", "accuracy.png"):
    assert os.path.getsize(os.path.join(workdir, name)) > 0
  with open(os.path.join(workdir, "results.md")) as f:
    table = f.read()
  assert all(f"| {m} | {100 * r['test_accuracy']:.1f} |" in table for m, r in results.items())
  with open(os.path.join(workdir, "results.json")) as f:
    saved = json.load(f)
  assert saved["num_devices"] == 8
  assert saved["results"]["onebit"]["ratio"] == pytest.approx(ratio["onebit"])
  assert all(saved["results"][m]["nonfinite_step"] is None for m in train.METHODS)


def test_config_by_name_or_path(tmp_path):
  from examples.mnist1d import configs  # pylint: disable=import-outside-toplevel

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


def test_set_and_flags_override_the_config():
  # --set FIELD=VALUE (examples.common.parse_sets, shared with the LM trainer) parses
  # each value as the field's type; the named flags win over nothing else.
  parse = lambda *a: main.get_config(main.parse_args(["--quick", *a]))
  config = parse("--set", "num_steps=7", "--set", "methods=dense,onebit", "--seed", "3")
  assert (config.num_steps, config.methods, config.seed) == (7, ("dense", "onebit"), 3)
  assert parse("--set", "learning_rate=0.5").learning_rate == 0.5
  for bad, match in (
    (["--set", "nope=1"], "FIELD=VALUE"),
    (["--set", "num_steps=2.5"], "not a int"),
    (["--steps", "0"], "--steps must be positive"),
    (["--checkpoint-every", "-1"], "--checkpoint-every must be >= 0"),
    (["--methods", "dense,nope"], "unknown"),
  ):
    with pytest.raises(ValueError, match=match):
      parse(*bad)


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
  assert r["exchanged"] and r["first_exchange_step"] == 5
  assert not r["diverged"] and r["nonfinite_step"] is None


@pytest.mark.parametrize("method", ["sparseloco", "demo"])
def test_quick_run_low_communication_methods(tmp_path, method):
  """SparseLoCo (replicas per device, evaluated at the anchor) and DeMo (the whole
  optimizer) train the quick config; SparseLoCo sends its sync's bytes once per
  ``diloco_sync_every`` steps, far below DiLoCo's dense mean, DeMo below dense."""
  config = dataclasses.replace(quick.get_config(), diloco_sync_every=5)
  mesh, data, model, init_params = train.setup(config, str(tmp_path))
  common = dict(model=model, init_params=init_params, data=data, mesh=mesh)
  r = train.train_method(method, config, **common)
  assert r["history"]["step"][-1] == config.num_steps
  kernels = [p for p in r["layer_change"] if p.endswith("['kernel']")]
  assert kernels and all(r["layer_change"][p] > 0 for p in kernels)
  assert r["exchanged"] and not r["diverged"]
  assert r["first_exchange_step"] == (5 if method == "sparseloco" else 1)
  dense = train.wire_report(train.make_tx("dense", config), init_params, mesh.size)
  assert r["bytes_received"] < dense.bytes_received / (50 if method == "sparseloco" else 2)


# A config whose run goes non-finite at a known step: the schedule's warm-up starts at 0,
# so step 1 leaves the params as they are; step 2 applies a rate of 5e29 (half the peak)
# to the mean gradient clipped to norm 1, so step 3's forward pass (logits of order
# 1e58, past float32) gives a non-finite loss, and the update after it NaN params.
DIVERGING_CONFIG = """
import dataclasses
from examples.mnist1d.configs import quick
def get_config():
  return dataclasses.replace(
    quick.get_config(), learning_rate=1e30, num_steps=6, eval_every=3, methods=("dense",)
  )
"""
DIVERGED_AT = 3


def test_diverged_run_is_marked_everywhere_and_fails_the_exit_code(tmp_path, capsys):
  path = tmp_path / "diverging.py"
  path.write_text(DIVERGING_CONFIG)
  workdir = str(tmp_path / "run")
  assert main.main(["--config", str(path), "--workdir", workdir]) == 1
  err = capsys.readouterr().err
  assert f"dense at step {DIVERGED_AT}" in err and "--allow-diverged" in err

  with open(os.path.join(workdir, "results.json")) as f:
    r = json.load(f)["results"]["dense"]
  assert r["diverged"] is True and r["nonfinite_step"] == DIVERGED_AT
  # The losses say the same: finite up to the step before, non-finite from it on.
  losses = r["losses"]
  assert all(math.isfinite(v) for v in losses[: DIVERGED_AT - 1])
  assert not any(math.isfinite(v) for v in losses[DIVERGED_AT - 1 :])
  with open(os.path.join(workdir, "results.md")) as f:
    row = next(line for line in f if line.startswith("| dense |"))
  assert f"| diverged at step {DIVERGED_AT} |" in row
  fig = train.plot_accuracy({"dense": r}, str(tmp_path / "accuracy.png"))
  legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
  assert legend == [f"dense (diverged at step {DIVERGED_AT})"]

  # --allow-diverged: the same run, marked alike, exits 0 with a warning.
  assert main.main(["--config", str(path), "--workdir", workdir, "--allow-diverged"]) == 0
  assert f"warning: diverged (non-finite loss or parameters): dense at step {DIVERGED_AT}" in (
    capsys.readouterr().err
  )


def test_divergence_is_a_nonfinite_check_dated_by_the_first_nonfinite_loss():
  d = common.Divergence()
  d.loss(1, 2.0)
  d.loss(2, float("nan"))  # a step the NaN guard skipped: the parameters stay finite
  assert not d.check(4, True, True) and d.step is None
  for step, loss in ((5, 1.0), (6, float("inf")), (7, float("nan"))):
    d.loss(step, loss)
  assert d.check(8, False, True) and d.step == 6  # the first since the sound check
  d.loss(9, 1.0)
  assert d.check(10, True) and d.step == 6  # once diverged, it stays so
  assert common.Divergence(**d.state()) == d  # a checkpoint's copy resumes it
  e = common.Divergence()
  assert e.check(3, True, False) and e.step == 3  # no non-finite loss: the check's step


def test_a_method_that_never_reached_its_exchange_reports_no_bytes():
  config = dataclasses.replace(quick.get_config(), num_steps=4)
  assert [train.first_exchange_step(m, config) for m in ("dense", "onebit", "diloco")] == [
    1,
    1,
    config.diloco_sync_every,
  ]
  # 1-bit Adam's compression stage starts after its warm-up, within the run.
  assert 1 < train.first_exchange_step("onebit_adam", config) <= config.num_steps
  row = {"bytes_received": 1000.0, "ratio": 2.0, "first_exchange_step": 10}
  assert common.bytes_cells({**row, "exchanged": True}) == ("1,000", "2.0x")
  assert common.bytes_cells({**row, "exchanged": False}) == (
    "none sent (first exchange at step 10)",
    "n/a",
  )
