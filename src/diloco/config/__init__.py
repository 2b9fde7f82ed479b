"""Configuration: one frozen dataclass per component, every setting declared once, model presets.

A config comes from defaults, then a TOML file (`--config`), then CLI flags, in that order.
Each field declares its default, `diloco train` flag, help text, choices, when it applies (`needs`)
and its group in `--help` with `setting(...)` (diloco.settings); the CLI's flags and the error
messages come from there. The resolved config is saved as `config.json` in the run directory and
read back by `--resume`. Every check a user can fail raises `UserError` with one sentence naming the
field and the fix. Adding a setting touches its field, its component, and a range check in
`validate` where its declaration cannot say it.

- `sections`: the per-component sections (ModelConfig, DataConfig, InnerConfig, OuterConfig,
  SimConfig, AsyncConfig, DyluConfig) and their choices; `OuterConfig.build()`, `AsyncConfig.build(...)`,
  `TrainConfig.streaming.build()` and `TrainConfig.communication.build_upload()` /
  `.build_download()` build the components;
- `train`: TrainConfig; `validate`: its checks; `load`: from_dict and the upgrade of old layouts;
- `parsers`: the text formats shared with the components (--speeds, --slowdown, --tokenizer,
  --model-config);
- `reference`: docs/config.md, every key with its table, flag and default, written from here.

    diloco train --config my.toml --workers 8
"""

from diloco.config.load import from_dict, upgrade
from diloco.config.sections import (
    CODECS,
    FLAG_GROUPS,
    MODEL_PRESETS,
    AsyncConfig,
    CommunicationConfig,
    DataConfig,
    DyluConfig,
    InnerConfig,
    ModelConfig,
    OuterConfig,
    SimConfig,
    StreamingConfig,
)
from diloco.config.train import TrainConfig, flag, label
from diloco.core.codec import DOWNLOAD_CODECS
from diloco.settings import load_json, load_toml, merge

# the public names; the choices of each component live with it (core.codec.CODECS,
# core.async_rules.ASYNC_RULES, core.outer.OUTER_OPTS, ...) and the checks in config.validate
__all__ = [
    "CODECS",
    "DOWNLOAD_CODECS",
    "FLAG_GROUPS",
    "MODEL_PRESETS",
    "AsyncConfig",
    "DyluConfig",
    "CommunicationConfig",
    "DataConfig",
    "InnerConfig",
    "ModelConfig",
    "OuterConfig",
    "SimConfig",
    "StreamingConfig",
    "TrainConfig",
    "flag",
    "from_dict",
    "label",
    "load_json",
    "load_toml",
    "merge",
    "upgrade",
]
