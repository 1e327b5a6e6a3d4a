"""Training recipes, one per head family (RECIPES[config.family]): init, unroll and loss. Adding a family is a
file here and one entry below."""

from . import eagle3, medusa, mtp
from .base import Labels, Recipe

RECIPES: dict[str, Recipe] = {"eagle3": eagle3.RECIPE, "peagle": eagle3.PEAGLE, "medusa": medusa.RECIPE,
                              "mtp": mtp.RECIPE}

__all__ = ["RECIPES", "Labels", "Recipe"]
