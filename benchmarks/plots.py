"""Matplotlib pieces the benchmarks' PNGs share (import matplotlib only where a plot is drawn)."""

from __future__ import annotations

from pathlib import Path


def tokens_axes(ax, xlabel: str, ylabel: str) -> None:
    """A throughput panel: token counts on a log axis, rates from zero, a grid and a legend."""
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()


def save(fig, title: str, out: Path) -> None:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
