"""The public entry point as the README documents it."""

from __future__ import annotations

import inspect
from pathlib import Path

import zero_shard


def test_wrap_takes_the_constructors_options_as_the_readme_shows_them() -> None:
    signature = inspect.signature(zero_shard.wrap)
    assert signature.parameters == inspect.signature(zero_shard.ZeroShardOptimizer).parameters

    def shown(parameter: inspect.Parameter) -> str:
        if parameter.default is inspect.Parameter.empty:
            return parameter.name
        default = parameter.default
        text = f'"{default}"' if isinstance(default, str) else f"{default:g}" if isinstance(
            default, float) else repr(default)  # fmt: skip
        return f"{parameter.name}={text}"

    params = list(signature.parameters.values())
    expected = ", ".join([shown(params[0]), shown(params[1]), "*", *map(shown, params[2:])])
    readme = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    assert f"`zero_shard.wrap({expected})`" in readme, expected
