"""Run the DefaultStager recipe in one interpreter, as Sphinx-Gallery does, and describe its figure.

The recipe is ``$DEFAULT_STAGER_RECIPE``. Prints the recipe's own output, then one line per axis
of its figure with the number of bars drawn on it, and saves the figure to
``$DEFAULT_STAGER_FIGURE``.
"""

import os
import runpy
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.collections import PolyCollection  # noqa: E402


def main(recipe: str, figure_path: str) -> None:
    sys.path.insert(0, str(Path(recipe).parent))  # Sphinx-Gallery runs beside the recipe
    sys.argv = [recipe]
    runpy.run_path(recipe, run_name="__main__")
    figures = [plt.figure(n) for n in plt.get_fignums()]
    print("figures:", len(figures))
    for axis in figures[0].axes:
        bars = sum(len(c.get_paths()) for c in axis.collections if isinstance(c, PolyCollection))
        print(f"axis {axis.get_title(loc='left')!r}: {bars} bars")
    figures[0].savefig(figure_path)


if __name__ == "__main__":
    main(os.environ["DEFAULT_STAGER_RECIPE"], os.environ["DEFAULT_STAGER_FIGURE"])
