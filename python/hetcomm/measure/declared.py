"""Links the user declares instead of measuring: ``HETCOMM_LINK_MBIT`` (per-rank NIC rates or a
link matrix, in Mbit/s)."""
from __future__ import annotations

import os
from typing import Optional, Sequence

from hetcomm.plan.model import LinkModel
from hetcomm.rates import RateError, parse_matrix, parse_rate_list


def model_from_declared(size: int, nic_mbit: Optional[Sequence[float]] = None,
                        link_mbit: Optional[Sequence[Sequence[float]]] = None) -> LinkModel:
    """A model from bandwidths the user knows: per-rank NIC rates or a full link matrix (Mbit/s)."""
    if (nic_mbit is None) == (link_mbit is None):
        raise ValueError("hetcomm: declare either per-rank NIC rates or a link matrix, not both/neither")
    if nic_mbit is not None:
        if len(nic_mbit) != size:
            raise ValueError(f"hetcomm: {len(nic_mbit)} NIC rates declared for {size} ranks")
        return LinkModel.from_nics([m * 1e6 / 8 for m in nic_mbit])
    if len(link_mbit) != size or any(len(r) != size for r in link_mbit):
        raise ValueError(f"hetcomm: the declared link matrix must be {size}x{size}")
    bw = tuple(tuple(float("inf") if i == j else link_mbit[i][j] * 1e6 / 8 for j in range(size))
               for i in range(size))
    return LinkModel(bw=bw, reduce_bps=tuple([float("inf")] * size))


def parse_mbit(text: str) -> tuple[Optional[list[float]], Optional[list[list[float]]]]:
    """``"800,800,100"`` -> NIC rates; ``"0,800;800,0"`` (or a file) -> a link matrix; Mbit/s.

    The same formats as the simulator's ``--nic-mbit`` / ``--link-mbit`` (one parser for both,
    `hetcomm.rates`), except that every rate must be given: a declared model has no "unshaped"
    links.
    """
    try:
        if ";" in text or os.path.isfile(text):
            matrix = parse_matrix(text, "HETCOMM_LINK_MBIT")
            missing = [(i, j) for i, row in enumerate(matrix) for j, v in enumerate(row) if i != j and v is None]
            if missing:
                raise ValueError(f"hetcomm: HETCOMM_LINK_MBIT: links {missing} have no rate")
            return None, [[0.0 if v is None else v for v in row] for row in matrix]
        nics = parse_rate_list(text, "HETCOMM_LINK_MBIT")
        if any(v is None for v in nics):
            raise ValueError("hetcomm: HETCOMM_LINK_MBIT: every NIC needs a rate in Mbit/s")
        return nics, None
    except RateError as e:
        raise ValueError(f"hetcomm: {e}") from None
