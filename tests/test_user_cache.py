"""The user cache (`lowrl.user_cache`): the compile-cache flag turns JAX's persistent compilation
cache off ("none") or points it at a directory it creates."""
import os

import jax

from lowrl import user_cache


def test_compile_cache_flag_values(tmp_path):
  saved = (jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache,
           jax.config.jax_persistent_cache_min_compile_time_secs)
  try:
    assert user_cache.enable_compile_cache("none") is None
    assert not jax.config.jax_enable_compilation_cache
    assert jax.config.jax_compilation_cache_dir is None
    where = str(tmp_path / "moved")
    assert user_cache.enable_compile_cache(where) == where and os.path.isdir(where)
    assert jax.config.jax_compilation_cache_dir == where
    assert jax.config.jax_enable_compilation_cache
  finally:
    for name, value in zip(("jax_compilation_cache_dir", "jax_enable_compilation_cache",
                            "jax_persistent_cache_min_compile_time_secs"), saved):
      jax.config.update(name, value)
