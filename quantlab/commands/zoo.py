"""List the reference models that ship with quantlab (weights included, no download)."""

from __future__ import annotations

import argparse

HELP = "list the bundled reference models"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options: the command only lists."""


def run(args: argparse.Namespace) -> int:
    """Print one line per zoo model: name, task, input shape, description."""
    from quantlab import zoo

    for name in zoo.names():
        model = zoo.get(name)
        shape = "x".join(str(d) for d in model.input_shape)
        print(f"{name:<12} {model.task:<15} input {shape:<10} {model.description}")
    return 0
