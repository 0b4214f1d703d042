"""Config: defaults, TIDE_* variables, keyword overrides, rejected keys and values."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import tidearray
from tidearray import Config
from tidearray._config import env_table


def test_defaults_without_environment():
    cfg = Config.make(env={})
    assert (cfg.backend, cfg.local_size, cfg.chunk_nbytes, cfg.depth) == ("auto", None,
                                                                          32 << 20, 2)
    assert cfg.timeout > 0 and cfg.multicast is False


def test_environment_then_keywords():
    env = {"TIDE_BACKEND": "host", "TIDE_LOCAL_SIZE": "1", "TIDE_CHUNK_BYTES": "8192",
           "TIDE_DEPTH": "3", "TIDE_TIMEOUT": "2.5", "TIDE_MULTICAST": "yes"}
    cfg = Config.make(env=env)
    assert (cfg.backend, cfg.local_size, cfg.chunk_nbytes, cfg.depth, cfg.timeout,
            cfg.multicast) == ("host", 1, 8192, 3, 2.5, True)
    cfg = Config.make(env=env, local_size=2, depth=1)
    assert (cfg.local_size, cfg.depth, cfg.chunk_nbytes) == (2, 1, 8192)
    # None means "not given": the environment still applies.
    assert Config.make(env=env, local_size=None).local_size == 1
    # An empty variable is the same as an unset one.
    assert Config.make(env={"TIDE_DEPTH": ""}).depth == 2


def test_rejects_unknown_keys():
    with pytest.raises(tidearray.TideInvalid, match="chunk_bytes"):
        Config.make(env={}, chunk_bytes=4096)
    with pytest.raises(TypeError):
        Config(bogus=1)  # the dataclass itself has no such field either


@pytest.mark.parametrize("key,value,word", [
    ("backend", "gpu", "backend"),
    ("local_size", 0, "local_size"),
    ("chunk_nbytes", 4095, "chunk_nbytes"),
    ("depth", 0, "depth"),
    ("depth", 5, "depth"),
    ("timeout", 0, "timeout"),
    ("timeout", -1.0, "timeout"),
    ("ag_transport", "double", "ag_transport"),
    ("symmetric_memory", "shm", "symmetric_memory"),
    ("local_copy_max", -1, "local_copy_max"),
    ("local_copy_max", 1000, "local_copy_max"),
    ("local_copy_kernel_min", -1, "local_copy_kernel_min"),
    ("copy_batch_max", -1, "copy_batch_max"),
])
def test_rejects_bad_values(key, value, word):
    with pytest.raises(tidearray.TideInvalid, match=word) as info:
        Config.make(env={}, **{key: value})
    assert repr(value) in str(info.value) or str(value) in str(info.value)


@pytest.mark.parametrize("value", ["pull", "push-batch"])
def test_retired_transports_name_what_remains(value):
    """A transport measured and removed is refused, by keyword and by environment,
    with a message that names the one left and where the measurement is."""
    for kwargs, env in (({"ag_transport": value}, {}), ({}, {"TIDE_AG_TRANSPORT": value})):
        with pytest.raises(tidearray.TideInvalid, match="ag_transport") as info:
            Config.make(env=env, **kwargs)
        text = str(info.value)
        assert "expected 'push'" in text and repr(value) in text and "multicast" in text
        assert "Retired experiments" in text
    assert Config.make(env={"TIDE_AG_TRANSPORT": "push"}).ag_transport == "push"


@pytest.mark.parametrize("var,value", [("TIDE_LOCAL_SIZE", "two"), ("TIDE_CHUNK_BYTES", "1.5x"),
                                       ("TIDE_DEPTH", "0"), ("TIDE_BACKEND", "tpu"),
                                       ("TIDE_SYMMETRIC_MEMORY", "posix"),
                                       ("TIDE_LOCAL_COPY_MAX", "8MiB")])
def test_rejects_bad_environment(var, value):
    with pytest.raises(tidearray.TideInvalid):
        Config.make(env={var: value})


def test_accum_kernel_is_no_setting():
    """One accumulate kernel: the variants live in benchmarks/variants, not in Config, so
    ``accum_kernel=`` is refused like any unknown key, by ``make`` and by ``init``, and
    ``TIDE_ACCUM_KERNEL`` sets nothing."""
    assert "accum_kernel" not in {f.name for f in dataclasses.fields(Config)}
    assert "TIDE_ACCUM_KERNEL" not in env_table(Config)
    with pytest.raises(tidearray.TideInvalid, match="accum_kernel"):
        Config.make(env={}, accum_kernel="narrow")
    with pytest.raises(tidearray.TideInvalid, match="accum_kernel"):
        tidearray.init(accum_kernel="vector")
    assert Config.make(env={"TIDE_ACCUM_KERNEL": "narrow"}) == Config.make(env={})


def test_config_is_frozen():
    cfg = Config.make(env={})
    with pytest.raises(AttributeError):
        cfg.depth = 3


def test_init_rejects_unknown_settings_before_touching_mpi():
    with pytest.raises(tidearray.TideInvalid, match="chunk_size"):
        tidearray.init(chunk_size=4096)


def test_every_field_has_its_environment_variable():
    table = env_table(Config)
    assert sorted(name for name, _ in table.values()) == sorted(
        f.name for f in dataclasses.fields(Config))
    assert all(var.startswith("TIDE_") for var in table)
    assert table["TIDE_CHUNK_BYTES"][0] == "chunk_nbytes" and table["TIDE_DEBUG"][1]("on")
    assert table["TIDE_ACCUM_CTAS"][1]("16") == 16 and table["TIDE_TIMEOUT"][1]("2.5") == 2.5


def test_config_page_lists_every_variable_with_its_field_default_and_parser():
    """docs/config.md: a table row per field (its variable and default), and each
    variable under the parser its field's type gives it."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    rows = {m[0]: (m[1], m[2]) for m in re.findall(
        r"^\| `(\w+)` \| `(TIDE_\w+)` \| ([^|]+?) \|", page, re.M)}
    parsing = page[page.index("## Parsing the environment variables"):]
    kinds = {"integers": int, "a float": float, "are taken as they are": str,
             "are true for": bool}
    listed: dict = {}
    for item in parsing.split("\n- ")[1:]:
        for words, kind in kinds.items():
            for var in re.findall(r"`(TIDE_\w+)`", item.split(words)[0] if words in item
                                  else ""):
                listed.setdefault(var, kind)
    defaults = Config()
    for var, (name, parse) in env_table(Config).items():
        assert rows.get(name, (None,))[0] == var, f"{name}: no row naming {var}"
        value = getattr(defaults, name)
        shown = rows[name][1].strip("`").split(" ")[0].strip('`"')
        assert shown == str(value), f"{name}: the page says {rows[name][1]}, the code {value!r}"
        want = {"_flag": bool}.get(parse.__name__, parse)
        assert listed.get(var) is want, f"{var}: listed as {listed.get(var)}, parsed as {want}"


def test_local_copy_max_default_environment_and_keyword():
    from tidearray._config import LOCAL_COPY_ALIGN
    from tidearray._copies import SPLIT_ALIGN

    assert LOCAL_COPY_ALIGN == SPLIT_ALIGN  # cut pieces keep the split cuts' alignment
    assert Config.make(env={}).local_copy_max == 8 << 20
    assert Config.make(env={"TIDE_LOCAL_COPY_MAX": "0"}).local_copy_max == 0
    assert Config.make(env={"TIDE_LOCAL_COPY_MAX": "0"}, local_copy_max=1 << 20).local_copy_max \
        == 1 << 20


def test_info_names_the_settings_not_at_their_defaults():
    """``python -m tidearray.info`` lists exactly the settings that differ from the defaults."""
    from tidearray.info import settings_changed

    assert settings_changed(Config.make(env={})) == []
    changed = settings_changed(Config.make(env={"TIDE_CE_SPLIT": "2", "TIDE_DEPTH": "2"},
                                           chunk_nbytes=8192))
    assert changed == ["chunk_nbytes=8192", "ce_split=2"]
