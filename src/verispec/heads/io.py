"""Draft-head files: a directory of config.json + model.safetensors (or pytorch_model.bin) in the family's published
layout (EAGLE-3: the EAGLE authors' and SpecForge's), and ``load_head``: a file made ready to draft for a target.

config.json's ``"family"`` names the family (FAMILIES; a file without it is Medusa or MTP by the keys their authors
write, PUBLISHED, else EAGLE-3, as every published EAGLE-3 head is). Our own files may leave ``lm_head`` out (the target's rows for the draft vocabulary, frozen: a smaller
file) and store matrices as int8 with a per-row scale (``NAME.weight`` int8 + ``NAME.weight_scale``). The draft
vocabulary is stored as published: ``d2t`` offsets (target id = draft id + d2t[draft id]) and ``t2d`` a bool mask.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import VerispecError
from ..models.config import ModelConfig
from .base import DraftHead
from .eagle3 import Eagle3Head
from .medusa import MedusaHead
from .mtp import MtpHead
from .peagle import PEagleHead

if TYPE_CHECKING:
    from ..models.loader import LoadedModel

HEAD_FILE = "model.safetensors"
DEFAULT_FAMILY = "eagle3"  # files without "family": every published EAGLE-3 head, and ours before the field
FAMILIES: dict[str, type[DraftHead]] = {"eagle3": Eagle3Head, "peagle": PEagleHead, "medusa": MedusaHead,
                                        "mtp": MtpHead}
# a published config.json without "family": the key that names its family (MTP: DeepSeek-V3 / MiMo, Qwen3.5)
PUBLISHED = (("medusa_num_heads", "medusa"), ("num_nextn_predict_layers", "mtp"), ("mtp_num_hidden_layers", "mtp"))


def load_head(source: str | Path, target: LoadedModel, device, dtype: torch.dtype) -> DraftHead:
    """A head directory checked against ``target`` and ready to draft on it: the target's embedding table and, when
    the file has no LM head, the target's rows for the head's draft vocabulary; frozen; int8 matrices on CPU."""
    head, has_lm_head = read_head(source, target.config, str(target.source))
    if not has_lm_head:
        head.freeze_target_rows(target.model)
    head = head.to(device, dtype)
    head.attach_target(target.model)
    head.requires_grad_(False)
    head.quantize(8)
    return head


def save_head(head: DraftHead, out: Path, int8: bool = True, with_lm_head: bool = False, extra: dict | None = None):
    """Write config.json + model.safetensors (public names). int8: matrices as int8 + per-row scale."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    sd = {}
    for name, t in head.state_dict().items():
        if name.startswith("lm_head") and not with_lm_head:
            continue
        key = head.public_name(name)
        t = t.detach().float()
        if int8 and t.dim() == 2:
            scale = (t.abs().amax(dim=1) / 127).clamp(min=1e-12)  # [out]
            sd[key] = torch.round(t / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
            sd[key + "_scale"] = scale.contiguous()
        else:
            sd[key] = t.to(torch.bfloat16).contiguous()
    c = head.config
    Vd, V = c.draft_vocab_size, c.vocab_size
    d2t = head.d2t.detach().cpu()
    sd["d2t"] = (d2t - torch.arange(Vd)).contiguous()  # public convention: target id = draft id + d2t[draft id]
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[d2t] = True
    sd["t2d"] = t2d
    save_file(sd, str(out / HEAD_FILE))
    cfg = {**c.to_json(), "family": c.family, **(extra or {})}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def read_head(path: str | Path, target_cfg: ModelConfig, target_name: str = "the target") -> tuple[DraftHead, bool]:
    """A head directory -> (head on CPU in float32, whether the file carries its own lm_head). One line for a
    missing, corrupt or mismatched head."""
    path = Path(path)
    name = str(path)
    if not (path / "config.json").is_file():
        raise VerispecError(f"draft head {name}: no config.json there")
    try:
        raw = json.loads((path / "config.json").read_text())
        if not isinstance(raw, dict):
            raise TypeError("not a JSON object")
        family = raw.get("family") or next((f for key, f in PUBLISHED if key in raw), DEFAULT_FAMILY)
        if family not in FAMILIES:
            raise VerispecError(f"draft head {name}: unknown family {family!r} (known: {', '.join(sorted(FAMILIES))})")
        cls = FAMILIES[family]
        c = cls.Config.from_json(raw, target_cfg)
    except (ValueError, KeyError, TypeError) as e:
        raise VerispecError(f"draft head {name}: unreadable config.json ({type(e).__name__}: {e})") from None
    c.check_target(target_cfg, name, target_name)
    sd = _read_tensors(path, name)
    sd = {k.removeprefix("model."): v for k, v in sd.items()}
    head = cls(c)
    own = {}
    for key, t in sd.items():
        if key.endswith("_scale") or key in ("d2t", "t2d") or key.startswith("embed_tokens"):
            continue  # some published heads carry the target's embedding table: not the head's to load
        if key + "_scale" in sd:
            t = t.float() * sd[key + "_scale"].float()[:, None]
        ours = head.our_name(key)
        if ours is not None:  # None: not the head's (the trunk around an MTP module, a copy of the LM head)
            own[ours] = t.float()
    expected = {k: v.shape for k, v in head.state_dict().items()}
    has_lm_head = "lm_head.weight" in own
    for key, shape in expected.items():
        if key == "lm_head.weight" and not has_lm_head:
            continue
        if key not in own:
            raise VerispecError(f"draft head {name}: tensor {key} missing")
        if tuple(own[key].shape) != tuple(shape):
            raise VerispecError(f"draft head {name} does not fit target {target_name}: {key} is "
                                f"{tuple(own[key].shape)}, the target needs {tuple(shape)}")
    unknown = sorted(set(own) - set(expected))
    if unknown:
        raise VerispecError(f"draft head {name}: unexpected tensor {unknown[0]}")
    with torch.no_grad():
        for key, param in head.state_dict().items():
            if key in own:
                param.copy_(own[key])
    head.d2t = _draft_ids(sd, c.draft_vocab_size, c.vocab_size, name)
    return head, has_lm_head


def _draft_ids(sd: dict, Vd: int, V: int, name: str) -> torch.Tensor:
    """[Vd] the target id of each draft row: from d2t offsets, else t2d's set rows in order, else the identity."""
    if "d2t" in sd:
        d2t = sd["d2t"].long() + torch.arange(Vd)
    elif "t2d" in sd:
        d2t = torch.nonzero(sd["t2d"].bool())[:, 0]
    else:
        d2t = torch.arange(Vd)
    if d2t.shape != (Vd,) or d2t.min() < 0 or d2t.max() >= V:
        raise VerispecError(f"draft head {name}: d2t does not map {Vd} draft rows into the target's {V}")
    return d2t


def _read_tensors(path: Path, name: str) -> dict[str, torch.Tensor]:
    st, bins = sorted(path.glob("*.safetensors")), sorted([*path.glob("*.bin"), *path.glob("*.pt")])
    if not st and not bins:
        raise VerispecError(f"draft head {name}: no *.safetensors, *.bin or *.pt file")
    sd = {}
    try:
        if st:
            from safetensors.torch import load_file
            for f in st:
                sd.update(load_file(str(f)))
        else:
            for f in bins:
                sd.update(torch.load(str(f), map_location="cpu", weights_only=True))
    except Exception as e:  # noqa: BLE001 - any unreadable file is one line
        raise VerispecError(f"draft head {name}: unreadable weights ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})") from None
    return sd
