"""Asynchronous-RL simulation: staleness schedule, parameter versions, drift decomposition (used by
the real loop), and a fast in-jit simulator with its resumable grid sweep (simulator, sweep)."""
