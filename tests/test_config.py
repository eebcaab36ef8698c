from pathlib import Path

import pytest

from tendril.config import Config


def test_defaults_and_environment():
    assert Config.from_env({}) == Config(cache_dir=Config.from_env({}).cache_dir)
    cfg = Config.from_env({"TENDRIL_DEBUG": "1", "TENDRIL_NO_GRAPHS": "yes", "TENDRIL_CACHE_DIR": "/tmp/x"})
    assert cfg.debug and cfg.disable_graphs and cfg.cache_dir == Path("/tmp/x")
    assert not Config.from_env({"TENDRIL_DEBUG": "off"}).debug


def test_bad_flag_names_the_variable():
    with pytest.raises(ValueError, match="TENDRIL_DEBUG='maybe'"):
        Config.from_env({"TENDRIL_DEBUG": "maybe"})


def test_the_default_graph_memory_budget_comes_from_the_environment():
    assert Config.from_env({}).graph_memory_budget is None
    assert Config.from_env({"TENDRIL_GRAPH_MEMORY_BUDGET": " 256MiB "}).graph_memory_budget == "256MiB"


def test_programmatic_dependent_launch_is_on_unless_switched_off():
    assert Config.from_env({}).pdl and Config.from_env({"TENDRIL_PDL": " "}).pdl
    assert Config.from_env({"TENDRIL_PDL": "1"}).pdl
    assert not Config.from_env({"TENDRIL_PDL": "0"}).pdl and not Config.from_env({"TENDRIL_PDL": "off"}).pdl
    with pytest.raises(ValueError, match="TENDRIL_PDL='fast'"):
        Config.from_env({"TENDRIL_PDL": "fast"})


def test_weight_copies_are_on_unless_switched_off():
    assert Config.from_env({}).weight_copies and Config.from_env({"TENDRIL_WEIGHT_COPIES": "1"}).weight_copies
    assert not Config.from_env({"TENDRIL_WEIGHT_COPIES": "0"}).weight_copies


def test_triton_interpret_is_read_like_tendrils_own_flags():
    assert not Config.from_env({}).triton_interpret
    assert Config.from_env({"TRITON_INTERPRET": "1"}).triton_interpret
    assert not Config.from_env({"TRITON_INTERPRET": "0"}).triton_interpret


def test_directories_given_as_strings_are_kept_as_paths(tmp_path):
    config = Config(cache_dir=str(tmp_path), inductor_cache_dir=str(tmp_path / "inductor"))
    assert config.cache_dir == tmp_path and config.inductor_cache_dir == tmp_path / "inductor"
