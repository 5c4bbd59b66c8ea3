"""Asynchronous-RL simulation: staleness schedule, parameter versions, drift decomposition."""
