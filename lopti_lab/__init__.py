"""lopti_lab: do low-probability tokens over-dominate RL updates of LLMs, and do AR and Lopti fix it?

The package is layered (an import only points down): ``kk`` (puzzles and rewards, no torch) -> ``theory`` ->
``models`` / ``rollout`` / ``objective`` -> ``probes`` -> ``trainer`` / ``runs`` -> ``labmodel`` -> ``plots`` /
``widgets`` / ``cli``. Importing the top-level package is cheap: submodules load torch only when imported.
"""

__version__ = "0.1.0"
