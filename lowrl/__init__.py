"""lowrl: low-precision policy-gradient RL for language models in JAX."""
