"""Fusing parallel projections (q/k/v, gate/up) into one product each, after loading.

Fewer, larger products per layer; checkpoints and tools still see Meta's names. Where the copy that fusing makes
would cost more than it gains (a large unquantized model on a CPU our kernels run) the loader skips it
(llama/formats/loader.py, fuses()).
"""

import torch
from torch import nn


@torch.no_grad()
def fuse_columns(layers) -> nn.Module:
    """One column-parallel linear (model.ColumnLinear, the layers' own class) computing all of `layers` (same input)
    in one product.

    Each rank concatenates its own local shards, so under model parallel the fused layer is still column-parallel:
    rank r holds [q_r; k_r; v_r], exactly the rows of its local q, k and v.
    """
    with torch.device("meta"):
        fused = type(layers[0])(layers[0].in_features, sum(layer.out_features for layer in layers))
    fused.weight = nn.Parameter(torch.cat([layer.weight for layer in layers]), requires_grad=False)
    if layers[0].scales is not None:
        fused.scales = nn.Parameter(torch.cat([layer.scales for layer in layers]), requires_grad=False)
    return fused


class Fusable(nn.Module):
    """A module whose parallel projections (`FUSED`: fused name -> Meta names) can be merged into one after loading.

    state_dict() still speaks Meta's names (the fused tensors are split back, as views), and load_state_dict()
    accepts them, so checkpoints and tools never see the fused layout.
    """

    FUSED: dict = {}

    def fuse(self) -> None:
        for fused_name, names in self.FUSED.items():
            if getattr(self, fused_name, None) is not None:
                continue
            setattr(self, fused_name, fuse_columns([getattr(self, n) for n in names]))
            for n in names:
                setattr(self, n, None)
        if not getattr(self, "_fuse_hooks", False):
            self._register_state_dict_hook(_split_fused)
            self.register_load_state_dict_pre_hook(_join_fused)
            self._fuse_hooks = True

    @property
    def fused(self) -> bool:
        return any(getattr(self, name, None) is not None for name in self.FUSED)

    def split_sizes(self, fused_name: str):
        return [self.local_sizes[n] for n in self.FUSED[fused_name]]


def _split_fused(module, state_dict, prefix, local_metadata):
    for fused_name, names in module.FUSED.items():
        layer = getattr(module, fused_name, None)
        if layer is not None and layer.scales is not None and layer.scales.dim() == 3:
            continue  # int4's packed layout cannot be cut into rows: kept fused (quant_checkpoint writes Meta names)
        for kind in ("weight", "scales"):
            key = f"{prefix}{fused_name}.{kind}"
            if key in state_dict:
                for name, part in zip(names, state_dict.pop(key).split(module.split_sizes(fused_name))):
                    state_dict[f"{prefix}{name}.{kind}"] = part


def _join_fused(module, state_dict, prefix, *args):
    if not module.fused:
        return
    for fused_name, names in module.FUSED.items():
        for kind in ("weight", "scales"):
            keys = [f"{prefix}{name}.{kind}" for name in names]
            if all(k in state_dict for k in keys):
                state_dict[f"{prefix}{fused_name}.{kind}"] = torch.cat([state_dict.pop(k) for k in keys])
