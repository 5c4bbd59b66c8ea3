"""The hardware presets (`lowrl.hardware`): tensor rates per format, the `hardware` knob's device
memory (a preset's HBM, none, or the host's RAM shared by the CPU devices), one-line errors for
unknown names."""

import jax
import pytest

from lowrl import hardware as hardware_lib
from lowrl import memory
from lowrl.asyncrl import cost_model


def test_hardware_presets():
  assert cost_model.HARDWARE is hardware_lib.HARDWARE  # moved, not copied
  v5p = hardware_lib.hardware("v5p")
  assert v5p.flops_per_s("mxfp8_e4m3") == v5p.flops_per_s("bf16") == 459e12
  h100 = hardware_lib.hardware("h100_sxm")
  assert h100.flops_per_s("nvfp4") == h100.flops_per_s("bf16")  # no FP4 tensor cores
  assert hardware_lib.hardware("b200").flops_per_s("nvfp4") == 9000e12
  with pytest.raises(ValueError, match="unknown hardware 'tpu'"):
    hardware_lib.hardware("tpu")
  with pytest.raises(ValueError, match="has no tensor rate"):
    h100.flops_per_s("int4")


def test_device_memory():
  assert memory.device_memory("h100_sxm")[0] == 80e9
  assert memory.device_memory("none")[0] is None
  # The tests' fake devices are CPUs: auto means the host's RAM, shared by them.
  ram, source = memory.host_memory()
  assert ram > 0 and source in ("host RAM", "cgroup memory limit")
  assert memory.device_memory("auto")[0] == ram / jax.local_device_count()
  with pytest.raises(ValueError, match="hardware='tpu'; use one of"):
    memory.device_memory("tpu")
