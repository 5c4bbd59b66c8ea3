"""Statistics for experiment reports (paired tests, Holm correction, claim verdicts)."""
