"""Config schema, defaults, validation and loading.

Every kvlab run is described by one `ml_collections.ConfigDict` with seven
sections (docs/architecture.md, "Configs"): `model`, `cache`, `train`, `data`, `eval`, `wandb`,
`mesh`. Config files in `configs/` start from `base_config(variant)` and change what they study.

    cfg = kvlab.load_config("configs/gqa.py:tiny")   # loads and validates
    cfg.model.num_kv_heads = 1
    kvlab.validate_config(cfg)                       # re-checks after edits

`validate_sections` first fills the fields a config omits with `base_config()`'s
defaults (`complete_config`: a grouped-query model needs no `mla` section), then
raises `ValueError` naming the field, its value and the fix for every unknown,
inconsistent or out-of-range field. What only the files a config names can tell
(data.tokenizer's token ids, the length of eval.tasks' samples) is checked by
kvlab.data, which reads them: `kvlab.validate_config` and `kvlab.load_config`
(kvlab/data/__init__.py) run both, before anything is compiled.

    schema.py     the constants, base_config (every field, its default and what it means)
                  and frozen_schema (its fields built once: what validation checks against),
                  what each attention kind caches (cached_tensors), dtype_of
    fields.py     the generic checks of one field (check_count, check_int, ...), frozen,
                  import_config_file
    model.py      the model section: validate_model_config, parse_rope_scaling
    cache.py      the cache section, alone and against the model: validate_cache_config,
                  evict_methods
    sections.py   complete_config, validate_sections (every section, and the train, data,
                  eval and mesh sections), eval_seq_len, mesh_axes, check_mesh_shape

Each module imports only the rows below its own (sections > cache | model > schema |
fields); this file re-exports their public names.
"""

from kvlab.config.cache import evict_methods, layer_sections, validate_cache_config
from kvlab.config.fields import check_count, frozen, import_config_file
from kvlab.config.model import parse_rope_scaling, validate_model_config
from kvlab.config.schema import (
    ATTENTION_KINDS,
    BIT_WIDTHS,
    BYTE_VOCAB_SIZE,
    CACHE_KINDS,
    CACHED_PREFIXES,
    DATA_SOURCES,
    DTYPES,
    EVAL_SPLITS,
    EVAL_TASKS,
    EVICT_WHEN,
    GROUP_AXES,
    LAYER_TYPES,
    LOGICAL_AXIS_RULES,
    MESH_AXES,
    MOE_ROUTINGS,
    ROPE_SCALINGS,
    SEED_LIMIT,
    UNSCORED_METHODS,
    VARIANTS,
    WANDB_MODES,
    CachedTensor,
    base_config,
    cached_prefixes,
    cached_tensors,
    dtype_of,
    is_hybrid,
    layer_windows,
)
from kvlab.config.sections import (
    check_mesh_shape,
    complete_config,
    eval_seq_len,
    mesh_axes,
    validate_eval_config,
    validate_mesh_config,
    validate_sections,
)

__all__ = [
    "ATTENTION_KINDS",
    "BIT_WIDTHS",
    "BYTE_VOCAB_SIZE",
    "CACHED_PREFIXES",
    "CACHE_KINDS",
    "CachedTensor",
    "DATA_SOURCES",
    "DTYPES",
    "EVAL_SPLITS",
    "EVAL_TASKS",
    "EVICT_WHEN",
    "GROUP_AXES",
    "LAYER_TYPES",
    "LOGICAL_AXIS_RULES",
    "MESH_AXES",
    "MOE_ROUTINGS",
    "ROPE_SCALINGS",
    "SEED_LIMIT",
    "UNSCORED_METHODS",
    "VARIANTS",
    "WANDB_MODES",
    "base_config",
    "cached_prefixes",
    "cached_tensors",
    "check_count",
    "check_mesh_shape",
    "complete_config",
    "dtype_of",
    "eval_seq_len",
    "evict_methods",
    "frozen",
    "import_config_file",
    "is_hybrid",
    "layer_sections",
    "layer_windows",
    "mesh_axes",
    "parse_rope_scaling",
    "validate_cache_config",
    "validate_eval_config",
    "validate_mesh_config",
    "validate_model_config",
    "validate_sections",
]
