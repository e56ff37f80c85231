"""Parameter drift: how far each weight tensor moved from where training started."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd

from layertune.encoder import HasParameterParts

if TYPE_CHECKING:  # torch is imported where a drift is computed: reading a report needs no torch
    import torch
    from torch import nn


def parameter_drift(model: nn.Module, reference: dict[str, torch.Tensor]) -> pd.DataFrame:
    """One row per parameter tensor: mean absolute change and relative L2 change against ``reference``.

    ``reference`` holds the values training started from (pretrained encoder weights, initial head) of the tensors
    that could change; a tensor it leaves out was frozen, so its change is exactly 0 and its own value is the
    reference (no copy of a frozen model is needed). The L2 norms are kept so `layer_drift` can aggregate exactly.
    A module that does not name its parts (a `TaskModel` and an `Encoder` do) puts every tensor in part ``other``.
    """
    import torch

    parts = model.parameter_parts() if isinstance(model, HasParameterParts) else {}
    rows = []
    for name, parameter in model.named_parameters():
        if name in reference:
            before = reference[name].to(torch.float64)
            change = parameter.detach().cpu().to(torch.float64) - before
            delta_l2, reference_l2, mean_abs = change.norm().item(), before.norm().item(), change.abs().mean().item()
        else:
            delta_l2, mean_abs = 0.0, 0.0
            reference_l2 = parameter.detach().float().norm().item()
        rows.append({
            "parameter": name,
            "part": parts.get(name, "other"),
            "trainable": parameter.requires_grad,
            "numel": parameter.numel(),
            "mean_abs_change": mean_abs,
            "relative_l2": delta_l2 / reference_l2 if reference_l2 > 0 else delta_l2,
            "delta_l2": delta_l2,
            "reference_l2": reference_l2,
        })
    return pd.DataFrame(rows)


def layer_drift(table: pd.DataFrame) -> pd.DataFrame:
    """Per-part aggregate of `parameter_drift`: element-weighted mean absolute change, pooled relative L2."""
    def aggregate(group: pd.DataFrame) -> pd.Series:
        reference = (group["reference_l2"] ** 2).sum() ** 0.5
        delta = (group["delta_l2"] ** 2).sum() ** 0.5
        return pd.Series({
            "numel": group["numel"].sum(),
            "mean_abs_change": (group["mean_abs_change"] * group["numel"]).sum() / group["numel"].sum(),
            "relative_l2": delta / reference if reference > 0 else delta,
        })

    keys = [c for c in ("run", "part") if c in table.columns]
    return table.groupby(keys, sort=False)[["numel", "mean_abs_change", "delta_l2", "reference_l2"]].apply(
        aggregate
    ).reset_index()
