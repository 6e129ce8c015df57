"""Options every subcommand spells the same way, as argparse parent parsers.

``--device`` (where tensors live), ``--seed`` (what the run draws) and ``--profile`` (the Hypothesis
profile) mean the same thing in every subcommand that has them; each subcommand picks its default.
"""

from __future__ import annotations

import argparse

PROFILE_NAMES = ("smoke", "dev", "ci", "gpu", "nightly", "repro")  # pagedkv.testing.settings.PROFILES


def device_option(default: str | None, what: str = "tensors") -> argparse.ArgumentParser:
    """``--device``: ``cpu``, ``cuda`` or ``cuda:N``; ``default`` ``None`` means CUDA when present, else CPU."""
    parent = argparse.ArgumentParser(add_help=False)
    shown = default or "cuda when available, else cpu"
    parent.add_argument("--device", default=default, metavar="DEVICE",
                        help=f"device for the {what}: cpu, cuda, cuda:N (default: {shown})".replace("%", "%%"))
    return parent


def seed_option(what: str = "the run") -> argparse.ArgumentParser:
    """``--seed``: an integer that fixes everything ``what`` draws (default 0)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--seed", type=int, default=0, help=f"seed of {what} (default 0)")
    return parent


def profile_option(default: str = "ci") -> argparse.ArgumentParser:
    """``--profile``: one of the suite's Hypothesis profiles (``ci`` is derandomized)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--profile", default=default, choices=PROFILE_NAMES,
                        help=f"Hypothesis profile (default: {default}{', derandomized' if default == 'ci' else ''})")
    return parent


def resolve_device(device: str | None) -> str:
    """``device``, or ``cuda`` when torch sees one, else ``cpu``."""
    if device:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
