"""Fiddler's engine options are written once (fiddler/options.py): the server's command line is made from that
table, system=fiddler's choices come from it, and the command the harness derives from the config class is one
the server parses back to the same values."""
from __future__ import annotations

import json

import pytest

from fiddler import options
from fiddler.server.__main__ import parse_args
from systems.base import ModelSpec, RunContext
from systems.fiddler.adapter import FiddlerAdapter
from systems.fiddler.config import FiddlerConfig, PlacementRule, Planner
from runners.schema import ServeConfig


def test_the_config_takes_its_choices_from_the_table():
    assert tuple(p.value for p in Planner) == options.PLANNERS
    assert tuple(p.value for p in PlacementRule) == options.PLACEMENTS
    for quant in options.QUANTS:
        assert FiddlerConfig.build(quant=quant).quant == quant


@pytest.mark.parametrize("overrides", [{}, {"planner": "paper", "placement": "random", "quant": "q4_0",
                                            "cpu_threads": 3, "gpu_budget_gb": 1.5,
                                            "popularity_profile": "/p.json"}])
def test_the_server_parses_the_command_the_config_derives(tmp_path, overrides):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    config = FiddlerConfig.build(**overrides)
    ctx = RunContext(threads=2, gpu_memory_gb=6.0, has_cuda=False, cache_dir=str(tmp_path / "cache"))
    cmd = FiddlerAdapter(config, ModelSpec("tiny_mixtral", str(model)), ctx).server_command(ServeConfig())
    assert cmd[1:3] == ["-m", "fiddler.server"]
    args = parse_args(cmd[3:])
    assert args.planner == config.planner.value and args.placement == config.placement.value
    assert args.quant == config.quant and args.popularity == config.popularity_profile
    assert args.cpu_threads == config.thread_count(2) and args.gpu_budget_gb == config.gpu_budget(6.0)[0]
    # every option of the table is a flag of the server, with the table's default
    defaults = parse_args(["--model", str(model)])
    assert {o.name: getattr(defaults, o.name) for o in options.OPTIONS} == {o.name: o.default for o in options.OPTIONS}


def _model(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    return model


@pytest.mark.parametrize("sizes", [{}, {"slots": 3, "max_queue": 0, "token_budget": 64, "drain_timeout_s": 2.5,
                                        "prefix_cache_mb": 16.0}])
def test_the_serve_sizes_are_the_servers(tmp_path, sizes):
    """serve.slots, max_queue, token_budget, drain_timeout_s and prefix_cache_mb are written once, in the server's
    SIZES: the harness's defaults are the server's, and the command the adapter derives parses back to them."""
    from fiddler.server.__main__ import SIZES

    model = _model(tmp_path)
    assert {s.key: getattr(ServeConfig(), s.key) for s in SIZES} == {s.key: s.default for s in SIZES}
    serve = ServeConfig(**sizes)
    ctx = RunContext(threads=2, gpu_memory_gb=0.0, has_cuda=False, cache_dir=str(tmp_path / "cache"))
    cmd = FiddlerAdapter(FiddlerConfig.build(), ModelSpec("tiny_mixtral", str(model)), ctx).server_command(serve)
    args = parse_args(cmd[3:])
    assert {s.key: getattr(args, s.dest) for s in SIZES} == {s.key: getattr(serve, s.key) for s in SIZES}
    assert args.max_seq_len == serve.max_seq_len


@pytest.mark.parametrize("flag,value,key", [("--slots", "0", "slots"), ("--max-queue", "-1", "max_queue"),
                                            ("--drain-timeout", "-1", "drain_timeout_s")])
def test_the_server_and_the_harness_refuse_the_same_sizes(tmp_path, flag, value, key):
    from systems.base import ConfigError

    with pytest.raises(SystemExit):
        parse_args(["--model", str(_model(tmp_path)), flag, value])
    with pytest.raises(ConfigError, match=f"serve.{key}"):
        ServeConfig(**{key: float(value) if key == "drain_timeout_s" else int(value)})


def test_the_batch_engines_own_defaults_agree_with_the_servers():
    """BatchEngine.from_pretrained keeps keyword defaults of its own (the library's API, fiddler/batch/engine.py);
    the server always passes its sizes, and this keeps the two from drifting apart."""
    import inspect

    from fiddler.batch import BatchEngine
    from fiddler.server.__main__ import SIZE

    params = inspect.signature(BatchEngine.from_pretrained).parameters
    assert {k: params[k].default for k in ("slots", "max_queue", "token_budget")} == \
        {k: SIZE[k].default for k in ("slots", "max_queue", "token_budget")}
