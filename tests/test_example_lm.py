"""The LM example: every method trains the tiny transformer, and a resumed run ends
with the same bits as an uninterrupted one."""

import dataclasses
import json
import math
import os

import pytest

pytest.importorskip("flax", minversion="0.12")
pytest.importorskip("matplotlib")
pytest.importorskip("orbax.checkpoint")
pytest.importorskip("tqdm")

import jax  # noqa: E402
from jax.experimental.compilation_cache import compilation_cache  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
import numpy as np  # noqa: E402

from examples.lm import input_pipeline  # noqa: E402
from examples.lm import main  # noqa: E402
from examples.lm import train  # noqa: E402
from examples.lm.configs import tiny  # noqa: E402
import jaxcomp as jc  # noqa: E402

STEPS = 4

# One xdist worker runs this module (scripts/test.sh: --dist loadgroup), so that
# `every_method`, the longest set-up of the suite, is built once.
pytestmark = pytest.mark.xdist_group("example_lm")


def small_config(**overrides):
  """The tiny config cut to one block (compile time grows with the number of leaves),
  DiLoCo syncing every 2 updates (twice in the run), the sign codes without their
  dense warm-up (tested on its own below: both branches of its switch double the two
  methods' compile time), and no warm-up (``warmup_steps=0``): DGC's density warm-up
  compiles one branch per density stage (tests/test_dgc.py tests the warm-up), and
  AdamW starts at its peak rate."""
  settings = dict(
    depth=1,
    num_steps=STEPS,
    eval_every=STEPS,
    diloco_sync_every=2,
    sign_warmup=0.0,
    warmup_steps=0,
  )
  return dataclasses.replace(tiny.get_config(), **{**settings, **overrides})


@pytest.fixture(scope="module", autouse=True)
def compile_once(tmp_path_factory):
  """This module's time is the compilation of a training step per method: a persistent
  compilation cache in a temporary directory gives the resume tests' runs the
  executables of the uninterrupted runs (the same programs). Undone afterwards, the
  executables dropped, so that no other test reuses one."""
  before = jax.config.values["jax_compilation_cache_dir"]
  compilation_cache.set_cache_dir(str(tmp_path_factory.mktemp("xla_cache")))
  compilation_cache.reset_cache()  # opened again, at the new directory
  yield
  jax.config.update("jax_compilation_cache_dir", before)
  compilation_cache.reset_cache()
  jax.clear_caches()


@pytest.fixture(scope="module")
def every_method(tmp_path_factory):
  """Every method, trained by ``train_and_evaluate`` on the one-block tiny config."""
  workdir = str(tmp_path_factory.mktemp("lm"))
  return workdir, train.train_and_evaluate(small_config(), workdir)


def test_split_is_by_file_and_deterministic():
  files = input_pipeline.source_files()
  assert files == sorted(files) and len(files) > 100
  held_out = [f for f in files if input_pipeline.is_validation(f, 5)]
  assert 0.02 < len(held_out) / len(files) < 0.09  # ~5% of the files, by path hash
  corpus = input_pipeline.load_corpus(5)
  assert corpus["validation_files"] == len(held_out)
  assert corpus["train_files"] == len(files) - len(held_out)
  first = input_pipeline.train_batch(
    corpus["train"], 7, seed=0, num_devices=4, per_device_batch_size=3, seq_len=16
  )
  again = input_pipeline.train_batch(
    corpus["train"], 7, seed=0, num_devices=4, per_device_batch_size=3, seq_len=16
  )
  rows = input_pipeline.train_batch(
    corpus["train"],
    7,
    seed=0,
    num_devices=4,
    per_device_batch_size=3,
    seq_len=16,
    devices=slice(2, 4),
  )
  assert first.shape == (4, 3, 17) and first.dtype == np.uint8
  np.testing.assert_array_equal(first, again)
  np.testing.assert_array_equal(first[2:4], rows)  # a process's rows of the same batch


@pytest.mark.slow  # with the resume tests: every method trained (`every_method`)
def test_every_method_trains_and_reports(every_method):
  workdir, results = every_method
  assert list(results) == list(train.METHODS)
  with open(os.path.join(workdir, "results.json")) as f:
    saved = json.load(f)
  assert saved["num_devices"] == 8 and saved["num_processes"] == 1
  assert os.path.getsize(os.path.join(workdir, "val_loss.png")) > 0
  table = open(os.path.join(workdir, "results.md")).read()
  for method, r in results.items():
    h = r["history"]
    assert h["step"] == [0, STEPS], method
    assert all(math.isfinite(v) for v in h["val_loss"] + h["train_loss"][1:]), method
    # log(256) nats at a uniform start; every method has learnt byte frequencies by now.
    assert h["val_loss"][-1] < h["val_loss"][0] - 0.3, (method, h["val_loss"])
    assert r["bits_per_byte"] == pytest.approx(r["val_loss"] / math.log(2))
    assert r["skipped_steps"] == 0, method
    assert not r["diverged"] and r["exchanged"], method
    assert f"| {method} |" in table
  ratio = {m: r["ratio"] for m, r in results.items()}
  assert ratio["dense"] == pytest.approx(1.0)
  assert all(r["dense_bytes"] == results["dense"]["bytes_received"] for r in results.values())
  assert 4 < ratio["qsgd4"] < ratio["qsgd2"] < ratio["onebit"]
  # DiLoCo sends its exchange's bytes once per sync_every (2) updates.
  assert ratio["diloco"] == pytest.approx(2.0)
  assert ratio["diloco_qsgd4"] == pytest.approx(2 * ratio["qsgd4"])
  local = train.LOCAL_PARAMS
  assert all(ratio[m] > 4 for m in train.METHODS if m not in ("dense", *local)), ratio
  for method in (m for m in local if m in results):  # the anchor: replicated, not per device
    leaves = jax.tree.leaves(results[method]["params"])
    assert all(a.sharding.is_fully_replicated for a in leaves), method


@pytest.mark.slow
@pytest.mark.parametrize(
  "method, stop",
  [
    ("onebit", 2),  # residuals and keys
    ("diloco_qsgd4", 3),  # between syncs: the replicas' own rows, the exchange's residuals
  ],
)
def test_resume_is_bit_identical(every_method, tmp_path, method, stop):
  _, results = every_method
  config = small_config(methods=(method,), checkpoint_every=2)
  workdir = str(tmp_path)
  train.train_and_evaluate(config, workdir, stop_at=stop)  # interrupted after update `stop`
  resumed = train.train_and_evaluate(config, workdir)[method]
  assert resumed["start_step"] == stop
  straight = results[method]
  assert resumed["history"]["val_loss"] == straight["history"]["val_loss"]
  assert resumed["params_sha256"] == straight["params_sha256"]
  for a, b in zip(jax.tree.leaves(resumed["params"]), jax.tree.leaves(straight["params"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_dense_warmup_is_dense_then_the_exchange():
  k = jax.device_count()
  mesh = jax.make_mesh((k,), (train.AXIS,), axis_types=(jax.sharding.AxisType.Explicit,))
  params = {"w": np.zeros((64, 32), np.float32)}
  grads = np.random.default_rng(0).normal(size=(k, 64, 32)).astype(np.float32)
  rows = jax.device_put(grads, jax.NamedSharding(mesh, P(train.AXIS)))

  def steps(tx, n):
    specs = jc.state_specs(tx, params, axis_name=train.AXIS, num_devices=k)

    def step(g, state):
      out, state = tx.update({"w": g[0]}, state, params)
      return out["w"][None], state

    run = jax.jit(
      jax.shard_map(
        step, mesh=mesh, in_specs=(P(train.AXIS), specs), out_specs=(P(train.AXIS), specs)
      )
    )
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    outs = []
    for _ in range(n):
      out, state = run(rows, state)
      outs.append(np.asarray(out))
    return outs, state

  onebit = lambda: jc.per_device_state(jc.onebit_sgd(axis_name=train.AXIS))
  outs, state = steps(train.dense_warmup(onebit(), 2), 3)
  mean = np.broadcast_to(grads.mean(axis=0), outs[0].shape)
  for out in outs[:2]:  # the dense mean
    np.testing.assert_allclose(out, mean, rtol=1e-5, atol=1e-6)
  # Then the exchange, from the state it had before the warm-up (no residual yet).
  (first,), _ = steps(onebit(), 1)
  np.testing.assert_array_equal(outs[2], first)
  assert np.abs(first - mean).max() > 0.1
  assert int(state.count) == 3
  assert train.dense_warmup(onebit, 0) is onebit


def test_flags_and_help(capsys):
  with pytest.raises(SystemExit):
    main.main(["--help"])
  assert "--coordinator" in capsys.readouterr().out
  args = main.build_parser().parse_args(["--config", "tiny", "--methods", "dense,dgc"])
  assert main.get_config(args).methods == ("dense", "dgc")
  with pytest.raises(ValueError, match="unknown"):
    main.get_config(main.build_parser().parse_args(["--methods", "dense,nope"]))
  with pytest.raises(ValueError, match="--steps"):
    main.get_config(main.build_parser().parse_args(["--steps", "0"]))


def test_set_overrides_any_field_with_its_type():
  parse = lambda *a: main.get_config(main.build_parser().parse_args(["--config", "tiny", *a]))
  config = parse("--set", "diloco_sync_every=5", "--set", "sparseloco_density=0.03")
  assert config.diloco_sync_every == 5 and config.sparseloco_density == 0.03
  assert parse("--set", "qsgd_error_feedback=true").qsgd_error_feedback is True
  assert parse("--set", "methods=dense,demo").methods == ("dense", "demo")
  for bad, match in (("nope=1", "FIELD=VALUE"), ("diloco_sync_every", "FIELD=VALUE")):
    with pytest.raises(ValueError, match=match):
      parse("--set", bad)
  with pytest.raises(ValueError, match="not a int"):
    parse("--set", "diloco_sync_every=2.5")
  with pytest.raises(ValueError, match="not a bool"):
    parse("--set", "qsgd_error_feedback=maybe")


@pytest.mark.slow
def test_the_low_communication_methods_train(tmp_path):
  """SparseLoCo (DiLoCo's replicas, evaluated at the anchor) and DeMo (the whole
  optimizer) train the tiny model, their bytes read from their payloads: SparseLoCo's
  per update are its sync's over ``diloco_sync_every``, DeMo's below dense's."""
  methods = train.FRONTIER_METHODS
  config = small_config(methods=methods)
  results = train.train_and_evaluate(config, str(tmp_path))
  assert list(results) == list(methods)
  # The anchor moves only by what two syncs of 1/64 of each chunk carry.
  learnt = {"demo": 0.3, "sparseloco": 0.05}
  for method, r in results.items():
    h = r["history"]
    assert all(math.isfinite(v) for v in h["val_loss"]), method
    assert h["val_loss"][-1] < h["val_loss"][0] - learnt[method], (method, h["val_loss"])
    assert not r["diverged"] and r["exchanged"], method
  assert results["demo"]["first_exchange_step"] == 1
  assert results["sparseloco"]["first_exchange_step"] == config.diloco_sync_every
  # Every sync sends a few percent of the pseudo-gradient: far below DiLoCo's dense
  # mean every 2 updates (ratio 2); DeMo a fraction of dense's bytes.
  assert results["sparseloco"]["ratio"] > 10 and results["demo"]["ratio"] > 2, {
    m: r["ratio"] for m, r in results.items()
  }
  leaves = jax.tree.leaves(results["sparseloco"]["params"])
  assert all(a.sharding.is_fully_replicated for a in leaves)  # the anchor


def test_the_tiny_config_reaches_every_methods_first_exchange():
  # The README's command (--config tiny): no row may report bytes its method never sent.
  config = tiny.get_config()
  first = {m: train.first_exchange_step(m, config) for m in train.METHODS}
  assert all(step <= config.num_steps for step in first.values()), first
  assert first["diloco"] == config.diloco_sync_every > 1  # DiLoCo's first sync


def test_a_run_that_stops_before_diloco_syncs_reports_no_bytes(tmp_path):
  config = small_config(methods=("diloco",), diloco_sync_every=STEPS + 1)
  r = train.train_and_evaluate(config, str(tmp_path))["diloco"]
  assert not r["exchanged"] and r["first_exchange_step"] == STEPS + 1
  assert r["val_loss"] == r["history"]["val_loss"][0]  # the anchor never moved
  row = next(line for line in open(tmp_path / "results.md") if line.startswith("| diloco |"))
  assert f"| none sent (first exchange at update {STEPS + 1}) | n/a |" in row
  saved = json.load(open(tmp_path / "results.json"))["results"]["diloco"]
  assert saved["exchanged"] is False and saved["bytes_received"] == r["bytes_received"]


# AdamW's warm-up starts at 0 (update 1 moves nothing); update 2 steps each parameter by
# about the rate, 5e29 (half the peak), so update 3's forward pass overflows (attention
# logits past bfloat16's 3e38): a non-finite loss, whose update the NaN guard skips. The
# parameters stay finite; the validation loss at update 4 is not, which dates the
# divergence at update 3.
DIVERGING = ["--config", "tiny", "--methods", "dense", "--learning-rate", "1e30", "--steps", "4"]
DIVERGED_AT = 3


def test_diverged_run_is_marked_everywhere_and_fails_the_exit_code(tmp_path, capsys):
  workdir = str(tmp_path)
  assert main.main([*DIVERGING, "--eval-every", "4", "--workdir", workdir]) == 1
  err = capsys.readouterr().err
  assert f"dense at update {DIVERGED_AT}" in err and "--allow-diverged" in err
  saved = json.load(open(os.path.join(workdir, "results.json")))["results"]["dense"]
  assert saved["diverged"] is True and saved["nonfinite_step"] == DIVERGED_AT
  assert saved["skipped_steps"] >= 1  # the guard skipped the non-finite updates
  assert not math.isfinite(saved["val_loss"])
  row = next(line for line in open(tmp_path / "results.md") if line.startswith("| dense |"))
  assert f"| dense | diverged at update {DIVERGED_AT} | n/a | n/a |" in row
  fig = train.plot_losses({"dense": saved}, str(tmp_path / "plot.png"))
  legend = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
  assert legend == [f"dense (diverged at update {DIVERGED_AT})"]
  flags = [*DIVERGING, "--eval-every", "4", "--workdir", workdir, "--allow-diverged"]
  assert main.main(flags) == 0
  assert "warning: diverged" in capsys.readouterr().err
