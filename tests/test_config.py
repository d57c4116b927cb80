"""Configuration: TOML < environment < overrides, and one clear line per problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2pdiloco.config import (
    DataConfig,
    Invalid,
    NodeConfig,
    OuterConfig,
    SECTIONS,
    SwarmConfig,
    TOP_LEVEL,
    load_config,
    parse_overrides,
)
from p2pdiloco.config.loading import _coerce
from p2pdiloco.errors import ConfigError

PEER = "/ip4/127.0.0.1/tcp/31337/p2p/QmV6bPa3xB8gg5YhjHnmHBCvVpymShB3aaPJmsvxWoq5LB"
PEER2 = "/ip4/10.0.0.2/tcp/4000/p2p/QmV6bPa3xB8gg5YhjHnmHBCvVpymShB3aaPJmsvxWoq5LB"


def toml(tmp_path: Path, text: str, name: str = "node.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def problems(excinfo: pytest.ExceptionInfo[ConfigError]) -> list[str]:
    """The problem lines of a ConfigError (without the 'invalid configuration' header)."""
    text = str(excinfo.value)
    if "\n" not in text:
        return [text.removeprefix("invalid configuration: ")]
    header, *lines = text.splitlines()
    assert header == f"invalid configuration, {len(lines)} problems:"
    return [line.strip() for line in lines]


# ---- loading and precedence ----------------------------------------------------------------

def test_no_sources_gives_the_defaults() -> None:
    assert load_config(env={}) == NodeConfig()


def test_toml_sets_top_level_and_section_fields(tmp_path: Path) -> None:
    path = toml(tmp_path, f"""
seed = 7
duration = 30          # an integer where a float is expected is fine
trace_dir = "traces"
[outer]
lr = 0.5
fragments = 4
wire_precision = "bf16"
[inner]
betas = [0.8, 0.9]
[swarm]
initial_peers = ["{PEER}", "{PEER2}"]
port = 4001
""")
    cfg = load_config(path, env={})
    assert (cfg.seed, cfg.duration, cfg.trace_dir) == (7, 30.0, "traces")
    assert isinstance(cfg.duration, float)
    assert (cfg.outer.lr, cfg.outer.fragments, cfg.outer.wire_precision) == (0.5, 4, "bf16")
    assert cfg.outer.momentum == 0.9  # untouched fields keep their defaults
    assert cfg.inner.betas == (0.8, 0.9)
    assert cfg.swarm.initial_peers == (PEER, PEER2)
    assert cfg.swarm.port == 4001


def test_environment_overrides_toml_and_overrides_win(tmp_path: Path) -> None:
    path = toml(tmp_path, "max_steps = 10\n[outer]\nlr = 0.5\nsync_every = 30\nfragments = 3\n")
    env = {"P2PDILOCO_OUTER_LR": "0.25", "P2PDILOCO_OUTER_SYNC_EVERY": "40", "P2PDILOCO_MAX_STEPS": "20"}
    cfg = load_config(path, env=env)
    assert (cfg.outer.lr, cfg.outer.sync_every, cfg.outer.fragments, cfg.max_steps) == (0.25, 40, 3, 20)
    cfg = load_config(path, env=env, overrides={"outer.lr": "0.125", "max_steps": 30})
    assert (cfg.outer.lr, cfg.outer.sync_every, cfg.outer.fragments, cfg.max_steps) == (0.125, 40, 3, 30)


def test_environment_names() -> None:
    env = {
        "P2PDILOCO_DATA_DIR": "/tmp/node-a",  # top-level data_dir, not data.dir
        "P2PDILOCO_DATA_BATCH_SIZE": "4",  # data.batch_size
        "P2PDILOCO_SWARM_INITIAL_PEERS": f"{PEER}, {PEER2}",  # comma-separated tuple
        "P2PDILOCO_LOG": "DEBUG",  # the log level, not a setting
        "OTHER_OUTER_LR": "nonsense",  # not ours
    }
    cfg = load_config(env=env)
    assert cfg.data_dir == "/tmp/node-a"
    assert cfg.data.batch_size == 4
    assert cfg.swarm.initial_peers == (PEER, PEER2)
    assert cfg.outer.lr == OuterConfig().lr


def test_flag_lists_become_tuples() -> None:
    cfg = load_config(env={}, overrides={"swarm.initial_peers": [PEER], "swarm.announce": "/ip4/203.0.113.5/tcp/4001"})
    assert cfg.swarm.initial_peers == (PEER,)
    assert cfg.swarm.announce == ("/ip4/203.0.113.5/tcp/4001",)


# ---- problems: one line each ---------------------------------------------------------------

def test_unknown_keys_in_every_source(tmp_path: Path) -> None:
    path = toml(tmp_path, "colour = 'blue'\n[outer]\nlrr = 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, env={"P2PDILOCO_SWARM_HOSTT": "x"}, overrides={"outerr.lr": "1", "inner.lrr": "2"})
    lines = problems(e)
    assert len(lines) == 5
    known = ", ".join(sorted(TOP_LEVEL))  # every top-level NodeConfig field is listed
    assert "data_dir" in known and "seed" in known
    assert f"colour: unknown setting; known: {known}; " \
           f"or SECTION.FIELD with a section among {', '.join(SECTIONS)} (in {path})" in lines
    assert any(line.startswith("outer.lrr: unknown setting; known: error_feedback_decay, fragments, grace_gamma") and
               line.endswith(f"(in {path})") for line in lines)
    assert any(line.startswith("swarm.hostt: unknown setting; known: announce, host, initial_peers, port, reachability, relay, run_id")
               and line.endswith("(from environment variable P2PDILOCO_SWARM_HOSTT)") for line in lines)
    assert f"outerr.lr: unknown section 'outerr' (from the command line; known: {', '.join(SECTIONS)})" \
        in lines
    assert any(line.startswith("inner.lrr: unknown setting") and line.endswith("(from the command line)")
               for line in lines)


def test_single_problem_is_a_single_line() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(env={}, overrides={"outer.lr": "fast"})
    assert str(e.value) == "invalid configuration: outer.lr: expected a number, got 'fast' (from the command line)"


def test_wrong_types(tmp_path: Path) -> None:
    path = toml(tmp_path, """
seed = "seven"
[outer]
lr = "x"
fragments = 2.5
min_quorum = true
[swarm]
port = "abc"
run_id = 5
initial_peers = 5
[inner]
betas = [0.9]
""")
    with pytest.raises(ConfigError) as e:
        load_config(path, env={})
    where = f" (in {path})"
    assert sorted(problems(e)) == sorted([
        "seed: expected an integer, got 'seven'" + where,
        "outer.lr: expected a number, got 'x'" + where,
        "outer.fragments: expected an integer, got 2.5" + where,
        "outer.min_quorum: expected an integer, got True" + where,
        "swarm.port: expected an integer, got 'abc'" + where,
        "swarm.run_id: expected a string, got 5" + where,
        "swarm.initial_peers: expected a list, got 5" + where,
        "inner.betas: expected 2 values, got 1" + where,
    ])


def test_non_finite_numbers_are_refused() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(env={}, overrides={"outer.lr": "inf", "outer.grace_max": "nan"})
    assert sorted(problems(e)) == [
        "outer.grace_max: expected a finite number, got 'nan' (from the command line)",
        "outer.lr: expected a finite number, got 'inf' (from the command line)",
    ]


def test_every_out_of_range_value_of_a_section_is_listed(tmp_path: Path) -> None:
    path = toml(tmp_path, "[outer]\nlr = 0\nmomentum = 1.0\nfragments = 0\ngrace_min = 6.0\n"
                          "wire_precision = 'int2'\n[data]\nbatch_size = 0\nshard_index = 8\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, env={"P2PDILOCO_THREADS": "0"})
    where = f" (in {path})"
    assert problems(e) == [
        "outer.lr: must be in (0, 100]" + where,
        "outer.momentum: must be in [0, 1)" + where,
        "outer.fragments: must be in 1..1024" + where,
        "outer.grace_min: need 0 <= grace_min <= grace_max <= 3600 (seconds)" + where,
        "outer.wire_precision: must be one of fp32, fp16, bf16, int8, int4, topk2" + where,
        "data.shard_index: must be -1 or in [0, num_shards)" + where,
        "data.batch_size: must be in 1..65536" + where,
        "threads: must be in 1..1024 (from environment variable P2PDILOCO_THREADS)",
    ]


def test_config_bounds_match_what_records_and_groups_can_carry() -> None:
    """A swarm with more fragments than a heads record may list, or a quorum larger than a
    group may be, would run isolated without an error: the config refuses both."""
    from p2pdiloco import config
    from p2pdiloco.net.records import parse as records

    assert config.MAX_FRAGMENTS == records.MAX_FRAGMENTS and config.MAX_QUORUM == records.MAX_GROUP
    with pytest.raises(ConfigError, match=r"data.batch_size: 4096 x model.block_size 131072 x model.vocab_size 256"):
        load_config(env={}, overrides={"data.batch_size": "4096", "model.block_size": "131072"})


@pytest.mark.parametrize("key, value", [
    ("outer.min_quorum", str(2**64)), ("outer.quorum_timeout", "1e308"), ("outer.liveness_timeout", "inf"),
    ("outer.grace_max", "1e9"), ("outer.sync_every", str(10**12)), ("outer.fragments", "2000"), ("outer.min_quorum", "300"),
    ("outer.lr", "1e6"), ("model.vocab_size", str(10**12)), ("model.n_embd", str(2**20)),
    ("model.n_layer", "100000"), ("model.n_embd", "65536"), ("inner.lr", "1e3"), ("inner.total_steps", str(10**15)),
    ("data.batch_size", str(10**9)), ("data.num_shards", str(10**9)), ("settle", "1e12"),
    ("duration", "nan"), ("alone_after", "inf"), ("threads", "100000"), ("trust.outlier_factor", "1e300"),
    ("status_every", "0"), ("status_every", "1e9"), ("outer.error_feedback_decay", "1.5"),
    ("outer.error_feedback_decay", "-0.1"),
])
def test_absurd_values_that_a_type_allows_are_refused_in_one_line(key: str, value: str) -> None:
    """Upper bounds: a value of the right type but far beyond any run (what a signed manifest or
    a typo could carry) is one ConfigError naming the setting, before anything is allocated."""
    with pytest.raises(ConfigError) as e:
        load_config(env={}, overrides={key: value})
    message = str(e.value)
    assert message.startswith("invalid configuration: ") and "\n" not in message
    assert key.split(".")[0] in message


def test_sections_validated_by_their_own_class_report_the_section() -> None:
    """A section's own check names its field and the value's source where it names a field
    (a fresh user's finding: a negative model size printed the whole ModelConfig)."""
    with pytest.raises(ConfigError) as e:
        load_config(env={}, overrides={"inner.lr": "-1", "model.n_head": "3"})
    assert problems(e) == [
        "model.n_embd: 128 must be divisible by n_head (3)",
        "inner: lr must be in (0, 10], got -1.0",
    ]
    with pytest.raises(ConfigError) as e:
        load_config(env={}, overrides={"model.n_layer": "-1"})
    assert problems(e) == ["model.n_layer: must be >= 1, got -1 (from the command line)"]


def test_swarm_and_path_checks(tmp_path: Path) -> None:
    afile = tmp_path / "a-file"
    afile.write_text("x")
    with pytest.raises(ConfigError) as e:
        load_config(env={}, overrides={
            "swarm.host": "localhost", "swarm.run_id": "my run", "swarm.initial_peers": ["/ip4/127.0.0.1/tcp/5"],
            "data.path": str(tmp_path / "missing"), "data_dir": str(afile)})
    lines = problems(e)
    assert lines == [
        "swarm.run_id: must be a non-empty name without '/' or spaces (from the command line)",
        "swarm.host: 'localhost' is not an IPv4 address (0.0.0.0: every interface) (from the command line)",
        "swarm.initial_peers: initial peer '/ip4/127.0.0.1/tcp/5': missing the /p2p/PEER_ID part (copy the "
        "whole address the bootstrap peer printed, for example /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...) "
        "(from the command line)",
        f"data.path: '{tmp_path / 'missing'}' does not exist (from the command line)",
        f"data_dir: '{afile}' exists and is not a folder (from the command line)",
    ]


def test_a_section_must_be_a_table_and_a_section_is_not_a_value(tmp_path: Path) -> None:
    path = toml(tmp_path, "outer = 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, env={}, overrides={"swarm": "x"})
    assert problems(e) == [
        f"outer: expected a [outer] table (in {path})",
        "swarm: is a section; set its fields as swarm.FIELD (from the command line)",
    ]


def test_direct_construction_lists_all_problems() -> None:
    with pytest.raises(Invalid) as e:
        OuterConfig(lr=-1.0, overlap=-1)
    assert e.value.problems == [("lr", "must be in (0, 100]"), ("overlap", "must be in 0..1000000000")]
    assert str(e.value) == "lr: must be in (0, 100]; overlap: must be in 0..1000000000"
    with pytest.raises(ValueError, match="port: must be in 0..65535"):
        SwarmConfig(port=70000)
    with pytest.raises(ValueError, match="heldout_fraction: must be in \\(0, 1\\)"):
        DataConfig(heldout_fraction=1.0)


# ---- files ---------------------------------------------------------------------------------

def test_file_that_is_not_toml(tmp_path: Path) -> None:
    path = toml(tmp_path, "this is = = not toml\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, env={})
    assert str(e.value) == (f"config file {path} is not valid TOML: "
                            "Expected '=' after a key in a key/value pair (at line 1, column 6)")


def test_missing_folder_and_binary_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^config file .*nope\.toml does not exist$"):
        load_config(tmp_path / "nope.toml", env={})
    with pytest.raises(ConfigError, match=r"is a folder, not a TOML file$"):
        load_config(tmp_path, env={})
    binary = tmp_path / "b.toml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match=r"is not valid TOML: it is not UTF-8 text$"):
        load_config(binary, env={})


# ---- overrides and coercion ----------------------------------------------------------------

def test_parse_overrides() -> None:
    assert parse_overrides([]) == {}
    assert parse_overrides([" outer.lr = 0.5", "max_steps=3", "outer.lr=0.25", "swarm.run_id=a=b"]) == {
        "outer.lr": "0.25", "max_steps": "3", "swarm.run_id": "a=b"}


def test_parse_overrides_lists_each_bad_item() -> None:
    with pytest.raises(ConfigError) as e:
        parse_overrides(["outer.lr", "ok.x=1", "=3", " =4"])
    assert str(e.value).splitlines() == [
        "--set 'outer.lr': expected SECTION.FIELD=VALUE, for example --set outer.sync_every=50",
        "--set '=3': expected SECTION.FIELD=VALUE, for example --set outer.sync_every=50",
        "--set ' =4': expected SECTION.FIELD=VALUE, for example --set outer.sync_every=50",
    ]


@pytest.mark.parametrize("text, value", [
    ("1", True), ("true", True), ("Yes", True), (" on ", True),
    ("0", False), ("FALSE", False), ("no", False), ("off", False),
    (True, True), (False, False),
])
def test_bool_coercion(text, value) -> None:
    assert _coerce(text, bool, "x.flag") is value


@pytest.mark.parametrize("bad", ["maybe", "", 1, 0.0, None])
def test_bool_coercion_refuses(bad) -> None:
    with pytest.raises(ValueError) as e:
        _coerce(bad, bool, "x.flag")
    assert str(e.value) == f"x.flag: expected true or false, got {bad!r}"


def test_tuple_coercion() -> None:
    assert _coerce("a, b,,c ", tuple[str, ...], "w") == ("a", "b", "c")
    assert _coerce("", tuple[str, ...], "w") == ()
    assert _coerce(["a"], tuple[str, ...], "w") == ("a",)
    assert _coerce("0.8,0.95", tuple[float, float], "w") == (0.8, 0.95)
    assert _coerce([1, 2], tuple[float, float], "w") == (1.0, 2.0)
    with pytest.raises(ValueError, match=r"^w: expected 2 values, got 3$"):
        _coerce("1,2,3", tuple[float, float], "w")
    with pytest.raises(ValueError, match=r"^w: expected a string, got 3$"):
        _coerce(["a", 3], tuple[str, ...], "w")
    with pytest.raises(ValueError, match=r"^w: expected a list, got 3$"):
        _coerce(3, tuple[str, ...], "w")


def test_number_coercion() -> None:
    assert _coerce(" 42 ", int, "w") == 42
    assert _coerce("-1", int, "w") == -1
    assert _coerce("1e-3", float, "w") == 0.001
    assert _coerce(3, float, "w") == 3.0
    with pytest.raises(ValueError, match=r"^w: expected an integer, got '1.5'$"):
        _coerce("1.5", int, "w")
    with pytest.raises(ValueError, match=r"^w: expected a number, got True$"):
        _coerce(True, float, "w")


def test_fragments_are_checked_against_the_model_before_anything_starts(tmp_path: Path) -> None:
    """Fragments hold whole tensors: P above the model's tensor count is one line, with its
    source, at load time; the defaults are consistent."""
    cfg = load_config(env={})
    assert cfg.outer.fragments <= cfg.model.num_tensors
    with pytest.raises(ConfigError) as e:
        load_config(env={}, overrides={"outer.fragments": "30"})
    assert str(e.value) == ("invalid configuration: outer.fragments: 30 exceeds the model's 20 parameter tensors "
                            "(fragments hold whole tensors); use at most 20 (from the command line)")
    path = tmp_path / "node.toml"
    path.write_text("[model]\nn_layer = 1\n[outer]\nfragments = 13\n")
    with pytest.raises(ConfigError, match=rf"use at most 12 \(in {path}\)$"):
        load_config(path, env={})
    assert load_config(path, env={}, overrides={"outer.fragments": "12"}).outer.fragments == 12


def test_reachability_is_one_of_its_choices() -> None:
    assert load_config(None, env={}, overrides={"swarm.reachability": "private", "swarm.relay": "false"}).swarm \
        .reachability == "private"
    with pytest.raises(ConfigError) as e:
        load_config(None, env={"P2PDILOCO_SWARM_REACHABILITY": "nat"}, overrides={})
    assert problems(e) == ["swarm.reachability: expected one of auto, public, private, got 'nat' "
                           "(from environment variable P2PDILOCO_SWARM_REACHABILITY)"]
