"""Run integrity: the update's non-finite guard and config checks naming the flag. Checkpoints are
in test_checkpointing.py, log files in test_run_logs.py, the workdir's config in
test_run_config.py, the end-to-end loop checks in test_integrity_loop.py, the command line in
test_cli.py."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
import tiny

from lowrl.models import layout
from lowrl import precision
from lowrl.models import init
from lowrl.models.config import ModelConfig
from lowrl.rl.corrections import CorrectionConfig
from lowrl.rl.losses import LossConfig
from lowrl.tasks.jsonl import JsonlTask
from lowrl.training import run_config
from lowrl.training.setup import build
from lowrl.training.rl_update import UpdateConfig, make_logprob_fn, make_rl_update
from lowrl.training.batch import RLBatch


# -- the update's guard ----------------------------------------------------------------------

def test_update_skips_a_non_finite_new_state():
  """lr = inf: loss and gradient are finite, the new parameters are not -> the step is skipped."""
  model = ModelConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                      head_dim=16, d_ff=64, max_seq_len=16)
  params = init.init_params(model, jax.random.key(0))
  logprob_fn = make_logprob_fn(model, precision.policy_for("fp32", layout.matmuls(model)))
  cfg = UpdateConfig(loss=LossConfig(), correction=CorrectionConfig(), mu=2)
  tx = optax.sgd(float("inf"))
  b, t = 4, 10
  batch = RLBatch(tokens_BT=jax.random.randint(jax.random.key(1), (b, t), 3, 16),
                  input_mask_BT=jnp.ones((b, t)), loss_mask_BT=jnp.ones((b, t)).at[:, :5].set(0),
                  logp_sampler_BT=jnp.zeros((b, t)), adv_B=jnp.linspace(-1, 1, b))
  new, _, m = jax.jit(make_rl_update(logprob_fn, tx, cfg))(params, tx.init(params), None, batch,
                                                          jax.random.key(2))
  assert float(m["skipped_updates"]) == 2 and float(m["grad_norm"]) > 0
  for a, b_ in zip(jax.tree.leaves(new), jax.tree.leaves(params), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b_))


# -- config checks ---------------------------------------------------------------------------

def _tiny_config():
  return tiny.loop_config("fp32")


@pytest.mark.parametrize("path, value", [
    ("optimizer.lr", float("inf")), ("optimizer.lr", float("nan")), ("rl.clip_eps_low", float("inf")),
    ("rl.loss", "ppo2"), ("rl.correction", "foo"), ("rl.kl_estimator", "k9"),
    ("async_rl.lag", -1), ("rl.top_p", 1.5), ("max_skipped_steps", 0),
    ("task.path", "x.jsonl"),  # only for task.name=jsonl
])
def test_bad_values_name_their_flag(path, value):
  c = _tiny_config()
  run_config.set_path(c, path, value)
  with pytest.raises(ValueError, match=f"--config.{path}"):
    build(c)


def test_jsonl_task_from_flags_checks_both_splits_before_compile(tmp_path):
  path = tmp_path / "one.jsonl"
  path.write_text('{"prompt": "1+1=", "answer": "2"}\n')
  c = _tiny_config()
  c.task.name, c.task.kwargs, c.task.path = "jsonl", ml_collections.ConfigDict({}), str(path)
  c.task.verifier = "numeric"
  with pytest.raises(ValueError, match="'eval' split .* is empty"):
    build(c)
  c.task.path = ""
  with pytest.raises(ValueError, match="needs --config.task.path"):
    build(c)


def test_jsonl_non_utf8_names_file_and_line(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "caf\xe9", "answer": "3"}\n')
  with pytest.raises(ValueError, match=r"bad.jsonl:3: not valid UTF-8 \(byte 0xe9 at column 16\)"):
    JsonlTask(path)
