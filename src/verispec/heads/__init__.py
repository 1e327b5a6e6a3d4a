"""Draft heads: small networks on the target's own hidden states (base.py: the DraftHead interface; one file per
family; io.py: files, FAMILIES and ``load_head``). A new family is one module here, one entry in io.FAMILIES and
one training recipe (training/recipes/)."""

from .base import DraftHead, HeadConfig, to_target_vocab
from .eagle3 import Eagle3Config, Eagle3Head
from .io import FAMILIES, load_head, read_head, save_head
from .medusa import MedusaConfig, MedusaHead
from .mtp import MtpConfig, MtpHead
from .peagle import PEagleConfig, PEagleHead

__all__ = ["FAMILIES", "DraftHead", "Eagle3Config", "Eagle3Head", "HeadConfig", "MedusaConfig", "MedusaHead", "MtpConfig", "MtpHead", "PEagleConfig", "PEagleHead", "load_head",
           "read_head", "save_head", "to_target_vocab"]
