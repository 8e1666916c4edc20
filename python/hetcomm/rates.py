"""Link rates as people write them, in Mbit/s: parsing and formatting, shared by the simulator's
options (``--nic-mbit``, ``--link-mbit``) and the links a user declares (``HETCOMM_LINK_MBIT``).

Rates are Mbit/s as ``tc`` understands them: 1 Mbit = 10**6 bit, so 100 Mbit/s is 12.5e6 bytes/s
(`MBIT`). ``None`` (``inf``, ``-``, ``none`` or ``unlimited`` in text) means "not limited". Pure:
the standard library only. Malformed text raises `RateError`, a ValueError naming the value.
"""
from __future__ import annotations

import math
import os
from typing import Optional, Sequence

MBIT = 1e6 / 8  # bytes per second in one Mbit/s

_UNSHAPED_WORDS = ("inf", "-", "none", "unlimited", "")
MAX_MBIT = 1e9   # 1 Pbit/s: a finite rate beyond it is a typo (and 1e400 would read as inf)


class RateError(ValueError):
    """Text that is not a rate, a list or a matrix of rates (the message names it and says why)."""


def mbit_to_bytes_per_s(mbit: Optional[float]) -> float:
    """Mbit/s (``None`` = unshaped) to bytes/s (``math.inf`` = unshaped)."""
    return math.inf if mbit is None else float(mbit) * MBIT


def parse_rate(text: str, what: str) -> Optional[float]:
    """``"100"`` or ``"100mbit"`` -> ``100.0`` (Mbit/s); ``"inf"``, ``"-"``, ``"none"``,
    ``"unlimited"`` or nothing -> None (unshaped). ``what`` names the value in the error."""
    t = text.strip().lower()
    if t.endswith("mbit"):
        t = t[:-4]
    if t in _UNSHAPED_WORDS:
        return None
    try:
        v = float(t)
    except ValueError:
        raise RateError(f"{what}: {text!r} is not a rate in Mbit/s "
                        "(a number, or 'inf' for unshaped)") from None
    if not v > 0 or math.isnan(v):
        raise RateError(f"{what}: {text!r} must be a positive rate in Mbit/s ('inf' for unshaped)")
    if v > MAX_MBIT:          # 1e400 reads as inf: a number that large is a mistake, not a word
        raise RateError(f"{what}: {text!r} is more than {MAX_MBIT:g} Mbit/s; write 'inf' for unshaped")
    return v


def parse_rate_list(text: str, what: str = "--nic-mbit") -> list[Optional[float]]:
    """``"800,800,800,100"`` -> ``[800.0, 800.0, 800.0, 100.0]`` (``inf`` -> None)."""
    items = [s for s in text.replace(" ", "").split(",")]
    if not items or items == [""]:
        raise RateError(f"{what}: empty list")
    return [parse_rate(s, f"{what} item {i}") for i, s in enumerate(items)]


def parse_matrix(text: str, what: str = "--link-mbit") -> list[list[Optional[float]]]:
    """A PxP matrix of directed link rates in Mbit/s: row i = from rank i, column j = to rank j.

    ``text`` is either inline (rows separated by ``;``, values by ``,``:
    ``"0,800,100;800,0,100;100,100,0"``) or the path of a file (rows on lines or separated by
    ``;``, values separated by commas and/or blanks, ``#`` starts a comment). The diagonal is
    ignored (write 0). Off the diagonal a value must be positive, or ``inf``/``-`` for a link
    that is limited only by the two NICs.
    """
    if os.path.isfile(text):
        try:
            with open(text) as f:
                lines = [ln.split("#", 1)[0] for ln in f.read().splitlines()]
        except (OSError, UnicodeDecodeError) as e:
            raise RateError(f"{what}: cannot read the matrix file {text!r}: {e}") from None
        body = ";".join(ln for ln in lines if ln.strip())
    else:
        body = text
    rows_txt = [r for r in body.replace("\n", ";").split(";") if r.strip()]
    rows = [[v for v in r.replace(",", " ").split()] for r in rows_txt]
    p = len(rows)
    if p == 0:
        raise RateError(f"{what}: empty matrix")
    for i, r in enumerate(rows):
        if len(r) != p:
            raise RateError(f"{what}: row {i} has {len(r)} values, expected {p} (a {p}x{p} matrix)")
    out: list[list[Optional[float]]] = []
    for i, r in enumerate(rows):
        row: list[Optional[float]] = []
        for j, v in enumerate(r):
            if i == j:
                row.append(None)
            else:
                row.append(parse_rate(v, f"{what}[{i}][{j}]"))
        out.append(row)
    return out


def format_rate(v: Optional[float]) -> str:
    """Inverse of :func:`parse_rate`: ``100.0`` -> ``"100"``, None or inf -> ``"inf"``."""
    if v is None or math.isinf(v):
        return "inf"
    return f"{v:g}"


def format_matrix(m: Sequence[Sequence[Optional[float]]]) -> str:
    """Inverse of :func:`parse_matrix`: rows joined by ``;``, diagonal written ``0``."""
    return ";".join(",".join("0" if i == j else format_rate(v) for j, v in enumerate(row))
                    for i, row in enumerate(m))
