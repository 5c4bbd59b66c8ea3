"""experiments/compile_levers.py's kernel-code comparison and lever specs, and
experiments/bench_repeat_run.py's reading of XLA:CPU's compile timers (no compiling here)."""
from experiments import bench_repeat_run, compile_levers

# XLA:CPU's log lines as jaxlib 0.10.2 writes them under bench_repeat_run._XLA_LOG_ENV (copied
# from a run, prefixes shortened): two programs, the second with two kernel modules.
_LOG = """\
I1207 20:56:34.885118 2338 cpu_compiler.cc:1269] Running HLO passes on [jit_multiply] for CPU time: 1.14 ms (1135 us) (cumulative: 4.09 ms, max: 1.14 ms, #called: 4)
I1207 20:56:34.885174 2338 cpu_compiler.cc:2091] Compiling: jit_multiply
I1207 20:56:34.942192 2340 ir_compiler.cc:293] Compiled LLVM module: __compute_module_broadcast_multiply_fusion_kernel_module time: 17 ms (17044 us) (cumulative: 49 ms, max: 17 ms, #called: 3)
I1207 20:56:34.961951 2338 cpu_compiler.cc:2094] Compiling [jit_multiply] for CPU using JIT time: 48.6 ms (48579 us) (cumulative: 163 ms, max: 53.8 ms, #called: 4)
I1207 20:56:35.001712 2338 cpu_compiler.cc:1269] Running HLO passes on [jit_step] for CPU time: 3.02 s (3016000 us) (cumulative: 7.1 s, max: 3.02 s, #called: 5)
I1207 20:56:35.001775 2338 cpu_compiler.cc:2091] Compiling: jit_step
I1207 20:56:35.002366 2338 cpu_compiler.cc:1495] `xla_cpu_max_isa` is set. Will not use features newer than: AVX2
I1207 20:56:35.064791 2341 ir_compiler.cc:293] Compiled LLVM module: __compute_module_exponential_add_fusion.1_kernel_module time: 154 ms (154284 us) (cumulative: 286 ms, max: 154 ms, #called: 5)
I1207 20:56:35.064935 2340 ir_compiler.cc:293] Compiled LLVM module: __compute_module___compute_module_wrapped_log time: 83 ms (83021 us) (cumulative: 132 ms, max: 83 ms, #called: 4)
I1207 20:56:35.218981 2338 cpu_compiler.cc:2094] Compiling [jit_step] for CPU using JIT time: 5.2 s (5200000 us) (cumulative: 5.3 s, max: 5.2 s, #called: 5)
"""


def test_xla_stages_splits_each_program_and_gives_it_the_llvm_modules_compiled_in_its_window():
  stages = bench_repeat_run.xla_stages(_LOG)
  assert stages.keys() == {"multiply", "step"}
  assert stages["multiply"] == {"hlo": 0.001135, "backend": 0.048579, "llvm": 0.017044}
  assert stages["step"]["hlo"] == 3.016 and stages["step"]["backend"] == 5.2
  assert abs(stages["step"]["llvm"] - (0.154284 + 0.083021)) < 1e-12


def _dump(root, name, objects, hlo):
  d = root / name
  d.mkdir()
  for kernel, code in objects.items():
    (d / f"module_0007.jit_f.obj-file.{kernel}.o").write_bytes(code)
  (d / "module_0007.jit_f.cpu_after_optimizations.txt").write_text(hlo)
  return str(d)


def test_same_code_counts_kernels_that_differ_or_exist_on_one_side(tmp_path):
  base = _dump(tmp_path, "base", {"a_kernel_module": b"\x01\x02", "b_kernel_module": b"\x03"},
               "HloModule f")
  # Another module number (compile order) but the same kernels and HLO: the same code.
  same = tmp_path / "same"
  same.mkdir()
  for f in (tmp_path / "base").iterdir():
    (same / f.name.replace("0007", "0011")).write_bytes(f.read_bytes())
  assert compile_levers.same_code(base, str(same)) == (0, 2, True)
  one_byte = _dump(tmp_path, "one_byte", {"a_kernel_module": b"\x01\x03",
                                          "b_kernel_module": b"\x03"}, "HloModule f")
  assert compile_levers.same_code(base, one_byte) == (1, 2, True)
  refused = _dump(tmp_path, "refused", {"a_kernel_module": b"\x01\x02",
                                        "c_kernel_module": b"\x03"}, "HloModule f, other")
  assert compile_levers.same_code(base, refused) == (2, 2, False)


def test_levers_parse_typed_options_with_base_first():
  levers = compile_levers.parse_levers(
      "split1:xla_cpu_parallel_codegen_split_count=1;"
      "fast:xla_cpu_opt_preset=CPU_OPT_PRESET_FAST_COMPILE,xla_llvm_disable_expensive_passes=true")
  assert list(levers) == ["base", "split1", "fast"]
  assert levers["base"] == []
  assert levers["split1"] == [("xla_cpu_parallel_codegen_split_count", 1)]
  assert levers["fast"] == [("xla_cpu_opt_preset", "CPU_OPT_PRESET_FAST_COMPILE"),
                            ("xla_llvm_disable_expensive_passes", True)]
