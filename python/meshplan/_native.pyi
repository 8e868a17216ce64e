"""The compiled half of meshplan: the command line's dispatch, in-process."""

from typing import List

class NativeError(Exception):
    """args: (exit code, message) of the command line."""

def run_json(args: List[str]) -> str:
    """Runs ``meshplan ARGS``; returns the JSON object it prints with ``--json`` (as
    text; ``null`` for a command that prints none), or raises NativeError."""

def version() -> str:
    """The meshplan crate version the module was built from."""
