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
import numpy as np  # noqa: E402

from examples.lm import input_pipeline  # noqa: E402
from examples.lm import main  # noqa: E402
from examples.lm import train  # noqa: E402
from examples.lm.configs import tiny  # noqa: E402

STEPS = 4


def small_config(**overrides):
  """The tiny config cut to one block (compile time grows with the number of leaves)."""
  return dataclasses.replace(
    tiny.get_config(), depth=1, num_steps=STEPS, eval_every=STEPS, **overrides
  )


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
    assert f"| {method} |" in table
  ratio = {m: r["ratio"] for m, r in results.items()}
  assert ratio["dense"] == pytest.approx(1.0)
  assert all(r["dense_bytes"] == results["dense"]["bytes_received"] for r in results.values())
  assert 4 < ratio["qsgd4"] < ratio["qsgd2"] < ratio["onebit"]
  assert all(ratio[m] > 4 for m in train.METHODS if m != "dense"), ratio


def test_resume_is_bit_identical(every_method, tmp_path):
  _, results = every_method
  config = small_config(methods=("onebit",), checkpoint_every=2)  # residuals and keys
  workdir = str(tmp_path)
  train.train_and_evaluate(config, workdir, stop_at=2)  # interrupted after update 2
  resumed = train.train_and_evaluate(config, workdir)["onebit"]
  assert resumed["start_step"] == 2
  straight = results["onebit"]
  assert resumed["history"]["val_loss"] == straight["history"]["val_loss"]
  for a, b in zip(jax.tree.leaves(resumed["params"]), jax.tree.leaves(straight["params"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


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
