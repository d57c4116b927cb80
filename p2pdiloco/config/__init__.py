"""Typed, validated configuration: frozen dataclasses loaded from TOML, environment and flags.

Precedence (later wins): defaults < TOML file < environment ``P2PDILOCO_<SECTION>_<FIELD>``
(``P2PDILOCO_<FIELD>`` for top-level fields such as ``P2PDILOCO_DATA_DIR``) < command-line
``--set section.field=value`` (and the dedicated flags that map onto them). Every problem
is reported as one line ``section.field: what is wrong (where it was set)`` in a single
:class:`ConfigError`; nothing starts with an invalid config.

Two rooms: :mod:`p2pdiloco.config.schema` (the sections, their fields, defaults and range
checks) and :mod:`p2pdiloco.config.loading` (the layers above, parsed into the schema).
"""

from p2pdiloco.config.loading import load_config, parse_overrides, setting_names, settings_in
from p2pdiloco.config.schema import (MAX_DURATION_S, MAX_FRAGMENTS, MAX_LOGITS, MAX_QUORUM, MAX_STEPS, MAX_WAIT_S,
                                     SECTIONS, TOP_LEVEL, TOPK2_RECIPE, WIRE_PRECISIONS, DataConfig, Invalid,
                                     NodeConfig, OuterConfig, ReachabilityMode, SwarmConfig, TrustConfig, topk2_note)

__all__ = ["MAX_DURATION_S", "MAX_FRAGMENTS", "MAX_LOGITS", "MAX_QUORUM", "MAX_STEPS", "MAX_WAIT_S", "SECTIONS",
           "TOP_LEVEL", "TOPK2_RECIPE", "WIRE_PRECISIONS", "DataConfig", "Invalid", "NodeConfig", "OuterConfig",
           "ReachabilityMode", "SwarmConfig", "TrustConfig", "load_config", "parse_overrides", "setting_names",
           "settings_in", "topk2_note"]
