"""Per-tensor-class NCCL settings: which protocol, algorithm and CTA bounds each class's process group gets.

Sits between the profile (`collectives.mode`/`default` and the NCCL keys of `sync.classes.<name>`) and the groups the
strategies create through `class_group`. Modules, by concept:
  settings     the modes, NCCL's names, validation of the profile's NCCL choices
  classes      each class's resolved choices (`resolve`, `class_names`, `requested`)
  versions     NCCL's version, at run time or given
  guards       what NCCL's behaviour calls for: errors and warnings by mode and version
  groups       the group settings of a profile (`build_groups`, `groups_text`) and applying them (`apply_global`,
               `class_group`, `run_record`)
  tuner        dtrain's tuner plugin (build, rules file) and configs for NCCL's example plugin
  log          the one reader of NCCL_DEBUG logs (ENV, TUNING in both formats, the init table)
  check        observed against requested, per bucket (`verify_run`)
Its command line (groups, build-tuner, tuner-config, tuner-check, parse-log, gpu-check), the plugin driven through
ctypes on NCCL's modeled cost table (`tuner_check`) and the one-GPU check sit above it, with the profile's reader and
the cost model: `dtrain.collectives.tools`.
"""

from dtrain.collectives.nccl.check import check_decisions, load_buckets, render_check, verify_run
from dtrain.collectives.nccl.classes import class_names, requested, resolve
from dtrain.collectives.nccl.groups import (
    GroupSettings,
    NcclSetup,
    apply_global,
    build_groups,
    class_group,
    groups_text,
    render_groups,
    reset,
    run_record,
)
from dtrain.collectives.nccl.log import Decision, EnvSetting, InitTable, parse_init_table, parse_log
from dtrain.collectives.nccl.settings import COLLECTIVES, MODES, validate_config
from dtrain.collectives.nccl.tuner import (ExampleRule, build_tuner, example_tuner_csv, read_example_config, tuner_lib_path,
                                    tuner_rules)
from dtrain.collectives.nccl.versions import nccl_version, parse_version

__all__ = [
    "COLLECTIVES", "MODES", "Decision", "EnvSetting", "GroupSettings", "InitTable", "NcclSetup",
    "ExampleRule", "apply_global", "build_groups", "build_tuner", "check_decisions", "class_group", "class_names",
    "example_tuner_csv", "groups_text", "load_buckets", "nccl_version", "parse_init_table", "parse_log",
    "parse_version", "read_example_config", "render_check", "render_groups", "requested", "reset", "resolve",
    "run_record", "tuner_lib_path", "tuner_rules", "validate_config",
    "verify_run",
]
