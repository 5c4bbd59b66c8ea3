"""Device mesh, parameter sharding rules and the placement of pytrees on the mesh.

One parameter tree, sharded over a `jax.sharding.Mesh`, is the input of both the sampler and the
trainer: every jitted step gets explicit `in_shardings`/`out_shardings` from a `ShardingPlan`, so
nothing is gathered onto one device between rollout and update. The same code runs on one CPU, on
the 8 fake CPU devices of the tests, on one GPU node and on a multi-host pod (`lowrl.distributed`).
This module never builds the model: it places abstract shape trees (`init.param_shapes`,
optimizer states) and reads where a matmul's weight lives from the model's layout.

Mesh: named axes from config (`mesh.axes`, default `("data", "model")`); `mesh.shape` gives one
size per axis, -1 filling the remaining devices. By convention the batch is split over `batch_axes`
(default `("data",)`), which also shard the parameters FSDP-style, and "model" is the
tensor-parallel axis.

Rules (big_vision style): an ordered tuple of `(regex, spec)`; a parameter's path
("layers_3/attn/q_proj/kernel") is matched with `re.fullmatch`, the first match wins, and `spec`
has one entry per leading dimension: None (replicated), a mesh axis name, or a tuple of axis names.
Missing trailing entries are replicated; a path no rule matches is replicated. `DEFAULT_RULES` is
the Megatron layout for Llama/Qwen kernels (`[in, out]`): q/k/v/gate/up are column-parallel
(`("data", "model")`), o/down row-parallel (`("model", "data")`), the embedding vocab-parallel,
norms replicated. A dimension that the named axes do not divide is replicated instead (and
reported by `ShardingPlan.fallbacks`), or is an error with `strict=True`.

Optimizer state and checkpoint trees get their shardings by matching leaves to parameters
(`shardings_like_params`): a leaf whose dict-key path ends with a parameter's path and has that
parameter's shape gets its sharding (Adam's mu/nu, reference params, kept versions); anything else
(step counters, RNG keys) is replicated.

Whether quantization blocks fit the shards this plan cuts is `lowrl.quant_blocks`' check.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Iterable, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from lowrl.models import layout, row_sharding
from lowrl.models.config import ModelConfig

SpecEntry = str | tuple[str, ...] | None
Spec = tuple[SpecEntry, ...]
Rules = tuple[tuple[str, Spec], ...]

DATA, MODEL = "data", "model"

# Llama/Qwen kernels are [in, out]: column-parallel layers split `out` over the tensor axis and
# row-parallel layers split `in`, so each attention head / MLP slice stays on one tensor shard and
# only o_proj/down_proj outputs need a reduction. The other dimension is FSDP over the data axis.
DEFAULT_RULES: Rules = (
    (r".*/attn/(q|k|v)_proj/kernel", (DATA, MODEL)),
    (r".*/attn/(q|k|v)_proj/bias", (MODEL,)),
    (r".*/attn/o_proj/kernel", (MODEL, DATA)),
    (r".*/mlp/(gate|up)_proj/kernel", (DATA, MODEL)),
    (r".*/mlp/down_proj/kernel", (MODEL, DATA)),
    (r"embed/embedding", (MODEL, DATA)),  # [V, D]: vocab-parallel
    (r"lm_head/kernel", (DATA, MODEL)),  # [D, V]: vocab-parallel logits
    # Mixture of experts (dense models have none of these paths): the shared expert like the
    # MLP; stacked routed experts [E, in, out] with E whole on every device (expert parallel:
    # `expert_parallel_rules`) and in/out as the MLP's; routers replicated (catch-all).
    (r".*/mlp/shared_expert/(gate|up)_proj/kernel", (DATA, MODEL)),
    (r".*/mlp/shared_expert/down_proj/kernel", (MODEL, DATA)),
    (r".*/mlp/experts/(gate|up)_proj/kernel", (None, DATA, MODEL)),
    (r".*/mlp/experts/down_proj/kernel", (None, MODEL, DATA)),
    (r".*", ()),  # norms, q/k norms: replicated
)
EXPERT = "expert"


def expert_parallel_rules(expert_axis: str = EXPERT, rules: Rules = DEFAULT_RULES) -> Rules:
  """`rules` with the routed experts' E dimension split over `expert_axis` (expert parallel:
  each device of that axis holds E / size experts whole; their in/out dims as in `rules`).
  The mesh must name `expert_axis`, e.g. mesh.axes=("data", "expert", "model")."""
  return ((r".*/mlp/experts/(gate|up)_proj/kernel", (expert_axis, DATA, MODEL)),
          (r".*/mlp/experts/down_proj/kernel", (expert_axis, MODEL, DATA))) + tuple(rules)


# ----------------------------------------------------------------------------------------------
# Mesh.


def make_mesh(shape: Sequence[int], axes: Sequence[str],
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh of `devices` (default: all, over every process) with named `axes`.

  Raises:
    ValueError: malformed axes or sizes, or sizes that do not multiply to the device count; the
      message names the fix.
  """
  axes, shape = tuple(axes), tuple(shape)
  if not axes or not all(isinstance(a, str) and a for a in axes) or len(set(axes)) != len(axes):
    raise ValueError(f"mesh.axes={axes!r} must be distinct non-empty names, e.g. "
                     "('data', 'model').")
  if len(shape) != len(axes):
    raise ValueError(f"mesh.shape={shape} has {len(shape)} sizes but mesh.axes={axes} names "
                     f"{len(axes)} axes; give one size per axis (-1 = the remaining devices).")
  if any(not isinstance(s, (int, np.integer)) or isinstance(s, bool) or (s < 1 and s != -1)
         for s in shape) or shape.count(-1) > 1:
    raise ValueError(f"mesh.shape={shape}: sizes must be positive ints, with at most one -1 "
                     "(which fills the remaining devices).")
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  fixed = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if n % fixed:
      raise ValueError(f"mesh.shape={shape}: the fixed sizes multiply to {fixed}, which does not "
                       f"divide the {n} available {devices[0].platform} devices; pick sizes that "
                       f"divide {n}.")
    shape = tuple(n // fixed if s == -1 else int(s) for s in shape)
  elif fixed != n:
    raise ValueError(f"mesh.shape={shape} needs {fixed} devices but {n} {devices[0].platform} "
                     f"devices are available; use -1 for the axis that fills the rest, e.g. "
                     f"mesh.shape={(-1,) + shape[1:]}.")
  types = (AxisType.Auto,) * len(axes)  # GSPMD propagation: the model code stays sharding-free.
  try:
    return jax.make_mesh(shape, axes, axis_types=types, devices=devices)
  except (ValueError, NotImplementedError, AssertionError):
    # Topology-aware placement does not cover every device subset (e.g. part of a TPU slice).
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), axes, axis_types=types)


def entry_axes(entry: SpecEntry) -> tuple[str, ...]:
  """The mesh axes a spec entry names (None: none; one name; a tuple of names)."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def normalize_rules(rules: Iterable[Any], axes: Sequence[str]) -> Rules:
  """Rules as hashable tuples; ValueError for bad regexes and axis names not in `axes`."""
  out = []
  for rule in rules:
    if not isinstance(rule, (tuple, list)) or len(rule) != 2 or not isinstance(rule[0], str):
      raise ValueError(f"mesh.rules entry {rule!r} must be (regex, spec), e.g. "
                       "('.*/mlp/down_proj/kernel', ('model', 'data')).")
    pattern, spec = rule
    try:
      re.compile(pattern)
    except re.error as e:
      raise ValueError(f"mesh.rules regex {pattern!r} is invalid: {e}.") from e
    if spec is None or isinstance(spec, str):
      spec = (spec,)
    entries = []
    used: list[str] = []
    for entry in spec:
      if entry is not None and not isinstance(entry, str):
        entry = tuple(entry)
      for a in entry_axes(entry):
        if a not in axes:
          raise ValueError(f"mesh.rules: {pattern!r} -> {tuple(spec)!r} names axis {a!r}, which is "
                           f"not in mesh.axes={tuple(axes)}; use one of them or None.")
        if a in used:
          raise ValueError(f"mesh.rules: {pattern!r} -> {tuple(spec)!r} uses axis {a!r} twice; a "
                           "mesh axis can shard only one dimension of a parameter.")
        used.append(a)
      entries.append(entry)
    out.append((pattern, tuple(entries)))
  return tuple(out)


def _dict_path(keypath) -> tuple[str, ...]:
  """The dict keys of a key path (attribute / index entries of optax states are skipped)."""
  return tuple(str(k.key) for k in keypath if isinstance(k, jax.tree_util.DictKey))


def abstract(shapes: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs of `shapes` (arrays or structs) carrying `shardings` (a matching tree)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      shapes, shardings)


# ----------------------------------------------------------------------------------------------
# The plan.


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
  """A mesh plus the rules that lay parameters and batches out on it (hashable: a cache key).

  Attributes:
    mesh: the device mesh (all processes' devices).
    rules: ((regex, spec), ...) over parameter paths; see the module docstring.
    batch_axes: mesh axes the batch dimension of activations, rollouts and the KV cache is split
      over.
    strict: a rule axis that does not divide its parameter dimension is a ValueError (default: that
      dimension is replicated and listed by `fallbacks`).
  """

  mesh: Mesh
  rules: Rules = DEFAULT_RULES
  batch_axes: tuple[str, ...] = (DATA,)
  strict: bool = False

  def __post_init__(self):
    object.__setattr__(self, "rules", normalize_rules(self.rules, self.mesh.axis_names))
    batch_axes = (self.batch_axes,) if isinstance(self.batch_axes, str) else tuple(self.batch_axes)
    object.__setattr__(self, "batch_axes", batch_axes)
    unknown = [a for a in batch_axes if a not in self.mesh.axis_names]
    if unknown or len(set(batch_axes)) != len(batch_axes):
      raise ValueError(f"mesh.batch_axes={batch_axes} must be distinct names from mesh.axes="
                       f"{tuple(self.mesh.axis_names)}.")

  # -- basic shardings --------------------------------------------------------------------------

  def size(self, entry: SpecEntry) -> int:
    """Number of shards a spec entry splits a dimension into."""
    return math.prod(self.mesh.shape[a] for a in entry_axes(entry))

  @property
  def batch_shards(self) -> int:
    return self.size(self.batch_axes)

  @property
  def batch_entry(self) -> SpecEntry:
    """The spec entry of the batch dimension: None, one axis name or the tuple of batch axes."""
    if not self.batch_axes:
      return None
    return self.batch_axes[0] if len(self.batch_axes) == 1 else self.batch_axes

  def named(self, *entries: SpecEntry) -> NamedSharding:
    return NamedSharding(self.mesh, P(*entries))

  @property
  def replicated(self) -> NamedSharding:
    return self.named()

  @property
  def batch(self) -> NamedSharding:
    """Leading (batch) dimension over `batch_axes`, the rest replicated (any rank >= 1)."""
    return self.named(self.batch_entry)

  def rows(self):
    """Context for tracing a program whose activations stay split over the batch axes
    (`lowrl.models.row_sharding`: each device processes only its rows)."""
    return row_sharding.rows_over(self.mesh, self.batch_entry)

  def check_batch(self, n: int, what: str) -> None:
    """ValueError unless a batch of `n` rows splits evenly over the batch axes."""
    if n % self.batch_shards:
      raise ValueError(f"{what} = {n} rows cannot be split over the {self.batch_shards} shards of "
                       f"mesh axes {self.batch_axes} (mesh {dict(self.mesh.shape)}); make it a "
                       f"multiple of {self.batch_shards} or change mesh.shape.")

  # -- parameters -------------------------------------------------------------------------------

  def _resolve(self, path: str, shape: tuple[int, ...]) -> tuple[P, list[str]]:
    for pattern, spec in self.rules:
      if re.fullmatch(pattern, path):
        break
    else:
      return P(), []
    if len(spec) > len(shape):
      raise ValueError(f"mesh.rules: {pattern!r} -> {spec!r} gives {len(spec)} dims to {path} of "
                       f"shape {shape}; shorten the spec or make the regex more specific.")
    entries, notes = [], []
    for dim, entry in zip(shape, spec + (None,) * (len(shape) - len(spec))):
      n = self.size(entry)
      if dim % n:
        msg = (f"{path}: dim of size {dim} is not divisible by the {n} shards of mesh axes "
               f"{entry_axes(entry)}")
        if self.strict:
          raise ValueError(f"{msg}; change mesh.shape, add an earlier mesh.rules entry for this "
                           "path, or set mesh.strict=False to replicate such dims.")
        notes.append(msg + ": replicated")
        entry = None
      entries.append(entry)
    while entries and entries[-1] is None:
      entries.pop()
    return P(*entries), notes

  def _walk(self, params: Any):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    # A packed kernel's codes and scales (PackedWeight fields, a LoRA run's packed base) have no
    # kernel's shape: replicated.
    resolved = [(P(), []) if any(isinstance(k, jax.tree_util.GetAttrKey) for k in kp)
                else self._resolve("/".join(_dict_path(kp)), tuple(np.shape(x)))
                for kp, x in leaves]
    return treedef, resolved

  def param_spec(self, keys: Sequence[str], shape: Sequence[int]) -> P:
    """The PartitionSpec of one parameter: its dict keys in the tree and its shape."""
    return self._resolve("/".join(keys), tuple(shape))[0]

  def matmul_spec(self, m: layout.Matmul) -> P:
    """The PartitionSpec of matmul `m`'s weight (its place and shape from the layout)."""
    return self.param_spec(m.param_keys, m.weight_shape)

  def param_specs(self, params: Any) -> Any:
    """PartitionSpecs for a parameter tree (arrays or ShapeDtypeStructs)."""
    treedef, resolved = self._walk(params)
    return jax.tree.unflatten(treedef, [spec for spec, _ in resolved])

  def param_shardings(self, params: Any) -> Any:
    """NamedShardings for a parameter tree."""
    return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.param_specs(params),
                        is_leaf=lambda x: isinstance(x, P))

  def fallbacks(self, params: Any) -> list[str]:
    """The dimensions the rules name but cannot shard evenly (replicated instead)."""
    return [n for _, notes in self._walk(params)[1] for n in notes]

  def shardings_like_params(self, tree: Any, params: Any) -> Any:
    """Shardings for any tree holding parameter-shaped leaves (optimizer state, checkpoints).

    A leaf gets the sharding of the parameter whose path its dict-key path ends with, if the shapes
    agree; every other leaf is replicated.
    """
    p_leaves, _ = jax.tree_util.tree_flatten_with_path(params)
    p_specs = jax.tree.leaves(self.param_specs(params), is_leaf=lambda x: isinstance(x, P))
    by_path = {"/".join(_dict_path(kp)): (tuple(np.shape(x)), s)
               for (kp, x), s in zip(p_leaves, p_specs)}

    def leaf(kp, x):
      names = _dict_path(kp)
      for i in range(len(names)):
        hit = by_path.get("/".join(names[i:]))
        if hit is not None and hit[0] == tuple(np.shape(x)):
          return NamedSharding(self.mesh, hit[1])
      return self.replicated

    return jax.tree_util.tree_map_with_path(leaf, tree)

  # -- KV cache ---------------------------------------------------------------------------------

  def kv_head_entry(self, model_cfg: ModelConfig) -> SpecEntry:
    """Mesh axes of the cache's kv-head dim: those splitting k_proj's output columns, when whole
    heads land on each shard (else replicated, so attention never splits a head)."""
    k_proj = layout.matmul(model_cfg, 0, "attn/k_proj")
    spec = self.matmul_spec(k_proj)
    out_axis = 1 - k_proj.contract_axis
    entry = spec[out_axis] if len(spec) > out_axis else None
    axes = entry_axes(entry)
    if not axes or set(axes) & set(self.batch_axes) or model_cfg.n_kv_heads % self.size(entry):
      return None
    return entry

  def cache_note(self, model_cfg: ModelConfig) -> str | None:
    """Why the KV cache's kv heads are replicated over a tensor axis that splits k_proj's columns
    (each of its devices then holds the whole cache of its rows), or None when they are split or
    there is no such axis. Said before compiling; the fix is a mesh whose tensor axis divides
    n_kv_heads."""
    k_proj = layout.matmul(model_cfg, 0, "attn/k_proj")
    spec = self.matmul_spec(k_proj)
    out_axis = 1 - k_proj.contract_axis
    entry = spec[out_axis] if len(spec) > out_axis else None
    tensor = tuple(a for a in entry_axes(entry) if a not in self.batch_axes)
    if not tensor or self.kv_head_entry(model_cfg) is not None:
      return None
    n = self.size(tensor)
    return (f"KV cache: n_kv_heads={model_cfg.n_kv_heads} is not divisible by the {n} shards of "
            f"mesh axes {tensor}, so the cache's kv heads are replicated over them ({n}x the "
            f"cache memory per device); pick mesh.shape with a tensor axis dividing "
            f"{model_cfg.n_kv_heads}.")

  def cache_shardings(self, model_cfg: ModelConfig) -> dict[str, Any]:
    """Shardings of `transformer.init_cache`'s tree: k/v [B, S, K, hd] over (batch, -, heads, -)
    (stacked [L, B, S, K, hd], layers unsplit, when model_cfg.scan_layers)."""
    heads = self.kv_head_entry(model_cfg)
    if model_cfg.scan_layers:
      kv = self.named(None, self.batch_entry, None, heads)
      return {"index": self.replicated, "mask": self.batch, "layers": {"k": kv, "v": kv}}
    kv = self.named(self.batch_entry, None, heads)
    return {"index": self.replicated, "mask": self.batch,
            "layers": tuple({"k": kv, "v": kv} for _ in range(model_cfg.n_layers))}

  # -- placement --------------------------------------------------------------------------------

  def put(self, tree: Any, shardings: Any) -> Any:
    """`tree` placed with `shardings` (a tree prefix of it; a single sharding covers everything).

    Leaves already placed that way are returned as they are. Host values (numpy, or arrays on one
    local device) are taken to be the *global* value, the same on every process: each process
    contributes the shards its devices hold. So every process must call this alike (lockstep).
    """
    is_sharding = lambda s: isinstance(s, jax.sharding.Sharding)  # noqa: E731
    full = jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), shardings, tree,
                        is_leaf=is_sharding)
    leaves, treedef = jax.tree.flatten(tree)
    targets = treedef.flatten_up_to(full)
    out = list(leaves)
    # Global arrays placed otherwise are resharded on the devices, all in one program.
    moves = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)
             and x.sharding != targets[i] and not x.is_fully_addressable]
    if moves:
      moved = jax.jit(lambda xs: xs, out_shardings=[targets[i] for i in moves])(
          [leaves[i] for i in moves])
      for i, x in zip(moves, moved):
        out[i] = x
    moved_set = set(moves)
    for i, x in enumerate(leaves):
      if i not in moved_set:
        out[i] = _put(x, targets[i])
    return jax.tree.unflatten(treedef, out)


def _put(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
  # Only an equal sharding is kept as is: an equivalent one (a single-device array for a one-device
  # mesh) would give jitted steps a different input type, hence a retrace.
  if isinstance(x, jax.Array) and x.sharding == sharding:
    return x
  if jax.process_count() == 1:
    return jax.device_put(x, sharding)
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    data = _put(jax.random.key_data(x), sharding)
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def single_device_plan(axes: Sequence[str] = (DATA, MODEL)) -> ShardingPlan:
  """A plan on this process's first device (every axis of size 1): the unsharded layout."""
  mesh = make_mesh((1,) * len(axes), axes, jax.local_devices()[:1])
  return ShardingPlan(mesh, batch_axes=(axes[0],))


def plan_from_config(mesh_cfg: Any, devices: Sequence[jax.Device] | None = None) -> ShardingPlan:
  """The plan of a `config.mesh` ConfigDict: shape, axes, and optional rules, batch_axes, strict."""
  mesh = make_mesh(mesh_cfg.shape, mesh_cfg.axes, devices)
  get = lambda k, d: mesh_cfg.get(k, d)  # noqa: E731
  rules = get("rules", None)
  return ShardingPlan(mesh, rules=DEFAULT_RULES if rules is None else tuple(rules),
                      batch_axes=tuple(get("batch_axes", (DATA,))),
                      strict=bool(get("strict", False)))
