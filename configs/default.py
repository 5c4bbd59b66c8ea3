"""The main job: the default pipeline under the 4-bitter `nvfp4_recipe`."""
from configs import base


def get_config():
  c = base.get_config("nvfp4_recipe")
  # Packed update and scoring (docs/sampling.md): rows of 2 x (13 prompt columns + 8 new
  # tokens), 16 per micro-batch; the whole step 0.93x the padded one's CPU time here
  # (docs/benchmarks.md). A longer --config.rl.max_new_tokens needs a wider row (or 0 = off).
  c.rl.pack_tokens = 42
  c.rl.pack_rows = 16
  # No decode compaction: the completions are short (8 tokens at most), so its five buckets
  # (256..16 rows, each a decode step compiled on its own) cost compile time and saved no
  # rollout time; the metrics are byte-identical without it (docs/benchmarks.md, issue 46).
  c.sampler_decode_min_rows = 0
  return c
