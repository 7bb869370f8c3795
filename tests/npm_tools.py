"""Command-line clients from the npm registry (Codex, Claude Code) for the end-to-end tests:
the one on PATH, or the package installed into a temporary folder; the test is skipped
where neither works (no npm, no registry, a binary that does not run here)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def npm_tool(command: str, package: str, folder: Path, timeout: float = 300) -> str:
    """The path of `command`, from PATH or from `package` installed into `folder`."""
    found = shutil.which(command)
    if found:
        return found
    npm = shutil.which("npm")
    if not npm:
        pytest.skip(f"neither {command} nor npm is installed")
    try:
        subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(folder), package],
                       check=True, capture_output=True, timeout=timeout)
    except (subprocess.SubprocessError, OSError) as exc:
        pytest.skip(f"{package} did not install: {exc}")
    binary = folder / "node_modules" / ".bin" / command
    try:  # a package of native binaries may have none for this platform
        subprocess.run([str(binary), "--version"], check=True, capture_output=True, timeout=60)
    except (subprocess.SubprocessError, OSError) as exc:
        pytest.skip(f"{package} installed no {command} that runs here: {exc}")
    return str(binary)
