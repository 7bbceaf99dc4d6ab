"""A recipe that reads a folder beside it by a relative path, as the cross-version page
reads its checkpoint saved by torch 2.15.0 (Sphinx-Gallery runs it in the gallery's folder)."""

from pathlib import Path

print("beside the recipe:", Path("recipe_data", "made.txt").read_text().strip())
