"""What the command lines (`python -m lmsp_mlx.serve`, `python -m lmsp_mlx.models`) share:
a flag parser whose errors are one line, `lmsp-mlx: error: ...`, as every start error is
(argparse's own prints its whole usage first)."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

ERROR = "lmsp-mlx: error:"


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"{ERROR} {message} ({self.prog} --help lists the flags)", file=sys.stderr)
        sys.exit(2)
