"""Smoke test of the flax.nnx MNIST-1D example: the real trainer on the quick config."""

import dataclasses
import json
import math
import os

import pytest

pytest.importorskip("flax", minversion="0.12")
pytest.importorskip("mnist1d")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

import chex  # noqa: E402
from flax import nnx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from examples.mnist1d import input_pipeline  # noqa: E402
from examples.mnist1d import train as linen_train  # noqa: E402
from examples.mnist1d.configs import quick  # noqa: E402
from examples.mnist1d_nnx import main  # noqa: E402
from examples.mnist1d_nnx import train  # noqa: E402

# Dense and two codecs with per-device state, and MIPD, whose state stays replicated
# (the trainer's other branch). DGC's is left out: it alone takes as long to compile
# as two of these, and the linen trainer's test covers its exchange.
METHODS = ("dense", "qsgd4", "onebit", "mipd")


def test_quick_run_writes_results(tmp_path):
  config = dataclasses.replace(quick.get_config(), methods=METHODS)
  workdir = str(tmp_path)
  main.main(["--quick", "--methods", ",".join(METHODS), "--workdir", workdir])
  with open(os.path.join(workdir, "results.json")) as f:
    saved = json.load(f)
  assert saved["num_devices"] == 8 and saved["api"] == "flax.nnx"
  assert saved["config"]["num_steps"] == config.num_steps
  results = saved["results"]

  assert list(results) == list(METHODS)
  for method, r in results.items():
    assert 0.0 <= r["test_accuracy"] <= 1.0 and math.isfinite(r["test_accuracy"]), method
    assert all(math.isfinite(v) for v in r["history"]["train_loss"][1:]), method
    assert r["history"]["step"][-1] == config.num_steps
    change = r["layer_change"]
    kernels = [p for p in change if p.endswith("['kernel']")]
    assert len(kernels) == len(config.conv_features) + 2, change  # convs + 2 linears
    assert all(math.isfinite(change[p]) and change[p] > 0 for p in kernels), (method, change)

  # Same model shapes and exchanges as the linen trainer, hence its byte counts
  # (tests/test_example_mnist1d.py derives them): dense is its own baseline.
  ratio = {m: r["ratio"] for m, r in results.items()}
  assert ratio["dense"] == pytest.approx(1.0)
  assert all(r["dense_bytes"] == results["dense"]["bytes_received"] for r in results.values())
  assert 5 < ratio["qsgd4"] < ratio["onebit"]
  assert ratio["onebit"] > 10
  assert 1 < ratio["mipd"] < ratio["qsgd4"]

  for name in ("results.md", "accuracy.png"):
    assert os.path.getsize(os.path.join(workdir, name)) > 0
  with open(os.path.join(workdir, "results.md")) as f:
    table = f.read()
  # The linen trainer's table, row for row.
  assert table == linen_train.results_table(results, saved["num_devices"]) + "\n"
  assert all(f"| {m} |" in table for m in METHODS)


def test_dense_matches_one_device_training(tmp_path):
  """Dense on 8 devices = the same optimizer on the global batch on one device.

  Catches a gradient that is not the local one: differentiating the replicated model
  inside shard_map gives the psum, 8x the mean, and 8x steps. No clipping, which
  would hide that factor.
  """
  config = dataclasses.replace(quick.get_config(), methods=("dense",), num_steps=4, grad_clip=0.0)
  mesh, data, graphdef, init_state = train.setup(config, str(tmp_path))
  trained, _ = train.train_method(
    "dense", config, graphdef=graphdef, init_state=init_state, data=data, mesh=mesh
  )

  model = nnx.merge(graphdef, jax.device_put(init_state))  # fresh Variables
  optimizer = nnx.Optimizer(model, train.make_optimizer("dense", config), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, y):
    optimizer.update(model, nnx.grad(train.loss_fn)(model, x, y))

  batches = input_pipeline.train_batches(
    data["x"],
    data["y"],
    num_devices=mesh.size,
    per_device_batch_size=config.per_device_batch_size,
    seed=config.seed,
  )
  for _ in range(config.num_steps):
    x, y = next(batches)
    step(model, optimizer, x.reshape(-1, *x.shape[2:]), y.reshape(-1))

  want = jax.device_get(nnx.state(model, nnx.Param).to_pure_dict())
  got = jax.device_get(nnx.state(trained, nnx.Param).to_pure_dict())
  start = init_state.to_pure_dict()
  moved = min(np.max(np.abs(w - s)) for w, s in zip(jax.tree.leaves(want), jax.tree.leaves(start)))
  assert moved > 1e-3  # every parameter moved far beyond the tolerance below
  # Only the float32 summation order differs (per-device means, then their mean).
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


def test_diverged_run_is_marked_and_fails_the_exit_code(tmp_path, capsys):
  # The linen test's config (tests/test_example_mnist1d.py says why step 3): the same
  # schedule, so the same step, from nnx's own initial values.
  from tests import test_example_mnist1d as linen  # pylint: disable=import-outside-toplevel

  path = tmp_path / "diverging.py"
  path.write_text(linen.DIVERGING_CONFIG)
  workdir = str(tmp_path / "run")
  assert main.main(["--config", str(path), "--workdir", workdir]) == 1
  assert f"dense at step {linen.DIVERGED_AT}" in capsys.readouterr().err
  with open(os.path.join(workdir, "results.json")) as f:
    r = json.load(f)["results"]["dense"]
  assert r["diverged"] is True and r["nonfinite_step"] == linen.DIVERGED_AT
  with open(os.path.join(workdir, "results.md")) as f:
    assert f"| dense | diverged at step {linen.DIVERGED_AT} |" in f.read()
  assert main.main(["--config", str(path), "--workdir", workdir, "--allow-diverged"]) == 0
