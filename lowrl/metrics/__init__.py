"""Metric logging: TensorBoard event files via tensorboardX (no TensorFlow)."""
from lowrl.metrics.writer import MetricWriter, NullWriter, Writer, create_writer

__all__ = ["MetricWriter", "NullWriter", "Writer", "create_writer"]
